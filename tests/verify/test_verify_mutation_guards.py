"""Guards that kill the mutants of verify-cache's checks that tests/verify let live (issue 81,
benchmarks/mutation). Each check is called directly on a small synthetic cache whose content is
written for the test (ShardWriter, no target model), with a fault planted where the test says;
the expected verdicts, counts, rates and messages are worked out by hand from that content and
the rules in DESIGN 5, 6 and 10, not computed by the code under test. One section a check module
(the `# --- name` headers): benchmarks/mutation/run.py runs a module's own section first."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from harness.caches import damage_byte, edit_record, resign
from pipeline.cache.address import open_location
from pipeline.cache.identity import Difference, parse_identity
from pipeline.cache.manifest import SourcesRecord, new_manifest
from pipeline.cache.reader import CacheReader
from pipeline.cache.schema import Chunking
from pipeline.cache.writer import ShardWriter
from pipeline.files import write_json_atomic
from pipeline.verify import bounded_reads, label_checks
from pipeline.verify.chunk_checks import TapSignatures, check_chunks
from pipeline.verify.label_checks import check_alignment, misaligned_samples
from pipeline.verify.sample_checks import check_loss_masks, check_mask_boundaries
from pipeline.verify.selection_checks import (
    check_completeness,
    check_target_identity,
    select_shards,
)
from pipeline.verify.structure_checks import (
    check_digests,
    check_provenance,
    check_structure,
)

TAPS = [1, 2, 3]
HIDDEN = 4
TOP_K = 3
VOCAB = 512
# hidden: 3 x 4 x 2 = 24 bytes a token -> 16-token chunks (the floor), 2 a file; small arrays: 4-token
# chunks, 2 a file.
SMALL = Chunking(hidden_chunk_bytes=64, hidden_chunks_per_file=2, small_chunk_tokens=4, small_chunks_per_file=2)
# Conversations are hundreds of tokens: 256-token chunks, 4 a file.
CONVERSATION = Chunking(hidden_chunk_bytes=24 * 256, hidden_chunks_per_file=4, small_chunk_tokens=256,
                        small_chunks_per_file=4)
MADE_UP = "synthetic (tests/verify/test_verify_mutation_guards.py)"


def bf16_bits(values) -> np.ndarray:
    return torch.as_tensor(np.asarray(values, np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def aligned_sample(ids, mask, *, seed=0, scales=(1.0, 2.0, 4.0)) -> dict:
    """A sample whose labels are the next token (DESIGN 10: argmax at t-1 is the token at t), with
    a consistent top-k, and taps of RMS `scales` (the residual stream growing with depth)."""
    ids = np.asarray(ids, np.int32)
    n = len(ids)
    argmax = np.append(ids[1:], 511).astype(np.int32)
    rng = np.random.default_rng(seed)
    taps = np.stack([rng.choice([-1.0, 1.0], (n, HIDDEN)) * s for s in scales], axis=1)  # |value| = scale exactly
    return {"input_ids": ids, "loss_mask": np.asarray(mask, np.uint8), "target_argmax": argmax,
            "target_topk_ids": np.stack([argmax, (argmax + 1) % VOCAB, (argmax + 2) % VOCAB], axis=1).astype(np.int32),
            "target_topk_logits": np.tile(np.array([3.0, 2.0, 1.0], np.float32), (n, 1)),
            "target_logsumexp": np.full(n, 3.5, np.float32), "hidden": taps}


def fp8_rows(values) -> dict[str, np.ndarray]:
    """DESIGN 5's fp8 mode: e4m3 bits of value / scale, the scale per token and row (its largest
    magnitude / 448, the largest finite e4m3)."""
    x = torch.as_tensor(np.asarray(values, np.float32))
    scale = x.abs().amax(dim=-1).clamp_min(1e-12) / 448.0
    bits = (x / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    return {"hidden": bits, "hidden_scale": scale.numpy().astype(np.float32)}


def build(root: Path, samples: list[dict], shards: list[list[int]], *, num_shards=None, attrs=None,
          run_records=None, dataset=True, chunking=SMALL, fmt="bf16", projected_rank=None, scales=None, taps=None,
          hidden=HIDDEN, layers=5) -> Path:
    """A cache at root/cache: shard k holds samples[i] for i in shards[k] (sample id = i, its row
    in the dataset, written pre-tokenized to root/data.jsonl). `projected_rank`: a projected cache of R values
    a token (the samples' "hidden" then [tokens, 1, R]); `scales` {sample: fp8 scales to store};
    `taps`, `hidden`, `layers`: the target's tap layers, width and depth."""
    taps = taps or TAPS
    cache = root / "cache"
    cache.mkdir(parents=True)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": s["input_ids"].tolist(), "loss_mask": s["loss_mask"].tolist()})
                            + "\n" for s in samples))
    capture = {"target_layer_ids": taps, "tap_convention": MADE_UP, "num_hidden_layers": layers, "hidden_size": hidden,
               "vocab_size": VOCAB, "top_k": TOP_K, "hidden_format": fmt, "stored_dtype": MADE_UP,
               "compute_dtype": "float32", "max_length": 4096, "overlong": "error", "on_error": "fail",
               "zstd_level": 3, "checksum": MADE_UP, "storage": chunking.record()}
    if projected_rank is not None:
        capture["projection"] = {"rank": projected_rank, "digest": "0" * 64, "energy": 0.9, "pilot_tokens": 64, "pilot": MADE_UP}
    identity = parse_identity({
        "num_shards": num_shards or len(shards),
        "target": {"model_type": MADE_UP, "config_sha256": MADE_UP, "num_hidden_layers": layers, "weights": {}},
        "tokenizer": {"files_sha256": MADE_UP, "chat_template_sha256": MADE_UP, "chat_template_kwargs": None,
                      "thinking": "on", "generation_prompt": "", "reasoning": "keep", "boundary_tokens": MADE_UP,
                      "end_of_turn": "<|im_end|>"},
        "data": {"num_rows": len(samples), "files": [{"path": "data.jsonl", "sha256": hashlib.sha256(
            data.read_bytes()).hexdigest()}], "generated_by": None},
        "capture": capture})
    plan = {"assignment": MADE_UP, "num_rows": len(samples), "num_shards": num_shards or len(shards), "storage": {}}
    manifest = new_manifest(identity=identity, provenance={}, plan=plan,
                            sources=SourcesRecord(data=[str(data)] if dataset else []))
    write_json_atomic(cache / "manifest.json", manifest.to_json())
    location = open_location(cache)
    dims = {"n_taps": len(taps), "hidden_size": hidden, "top_k": TOP_K,
            **({"projected_rank": projected_rank} if projected_rank is not None else {})}
    for k, members in enumerate(shards):
        writer = ShardWriter(location, k, dims=dims, hidden_format=fmt,
                             num_tokens=sum(len(samples[i]["input_ids"]) for i in members),
                             chunking=chunking, attrs={"kernels": {"path": "torch"}, **((attrs or {}).get(k) or {})})
        writer.run_record.update((run_records or {}).get(k) or {})
        for i in members:
            rows = {n: v for n, v in samples[i].items() if n != "hidden"}
            if fmt == "bf16":
                rows["hidden"] = bf16_bits(samples[i]["hidden"])
            else:
                rows.update(fp8_rows(samples[i]["hidden"]))
                if scales and i in scales:
                    rows["hidden_scale"] = np.asarray(scales[i], np.float32)
            writer.append(i, rows)
        writer.commit()
    return cache


def distinct_ids(n: int, start: int) -> list[int]:
    return [(start + j) % 500 for j in range(n)]


def simple_samples(count: int = 6, length: int = 6) -> list[dict]:
    return [aligned_sample(distinct_ids(length, 10 * i), [0] + [1] * (length - 1), seed=i) for i in range(count)]


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """Six samples of 6 tokens in two shards of three (18 tokens each)."""
    return build(tmp_path_factory.mktemp("good"), simple_samples(), [[0, 1, 2], [3, 4, 5]])


def projected_samples() -> list[dict]:
    """Three aligned 6-token samples whose stored row is R = 2 projected values (sample i's all 1.5 + i)."""
    samples = [aligned_sample(distinct_ids(6, 10 * i), MASK6, seed=i) for i in range(3)]
    for i, s in enumerate(samples):
        s["hidden"] = np.full((6, 1, 2), 1.5 + i, np.float32)
    return samples


def projected_cache(root: Path, *, basis_projected_rank=2, basis_width=12, stored=True) -> tuple[Path, str]:
    """A cache projected to R = 2 values a token (3 taps x 4: 12 tap values) and its basis file
    (of `basis_projected_rank` components of `basis_width` values), the manifest naming the basis's digest."""
    from pipeline.projection.basis import TapBasis
    from pipeline.projection.basis_file import store_basis

    cache = build(root, projected_samples(), [[0, 1, 2]], projected_rank=2)
    basis = TapBasis(components=torch.eye(basis_projected_rank, basis_width), scales=torch.ones(basis_projected_rank), energy=0.875,
                     pilot_tokens=64)
    if stored:
        store_basis(open_location(cache), basis, "synthetic")
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["config"]["capture"]["projection"]["digest"] = basis.digest()
    (cache / "manifest.json").write_text(json.dumps(manifest))
    return cache, basis.digest()


# ----------------------------------------------------------------------------------- selection


def test_select_shards_orders_by_index_and_leaves_broken_shards_out_unless_asked(good, tmp_path):
    import shutil

    copy = tmp_path / "cache"
    shutil.copytree(good, copy)
    reader = CacheReader(copy)
    assert select_shards(reader, None) == ["shard-00000", "shard-00001"]
    assert select_shards(reader, "1") == ["shard-00001"]
    with open(copy / "shard-00000" / "input_ids" / "c.0", "ab") as f:
        f.write(b"x")  # no longer the size its record lists: not committed
    reader = CacheReader(copy)
    assert select_shards(reader, None) == ["shard-00001"]
    assert select_shards(reader, None, broken=True) == ["shard-00000", "shard-00001"]
    assert select_shards(reader, "0", broken=True) == ["shard-00000"]
    with pytest.raises(TypeError):
        select_shards(reader, None, True)


def test_completeness_names_the_shards_not_committed(tmp_path):
    cache = build(tmp_path, simple_samples(), [[0, 1, 2], [3, 4, 5]], num_shards=3)
    reader = CacheReader(cache)
    check = check_completeness(reader, None)
    assert not check.passed
    # shard 2 of 3 holds rows 6*2//3 .. 6*3//3 = 4..5 of the plan's 6 rows
    assert check.summary == ("1 of 3 shards not committed (shard-00002): 2 of 6 dataset rows are not in the cache; "
                             "extract the missing shards (same command)")
    check = check_completeness(reader, "0-1")
    assert check.passed and check.summary == "all 2 shards committed" and check.evidence["checked"] == 2


def test_a_target_that_is_not_the_caches_is_named(good, embedded, tokenizer):
    check = check_target_identity(CacheReader(good), embedded.TARGET_DIR, tokenizer)
    assert not check.passed
    assert check.summary.startswith(f"{embedded.TARGET_DIR}: ")
    # The synthetic cache claims 4-wide taps; the embedded target's hidden size is 128.
    assert "capture.hidden_size: cache 4 vs target 128" in check.summary and "match the manifest" not in check.summary
    assert "capture.hidden_size" in check.evidence["fields"]


# ----------------------------------------------------------------------------------- structure


def edit_array(cache: Path, shard: str, name: str, values, **create) -> None:
    """Rewrite one array of a committed shard (Zarr, as a writer with a bug would) and re-sign the
    shard's record, so the checks after the digest check see the content."""
    import zarr

    group = zarr.open_group(str(cache / shard), mode="a")
    old = group[name]
    kwargs = {"chunks": old.chunks, "shards": old.shards, "compressors": old.compressors, "fill_value": 0,
              "chunk_key_encoding": {"name": "default", "separator": "."}, "attributes": dict(old.attrs),
              "config": {"write_empty_chunks": True}, **create}
    values = np.asarray(values)
    del group[name]
    group.create_array(name, shape=values.shape, dtype=kwargs.pop("dtype", values.dtype), **kwargs)[:] = values
    resign(cache, shard)


@pytest.fixture
def copy(good, tmp_path) -> Path:
    import shutil

    shutil.copytree(good, tmp_path / "cache")
    return tmp_path / "cache"


def test_a_sound_cache_passes_structure_and_digests(good):
    reader = CacheReader(good)
    check = check_structure(reader, ["shard-00000", "shard-00001"])
    assert check.passed and check.summary == "2 shards: counts, offsets, dtypes, shapes, chunking as declared"
    files = sum(1 for p in good.glob("shard-*/**/*") if p.is_file() and p.name != "digests.json")
    check = check_digests(reader, ["shard-00000", "shard-00001"], True)
    assert check.passed and check.summary == (f"sha256 of {files} files in 2 shards match their shards' digests.json "
                                              "and the manifest")
    skipped = check_digests(reader, ["shard-00000"], False)
    assert skipped.passed and skipped.skipped and skipped.summary.startswith("skipped")


def structure_problems(cache: Path, shards=("shard-00000", "shard-00001")) -> list[str]:
    check = check_structure(CacheReader(cache, foreign="report"), list(shards))
    assert check.passed == (not check.evidence["problems"])
    if check.evidence["problems"]:
        assert check.summary.endswith(f"; {len(check.evidence['problems'])} problems")
    return check.evidence["problems"]


def test_offsets_must_rise_strictly_from_0(copy):
    edit_array(copy, "shard-00000", "offsets", np.array([0, 6, 6, 18], np.int64))
    assert structure_problems(copy) == ["shard-00000: offsets are not strictly increasing from 0"]
    edit_array(copy, "shard-00000", "offsets", np.array([1, 6, 12, 18], np.int64))
    assert structure_problems(copy) == ["shard-00000: offsets are not strictly increasing from 0"]
    # A one-token sample is a sample: offsets 0, 1, ... rise strictly.
    edit_array(copy, "shard-00000", "offsets", np.array([0, 1, 12, 18], np.int64))
    assert structure_problems(copy) == []


def test_a_shard_whose_offsets_end_elsewhere_disagrees_with_its_record(copy):
    edit_array(copy, "shard-00000", "offsets", np.array([0, 6, 12, 17], np.int64))
    problems = structure_problems(copy)
    assert problems[0] == "shard-00000: 3 samples / 17 tokens on disk, manifest says 3 / 18"
    # and every token array is one token longer than the offsets say
    assert problems[1:] == [f"shard-00000/{name}: {dtype}(18{inner}), declared {dtype}(17{inner})" for name, dtype, inner in (
        ("input_ids", "int32", ","), ("loss_mask", "uint8", ","), ("target_argmax", "int32", ","),
        ("target_topk_ids", "int32", ", 3"), ("target_topk_logits", "float32", ", 3"),
        ("target_logsumexp", "float32", ","), ("hidden", "uint16", ", 3, 4"))]


def test_repeated_sample_ids(copy):
    edit_array(copy, "shard-00001", "sample_id", np.array([3, 4, 3], np.int64))
    assert structure_problems(copy) == ["shard-00001: repeated sample ids"]


def test_a_dtype_or_shape_other_than_the_schemas(copy):
    edit_array(copy, "shard-00000", "loss_mask", np.ones(18, np.int32))
    assert structure_problems(copy) == ["shard-00000/loss_mask: int32(18,), declared uint8(18,)"]
    edit_array(copy, "shard-00000", "loss_mask", np.ones(18, np.uint8))
    edit_array(copy, "shard-00000", "target_topk_ids", np.zeros((18, 2), np.int32), chunks=(4, 2), shards=(8, 2))
    assert structure_problems(copy) == ["shard-00000/target_topk_ids: int32(18, 2), declared int32(18, 3)"]


def test_chunking_other_than_the_manifests(copy):
    reader = CacheReader(copy)
    hidden = reader.shard(0).group["hidden"][:]
    edit_array(copy, "shard-00000", "hidden", hidden, chunks=(16, 3, 4), shards=(16, 3, 4))
    assert structure_problems(copy) == [("shard-00000/hidden: 16-token chunks in (16, 3, 4)-token files, the "
                                         "manifest's chunking gives (16, 32)")]


def test_shard_attributes_must_agree_with_the_record(copy):
    path = copy / "shard-00001" / "zarr.json"
    meta = json.loads(path.read_text())
    meta["attributes"]["kernels"] = {"path": "fla"}
    path.write_text(json.dumps(meta))
    resign(copy, "shard-00001")
    assert structure_problems(copy) == ["shard-00001: shard attribute 'kernels' disagrees with the manifest"]


def test_broken_missing_and_unreadable_shards_are_each_named_and_the_rest_still_checked(copy):
    with open(copy / "shard-00000" / "input_ids" / "c.0", "ab") as f:
        f.write(b"x")
    edit_record(copy, "shard-00001", lambda r: r.update(samples=4))  # its arrays declare 3
    # A shard the manifest lists (as caches did before commit records) that is not on disk.
    manifest = json.loads((copy / "manifest.json").read_text())
    record = json.loads((copy / "shard-00001" / "digests.json").read_text())["shard"]
    manifest["shards"]["shard-00002"] = record
    (copy / "manifest.json").write_text(json.dumps(manifest))
    reader = CacheReader(copy, foreign="report")
    assert select_shards(reader, None, broken=True) == ["shard-00000", "shard-00001", "shard-00002"]
    # in this order each problem comes after another kind: none stops the checks of the shards after it
    problems = check_structure(reader, ["shard-00002", "shard-00000", "shard-00001"]).evidence["problems"]
    assert len(problems) == 3
    assert problems[0] == "shard-00002: listed in the manifest but missing on disk"
    assert "shard-00000" in problems[1] and "input_ids/c.0" in problems[1]
    assert "shard-00001/offsets: declares shape (4,), but the manifest says 4 samples and 18 tokens" in problems[2]
    # Missing shards are left to the structure check by the digest check, which goes on to the next.
    assert check_digests(reader, ["shard-00002"], True).passed
    digests = check_digests(reader, ["shard-00002", "shard-00000"], True)
    # (a shard whose record does not match its files is not committed: no record digest to compare)
    assert digests.evidence["mismatched"] == ["shard-00000/input_ids/c.0: sha256 or size differs from digests.json"]


def test_evidence_keeps_the_first_50_problems(good):
    reader = CacheReader(good)
    names = [f"shard-{i:05d}" for i in range(2, 53)]
    reader.manifest = dataclasses.replace(reader.manifest, broken={n: f"{n}: broken" for n in names})
    check = check_structure(reader, names)
    assert check.summary.endswith("; 51 problems") and check.evidence["problems"] == [f"{n}: broken" for n in names[:50]]


def test_every_file_differing_from_its_record_is_named(copy):
    (copy / "shard-00000" / "stray.bin").write_bytes(b"not listed")
    path = copy / "shard-00001" / "loss_mask" / "c.0"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # same size, other bytes
    path.write_bytes(bytes(data))
    edit_record(copy, "shard-00001", lambda r: r.update(digest="sha256:" + "0" * 64))
    reader = CacheReader(copy)
    check = check_digests(reader, ["shard-00000", "shard-00001"], True)
    assert not check.passed
    assert check.evidence["mismatched"] == ["shard-00000/stray.bin: not listed in digests.json",
                                            "shard-00000: digest of its files differs from its commit record",
                                            "shard-00001/loss_mask/c.0: sha256 or size differs from digests.json",
                                            "shard-00001: digest of its files differs from its commit record"]
    assert check.summary.endswith(": 4 mismatches")


def test_a_listed_file_missing_and_a_shard_without_a_record_are_named_in_order(copy):
    (copy / "shard-00000" / "input_ids" / "c.1").unlink()  # listed: the shard is no longer committed
    (copy / "shard-00001" / "digests.json").unlink()
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["shards"]["shard-00001"] = json.loads((copy / "shard-00000" / "digests.json").read_text())["shard"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    reader = CacheReader(copy, foreign="report")
    check = check_digests(reader, ["shard-00001", "shard-00000"], True)
    bad = check.evidence["mismatched"]
    assert len(bad) == 2 and bad[0].startswith("shard-00001 (") and "digests.json" in bad[0]
    assert bad[1] == "shard-00000/input_ids/c.1: listed in digests.json but missing"


def test_digest_evidence_keeps_the_first_50(tmp_path):
    one = Chunking(hidden_chunk_bytes=64, hidden_chunks_per_file=1, small_chunk_tokens=1, small_chunks_per_file=1)
    copy = build(tmp_path, simple_samples(3), [[0, 1, 2]], chunking=one)
    files = sorted(p for p in (copy / "shard-00000").rglob("c.*") if p.is_file())
    assert len(files) >= 51
    for path in files[:51]:
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
    check = check_digests(CacheReader(copy), ["shard-00000"], True)
    assert check.summary.endswith(": 52 mismatches")  # 51 files and the shard's digest
    assert len(check.evidence["mismatched"]) == 50


def test_the_basis_named_by_the_manifest_is_checked_against_its_capture(tmp_path):
    from pipeline.verify.structure_checks import check_basis

    cache, digest = projected_cache(tmp_path / "good")
    check = check_basis(CacheReader(cache))
    assert check.passed and check.summary == (f"basis.safetensors: basis {digest[:12]} as the manifest names, 2 "
                                              "components of 12 tap values, keeping 0.875 of the energy of a 64-token "
                                              "pilot")
    assert check.evidence == {"digest": digest, "rank": 2, "width": 12, "energy": 0.875, "pilot_tokens": 64}
    cache, digest = projected_cache(tmp_path / "rank", basis_projected_rank=3)
    check = check_basis(CacheReader(cache))
    assert not check.passed and check.summary == "basis.safetensors: rank 3, the manifest's capture says 2"
    assert check.evidence == {"digest": digest}
    cache, _ = projected_cache(tmp_path / "width", basis_width=10)
    check = check_basis(CacheReader(cache))
    assert not check.passed and check.summary == "basis.safetensors: width 10, the manifest's capture says 12"
    cache, _ = projected_cache(tmp_path / "missing", stored=False)
    check = check_basis(CacheReader(cache))
    assert not check.passed and check.summary.startswith(f"{cache / 'basis.safetensors'}: missing")


# ---------------------------------------------------------------------------------- provenance


def provenance(cache, shards=("shard-00000", "shard-00001")):
    return check_provenance(CacheReader(cache, foreign="report"), list(shards))


def test_one_kernel_path_passes(good):
    check = provenance(good)
    assert check.passed
    assert check.summary == "kernel path torch across 2 shards; taps [1, 2, 3], hidden 4, vocab 512"
    assert check.evidence["kernel_paths"] == {"torch": 2} and check.evidence["environments"] == {
        "(None, None, None, None)": 2}
    assert check.evidence["target"] == {"model_type": MADE_UP, "config_sha256": MADE_UP, "num_hidden_layers": 5}


def test_mixed_and_unknown_kernel_paths_fail(tmp_path):
    samples = simple_samples()
    mixed = build(tmp_path / "m", samples, [[0, 1, 2], [3, 4, 5]], attrs={1: {"kernels": {"path": "fla"}}},
                  run_records={0: {"environment": {"torch": "2.13", "transformers": "5.2"}}})
    check = provenance(mixed)
    assert not check.passed and check.summary.startswith("kernel path torch/fla across 2 shards (MIXED); taps")
    assert check.evidence["environments"] == {"('2.13', '5.2', None, None)": 1, "(None, None, None, None)": 1}
    unknown = build(tmp_path / "u", samples, [[0, 1, 2], [3, 4, 5]], attrs={0: {"kernels": {}}, 1: {"kernels": {}}})
    check = provenance(unknown)
    assert not check.passed
    assert check.summary.startswith("kernel path unknown across 2 shards (UNKNOWN for 2 shards: the linear-attention "
                                    "implementation was not identified); taps")


def test_a_shard_of_another_identity_fails_provenance(tmp_path):
    other = "a-config-digest-of-another-target-0123456789"
    cache = build(tmp_path, simple_samples(), [[0, 1, 2], [3, 4, 5]],
                  attrs={1: {"identity": {"target_config_sha256": other}}})
    check = provenance(cache)
    assert not check.passed
    assert check.evidence["problems"] == [(f"shard-00001: target_config_sha256 {other[:16]} differs from the "
                                           f"cache's {MADE_UP[:16]}")]
    assert check.summary.startswith("kernel path torch across 2 shards; 1 shards disagree with the cache identity; taps")


def test_provenance_evidence_keeps_the_first_50(good):
    reader = CacheReader(good)
    record = reader.manifest.shards["shard-00000"]
    names = [f"shard-{i:05d}" for i in range(51)]
    reader.manifest = dataclasses.replace(reader.manifest, shards={n: record for n in names})
    reader.foreign = {n: [Difference("target.config_sha256", "config", "a", "b")] for n in names}
    check = check_provenance(reader, names)
    assert len(check.evidence["problems"]) == 50 and check.summary.count("51 shards disagree") == 1


# ------------------------------------------------------------------------------ sample checks


@pytest.fixture(scope="module")
def conversations(tokenizer, train_rows):
    """Twelve embedded conversations as extract masks them (ids and mask), in samples of their own."""
    from pipeline.data.conversations import parse_row
    from pipeline.data.loss_mask import ConversationMasker
    from pipeline.data.samples import row_tokens

    masker = ConversationMasker(tokenizer, "<|im_end|>", None, "keep")
    out = []
    for i, row in enumerate(train_rows[:12]):
        ids, mask, _ = row_tokens(parse_row(i, f"row {i}", row), masker)
        out.append(aligned_sample(ids, mask, seed=i))
    return out


def test_a_stored_mask_or_id_unlike_the_datasets_is_named(tmp_path, conversations, tokenizer):
    good = build(tmp_path / "good", conversations, [list(range(6)), list(range(6, 12))], chunking=CONVERSATION)
    check = check_loss_masks(CacheReader(good), ["shard-00000", "shard-00001"], tokenizer)
    assert check.passed and check.summary == "12 samples re-derived from the chat template: identical"
    assert check.evidence["samples"] == 12
    planted = [dict(s) for s in conversations]
    planted[2] = {**planted[2], "loss_mask": planted[2]["loss_mask"].copy()}
    at = int(np.flatnonzero(planted[2]["loss_mask"])[3])
    planted[2]["loss_mask"][at] = 0
    planted[9] = {**planted[9], "input_ids": planted[9]["input_ids"].copy()}
    planted[9]["input_ids"][5] += 1
    # The stored content differs from the dataset the manifest names (the one `good` was written from).
    bad = build(tmp_path / "planted", planted, [list(range(6)), list(range(6, 12))], chunking=CONVERSATION)
    data = (tmp_path / "planted" / "data.jsonl")
    data.write_bytes((tmp_path / "good" / "data.jsonl").read_bytes())
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["config"]["data"]["files"][0]["sha256"] = hashlib.sha256(data.read_bytes()).hexdigest()
    (bad / "manifest.json").write_text(json.dumps(manifest))
    check = check_loss_masks(CacheReader(bad), ["shard-00001", "shard-00000"], tokenizer)
    assert not check.passed
    assert check.evidence["offending_samples"] == 2 and check.evidence["samples"] == 12
    assert check.evidence["first_offending"] == [
        f"sample 9 (shard-00001): {data}:10: input_ids differ from re-tokenization",
        f"sample 2 (shard-00000): {data}:3: loss_mask differs first at position {at}"]
    assert check.summary.startswith("12 samples re-derived from the chat template: 2 samples, e.g. sample 9")


def test_rows_that_cannot_be_read_or_re_derived_are_named_and_the_rest_still_compared(tmp_path, tokenizer):
    samples = simple_samples(4)
    cache = build(tmp_path, samples, [[0, 1, 2, 3]])
    data = tmp_path / "data.jsonl"
    rows = data.read_text().splitlines()
    rows[1] = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    rows[2] = json.dumps({"input_ids": "not a list"})
    rows[3] = json.dumps({"input_ids": [1, 2, 3, 4, 5, 6], "loss_mask": [0, 1, 1, 1, 1, 1]})
    data.write_text("\n".join(rows) + "\n")
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["config"]["data"]["files"][0]["sha256"] = hashlib.sha256(data.read_bytes()).hexdigest()
    # an end of turn that closes no assistant turn of the template: a conversation row cannot be masked
    manifest["config"]["tokenizer"]["end_of_turn"] = "<|endoftext|>"
    (cache / "manifest.json").write_text(json.dumps(manifest))
    check = check_loss_masks(CacheReader(cache), ["shard-00000"], tokenizer)
    assert not check.passed and check.evidence["samples"] == 4 and check.evidence["offending_samples"] == 3
    assert check.evidence["first_offending"] == [
        (f"sample 1 (shard-00000): cannot be re-derived ({data}:2: assistant turn 0 is not closed by "
         "'<|endoftext|>' in the rendering)"),
        "sample 2 (shard-00000): row not readable in the dataset",
        f"sample 3 (shard-00000): {data}:4: input_ids differ from re-tokenization"]


def test_the_dataset_must_be_the_one_the_cache_was_made_with(tmp_path, conversations, tokenizer):
    cache = build(tmp_path, conversations[:4], [[0, 1], [2, 3]], chunking=CONVERSATION)
    (tmp_path / "data.jsonl").write_text((tmp_path / "data.jsonl").read_text() + "\n")
    check = check_loss_masks(CacheReader(cache), ["shard-00000"], tokenizer)
    assert not check.passed and not check.skipped and "differ from the ones the cache was made with" in check.summary
    (tmp_path / "data.jsonl").unlink()
    check = check_loss_masks(CacheReader(cache), ["shard-00000"], tokenizer)
    assert check.passed and check.skipped
    unnamed = build(tmp_path / "u", conversations[:2], [[0, 1]], dataset=False, chunking=CONVERSATION)
    check = check_loss_masks(CacheReader(unnamed), ["shard-00000"], tokenizer)
    assert check.passed and check.skipped


def test_mask_boundaries_name_each_kind_of_violation(tmp_path, conversations, tokenizer):
    good = build(tmp_path / "good", conversations, [list(range(6)), list(range(6, 12))], chunking=CONVERSATION)
    check = check_mask_boundaries(CacheReader(good), ["shard-00000", "shard-00001"], tokenizer)
    assert check.passed and check.summary.startswith("12 samples: headers, system/user/tool turns unsupervised; "
                                                     "<|im_end|> supervised")
    planted = [dict(s) for s in conversations]
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    for k in (1, 7):
        mask = planted[k]["loss_mask"].copy()
        mask[int(np.flatnonzero(planted[k]["input_ids"] == start)[0])] = 1  # a header supervised
        planted[k] = {**planted[k], "loss_mask": mask}
    bad = build(tmp_path / "bad", planted, [list(range(6)), list(range(6, 12))], chunking=CONVERSATION)
    check = check_mask_boundaries(CacheReader(bad), ["shard-00000", "shard-00001"], tokenizer)
    assert not check.passed and check.summary.startswith("12 samples: ")
    named = sorted(s for v in check.evidence["violations"].values() for s in v["first_offending"])
    assert named == ["sample 1 (shard-00000): position 0", "sample 7 (shard-00001): position 0"]
    assert sum(v["offending_samples"] for v in check.evidence["violations"].values()) == 2


def test_an_unreadable_shard_is_left_to_the_checksum_check(tmp_path, conversations, tokenizer):
    cache = build(tmp_path, conversations[:4], [[0, 1], [2, 3]], chunking=CONVERSATION)
    for path in (cache / "shard-00000" / "input_ids").glob("c.*"):
        damage_byte(path, 3)
    resign(cache, "shard-00000")
    reader = CacheReader(cache)
    check = check_loss_masks(reader, ["shard-00000", "shard-00001"], tokenizer)
    assert check.passed and check.evidence["samples"] == 2  # shard 1's two samples
    check = check_mask_boundaries(reader, ["shard-00000", "shard-00001"], tokenizer)
    assert check.passed and check.evidence["samples"] == 2


def test_without_turn_markers_the_boundaries_are_not_checked(good):
    class NoChat:
        def get_vocab(self):
            return {"a": 0}

    check = check_mask_boundaries(CacheReader(good), ["shard-00000"], NoChat())
    assert check.passed and check.skipped


# ------------------------------------------------------------------------------------- labels


def labelled(ids, mask, offsets, seed=0) -> dict:
    """A sample whose argmax at u is ids[u + offsets[u]]: 1 is in place (the next token), 0 one
    position late, 2 one early; None (or past the end) a token the sample does not hold."""
    sample = aligned_sample(ids, mask, seed=seed)
    n = len(ids)
    arg = np.array([ids[u + k] if k is not None and u + k < n else 511 for u, k in enumerate(offsets)], np.int32)
    sample["target_argmax"] = arg
    sample["target_topk_ids"] = np.stack([arg, (arg + 1) % VOCAB, (arg + 2) % VOCAB], axis=1).astype(np.int32)
    return sample


MASK6 = [0, 1, 1, 1, 1, 1]


def six(i, offsets, mask=MASK6) -> dict:
    return labelled(distinct_ids(6, 10 * i), mask, offsets, seed=i)


@pytest.fixture(params=[None, 8, 13], ids=["whole-shard", "1-sample-windows", "2-sample-windows"])
def windows(request, monkeypatch):
    """Windows of whole samples are a memory bound only: every result is the same whatever their size."""
    if request.param is not None:
        monkeypatch.setattr(label_checks, "sample_windows",
                            lambda offsets: bounded_reads.sample_windows(offsets, request.param))
    return request.param


def alignment(tmp_path, samples, shards):
    cache = build(tmp_path, samples, shards)
    return check_alignment(CacheReader(cache), [f"shard-{k:05d}" for k in range(len(shards))])


def aligned_cache_samples() -> list[dict]:
    samples = [six(i, [1] * 6) for i in range(5)] + [six(5, [1] * 6, mask=[1] * 6)]
    # Sorted top-k logits with a tie, and a logsumexp exactly at the top logit less the 1e-3 rounding allowance.
    samples[3]["target_topk_logits"] = samples[3]["target_topk_logits"].copy()
    samples[3]["target_topk_logits"][2] = [3.0, 3.0, 2.0]
    samples[3]["target_logsumexp"] = samples[3]["target_logsumexp"].copy()
    samples[3]["target_logsumexp"][4] = np.float32(3.0) - np.float32(1e-3)
    return samples


def test_aligned_labels_pass_at_every_window_size(tmp_path, windows):
    labels, topk = alignment(tmp_path, aligned_cache_samples(), [[0, 1, 2], [3, 4, 5]])
    # 6 samples: t = 1..5 supervised (t = 0 of sample 5 has no previous token), 4 of them with a t-2.
    assert labels.passed and not labels.inconclusive
    assert labels.summary == ("argmax[t-2]==ids[t]: 0.000, argmax[t-1]==ids[t]: 1.000, argmax[t]==ids[t]: 0.000; "
                              "6 samples checked")
    assert labels.evidence == {"rates_by_shift": {"-1": 0.0, "0": 1.0, "1": 0.0}, "supervised_positions": 30,
                               "samples": 6, "offending_samples": 0, "first_offending": []}
    assert topk.passed and topk.summary == "36 tokens: argmax_not_top1 0, logits_not_sorted 0, logsumexp_below_max 0"


def test_position_0_has_no_label_at_any_shift(tmp_path):
    # Supervised from position 0, and the argmax at 0 is the token at 0 (a hit at shift +1 there):
    # nothing predicts position 0, so no shift counts it. By hand: shift 0 hits t = 2..5 of 1..5
    # (t = 1 reads argmax[0] = ids[0]), shifts -1 and +1 none.
    sample = labelled(distinct_ids(6, 0), [1] * 6, [0, 1, 1, 1, 1, 1])
    labels, _ = alignment(tmp_path, [sample], [[0]])
    assert labels.passed and labels.evidence["rates_by_shift"] == {"-1": 0.0, "0": 0.8, "1": 0.0}
    assert labels.evidence["supervised_positions"] == 5


def test_topk_faults_are_counted_and_their_samples_named(tmp_path, windows):
    samples = aligned_cache_samples()
    for i in (0, 1, 4):
        samples[i] = {k: v.copy() for k, v in samples[i].items()}
    samples[0]["target_logsumexp"][1] = 2.9995   # within the 1e-3 allowance of 3.0: not a fault
    samples[1]["target_topk_ids"][2, 0] += 5     # argmax is not the top-1
    samples[4]["target_topk_logits"][3] = [2.0, 2.5, 1.0]   # not descending
    samples[4]["target_logsumexp"][5] = 2.9      # below the top logit 3.0
    _, topk = alignment(tmp_path, samples, [[0, 1, 2], [3, 4, 5]])
    assert not topk.passed
    assert topk.summary == ("36 tokens: argmax_not_top1 1, logits_not_sorted 1, logsumexp_below_max 1; "
                            "2 samples, e.g. sample 1 (shard-00000)")
    assert topk.evidence["first_offending"] == ["sample 1 (shard-00000)", "sample 4 (shard-00001)"]
    assert (topk.evidence["argmax_not_top1"], topk.evidence["logits_not_sorted"],
            topk.evidence["logsumexp_below_max"]) == (1, 1, 1)


def test_samples_a_position_late_or_early_are_named_with_the_shift(tmp_path, windows):
    samples = [six(i, [1] * 6) for i in range(6)] + [six(6, [0] * 6), six(7, [2] * 6)]
    labels, _ = alignment(tmp_path, samples, [[0, 1, 2, 6], [3, 4, 5, 7]])
    # in place 30 of 40; at t-2: the early sample's 4 of 32; at t: the late sample's 5 of 40
    assert not labels.passed and not labels.inconclusive
    assert labels.summary == ("argmax[t-2]==ids[t]: 0.125, argmax[t-1]==ids[t]: 0.750, argmax[t]==ids[t]: 0.125; "
                              "8 samples checked; 2 samples, e.g. sample 6 (shard-00000): labels agree best at shift +1 "
                              "(5/5 vs 0/5 in place)")
    assert labels.evidence["first_offending"] == [
        "sample 6 (shard-00000): labels agree best at shift +1 (5/5 vs 0/5 in place)",
        "sample 7 (shard-00001): labels agree best at shift -1 (4/5 vs 0/5 in place)"]
    assert labels.evidence["supervised_positions"] == 40


@pytest.mark.parametrize("offset, shift, name, rates", [(0, "+1", "t", "0.000, argmax[t-1]==ids[t]: 0.000, argmax[t]==ids[t]: 1.000"),
                                                         (2, "-1", "t-2", "1.000, argmax[t-1]==ids[t]: 0.000, argmax[t]==ids[t]: 0.000")])
def test_a_cache_shifted_as_a_whole_is_named_with_its_shift(tmp_path, offset, shift, name, rates):
    labels, _ = alignment(tmp_path, [six(i, [offset] * 6) for i in range(4)], [[0, 1], [2, 3]])
    assert not labels.passed
    here = "4/5" if offset == 2 else "5/5"
    assert labels.summary == (f"argmax[t-2]==ids[t]: {rates} (best is argmax[{name}]: labels look shifted by {shift}); "
                              f"4 samples checked; 4 samples, e.g. sample 0 (shard-00000): labels agree best at shift "
                              f"{shift} ({here} vs 0/5 in place)")


def test_labels_that_agree_nowhere_are_inconclusive(tmp_path):
    long = [labelled(distinct_ids(20, 30 * i), [0] + [1] * 19, [None] * 20, seed=i) for i in range(3)]
    labels, _ = alignment(tmp_path, long, [[0, 1, 2]])
    assert labels.passed and labels.inconclusive and labels.line().status == "inconclusive"
    assert labels.summary == ("the target's argmax agrees with the data at no shift (argmax[t-2]==ids[t]: 0.000, "
                              "argmax[t-1]==ids[t]: 0.000, argmax[t]==ids[t]: 0.000; all under 0.02), so alignment "
                              "cannot be told (random weights, or the data was not written by this target); "
                              "3 samples checked")


def test_an_agreement_of_exactly_the_inconclusive_rate_is_not_inconclusive(tmp_path):
    # 10 samples x 5 supervised positions: one agreement in place is 1/50 = 0.02
    samples = [six(0, [1] + [None] * 5)] + [six(i, [None] * 6) for i in range(1, 10)]
    labels, _ = alignment(tmp_path, samples, [list(range(10))])
    assert not labels.passed and not labels.inconclusive
    assert labels.summary == ("argmax[t-2]==ids[t]: 0.000, argmax[t-1]==ids[t]: 0.020, argmax[t]==ids[t]: 0.000 "
                              "(no clear winner); 10 samples checked")


@pytest.mark.parametrize("late, rates", [
    # 11 of 20 in place, 10 of 20 one late: ahead by exactly 0.05, which is no clear win
    (True, "0.000, argmax[t-1]==ids[t]: 0.550, argmax[t]==ids[t]: 0.500"),
    # 11 of 20 in place, 8 of 16 one early
    (False, "0.500, argmax[t-1]==ids[t]: 0.550, argmax[t]==ids[t]: 0.000"),
])
def test_in_place_must_win_by_more_than_0_05(tmp_path, late, rates):
    if late:
        plans = [[1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, None], [1, 1, None, 0, 0, None]]
    else:
        plans = [[2, 2, 1, 1, 1, None]] * 3 + [[2, 2, 1, 1, None, None]]
    labels, _ = alignment(tmp_path, [six(i, plan) for i, plan in enumerate(plans)], [[0, 1, 2, 3]])
    assert not labels.passed and not labels.inconclusive
    assert labels.summary == f"argmax[t-2]==ids[t]: {rates} (no clear winner); 4 samples checked"


def test_without_a_position_two_back_the_rate_at_t_minus_2_is_absent(tmp_path):
    samples = [labelled(distinct_ids(2, 10 * i), [0, 1], [1, 1], seed=i) for i in range(6)]
    labels, _ = alignment(tmp_path, samples, [[0, 1, 2], [3, 4, 5]])
    assert labels.passed
    assert labels.summary == "argmax[t-1]==ids[t]: 1.000, argmax[t]==ids[t]: 0.000; 6 samples checked"
    assert labels.evidence["rates_by_shift"] == {"-1": None, "0": 1.0, "1": 0.0}


def test_no_supervised_position(tmp_path):
    labels, topk = alignment(tmp_path, [six(i, [1] * 6, mask=[0] * 6) for i in range(2)], [[0, 1]])
    assert not labels.passed and not labels.inconclusive
    assert labels.summary == "no supervised positions; 2 samples checked"
    assert topk.passed


def test_a_sample_far_below_the_caches_own_agreement_is_named(tmp_path):
    good = [labelled(distinct_ids(20, 30 * i), [0] + [1] * 19, [1] * 20, seed=i) for i in range(4)]
    poor = labelled(distinct_ids(20, 150), [0] + [1] * 19, [1] * 5 + [None] * 15, seed=4)
    labels, _ = alignment(tmp_path, [*good, poor], [[0, 1, 2, 3, 4]])
    # 81 of 95 in place (0.853): half of it is 0.426, and the poor sample agrees in 5 of 19 (0.263)
    assert not labels.passed
    assert labels.evidence["first_offending"] == [("sample 4 (shard-00000): label agreement 5/19, under half the "
                                                   "cache's 0.853")]


def test_an_unreadable_window_is_skipped_and_the_rest_checked(tmp_path, monkeypatch):
    monkeypatch.setattr(label_checks, "sample_windows", lambda offsets: bounded_reads.sample_windows(offsets, 8))
    cache = build(tmp_path, [six(i, [1] * 6) for i in range(6)], [[0, 1, 2], [3, 4, 5]])
    damage_byte(cache / "shard-00000" / "input_ids" / "c.0", 5)   # chunk 0: tokens 0..3, sample 0 only
    labels, topk = check_alignment(CacheReader(cache), ["shard-00000", "shard-00001"])
    assert labels.summary.endswith("; 5 samples checked") and topk.summary.startswith("30 tokens: ")


P = "s"  # the shard named in the per-sample tuples below


@pytest.mark.parametrize("n, before, here, after, cache_rate, named", [
    (10, 0, 0, 2, 0.9, "labels agree best at shift +1 (2/10 vs 0/10 in place)"),   # ahead by 2 = max(2, 1.0)
    (10, 2, 0, 0, 0.9, "labels agree best at shift -1 (2/10 vs 0/10 in place)"),
    (10, 3, 0, 2, 0.9, "labels agree best at shift -1 (3/10 vs 0/10 in place)"),
    (10, 2, 0, 3, 0.9, "labels agree best at shift +1 (3/10 vs 0/10 in place)"),
    (10, 0, 0, 1, 0.0, None),          # ahead by 1 only
    (30, 0, 0, 3, 0.0, "labels agree best at shift +1 (3/30 vs 0/30 in place)"),  # max(2, 3.0)
    (30, 0, 0, 2, 0.0, None),
    (30, 0, 10, 11, 0.5, None),        # ahead by 1 of 10 in place; 10/30 is over half of 0.5
    (30, 0, 10, 0, 0.0, None),
    (16, 0, 3, 0, 0.4, "label agreement 3/16, under half the cache's 0.400"),   # 0.1875 < 0.2
    (15, 0, 2, 0, 0.4, None),          # under 16 supervised positions: too few to tell
    (16, 0, 4, 0, 0.4, None),          # 0.25
    (20, 0, 4, 0, 0.4, None),          # exactly half
])
def test_misaligned_samples_by_hand(n, before, here, after, cache_rate, named):
    found = misaligned_samples([(P, 7, n, before, here, after)], cache_rate)
    assert found.first == ([] if named is None else [f"sample 7 ({P}): {named}"])


# ------------------------------------------------------------------------------------- chunks


def chunks(cache, rate=1.0, seed=0, shards=("shard-00000", "shard-00001")):
    return check_chunks(CacheReader(cache), list(shards), rate, seed)


def test_a_sound_cache_decodes_every_chunk(good):
    calls = []
    crc, finite, signature = check_chunks(CacheReader(good), ["shard-00000", "shard-00001"], 1.0, 0,
                                          lambda: calls.append(1))
    # a shard of 18 tokens: 6 small token arrays of 4-token chunks (5 each), hidden in 16-token chunks
    # (2), offsets and sample_id one chunk each: 34; two shards 68.
    assert crc.passed and crc.summary == "68 of 68 chunks decoded with CRC32C verified"
    assert (crc.evidence["decoded"], crc.evidence["total"]) == (68, 68)
    assert finite.passed and finite.summary == "NaN/Inf per tap: tap 1: 0/0, tap 2: 0/0, tap 3: 0/0"
    assert signature.skipped and signature.summary == "skipped: 6 samples, fewer than 20"
    assert calls == [1, 1]


def test_nan_and_inf_are_counted_per_tap_and_their_samples_named(tmp_path):
    samples = simple_samples(6)
    samples[1] = {**samples[1], "hidden": samples[1]["hidden"].copy()}
    samples[1]["hidden"][1, 2, 0] = np.inf     # token 7 of the shard, tap 3
    samples[3] = {**samples[3], "hidden": samples[3]["hidden"].copy()}
    samples[3]["hidden"][5, 1, 3] = np.nan     # token 23 (the second hidden chunk), tap 2
    cache = build(tmp_path, samples, [[0, 1, 2, 3, 4, 5]])
    crc, finite, _ = chunks(cache, shards=["shard-00000"])
    assert crc.passed and not finite.passed
    assert finite.summary == ("NaN/Inf per tap: tap 1: 0/0, tap 2: 1/0, tap 3: 0/1; 2 samples, e.g. sample 1 "
                              "(shard-00000)")
    assert finite.evidence == {"nan_per_tap": [0, 1, 0], "inf_per_tap": [0, 0, 1], "offending_samples": 2,
                               "first_offending": ["sample 1 (shard-00000)", "sample 3 (shard-00000)"]}


def test_a_damaged_chunk_is_named_by_array_and_chunk_and_the_rest_decoded(tmp_path):
    root = tmp_path / ("a-long-directory-name-so-that-the-reader-s-message-runs-past-two-hundred-characters-" * 2)
    cache = build(root, simple_samples(), [[0, 1, 2], [3, 4, 5]])
    damage_byte(cache / "shard-00000" / "input_ids" / "c.1", 5)   # the file of chunks 2 and 3 (tokens 8..15): in chunk 2
    reader = CacheReader(cache)
    with pytest.raises(Exception) as e:
        reader.shard(0).read_range("input_ids", 8, 12)
    assert len(str(e.value)) > 201
    crc, _, _ = check_chunks(reader, ["shard-00000", "shard-00001"], 1.0, 0)
    assert not crc.passed
    assert crc.summary == "67 of 68 chunks decoded with CRC32C verified; 1 failed"
    assert crc.evidence["failures"] == [f"shard-00000/input_ids chunk 2: {str(e.value)[:200]}"]


def test_checksum_evidence_keeps_the_first_50(tmp_path):
    one = Chunking(hidden_chunk_bytes=64, hidden_chunks_per_file=1, small_chunk_tokens=1, small_chunks_per_file=1)
    cache = build(tmp_path, simple_samples(3), [[0, 1, 2]], chunking=one)
    damaged = sorted(p for p in (cache / "shard-00000").glob("[it]*/c.*") if p.is_file())[:51]
    for path in damaged:
        damage_byte(path, 5)
    crc, _, _ = chunks(cache, shards=["shard-00000"])
    assert crc.summary.endswith("; 51 failed") and len(crc.evidence["failures"]) == 50


def test_a_sample_rate_decodes_the_chunks_whose_draw_is_below_it(good):
    import random

    seed = 7
    rate = random.Random(seed).random()   # the first chunk's draw equals the rate: it is not decoded
    rng = random.Random(seed)
    expected = sum(rng.random() < rate for _ in range(68))
    crc, _, signature = chunks(good, rate, seed)
    assert crc.summary == f"{expected} of 68 chunks decoded with CRC32C verified"
    assert crc.evidence["sample_rate"] == rate and 0 < expected < 68
    assert signature.skipped and signature.passed
    assert signature.summary == "skipped: --sample-rate < 1 decodes only part of each sample"


def test_a_projected_cache_counts_its_one_row(tmp_path):
    samples = projected_samples()
    samples[0]["hidden"][3, 0, 1] = np.nan
    cache = build(tmp_path, samples, [[0, 1, 2]], projected_rank=2)
    crc, finite, signature = chunks(cache, shards=["shard-00000"])
    assert crc.passed and not finite.passed
    assert finite.summary == "NaN/Inf in the projected row (2 components): 1/0; 1 samples, e.g. sample 0 (shard-00000)"
    assert finite.evidence == {"nan_projected": 1, "inf_projected": 0, "offending_samples": 1,
                               "first_offending": ["sample 0 (shard-00000)"]}
    assert signature.skipped and signature.passed
    assert signature.summary == ("skipped: projected cache: the taps are mixed into 2 components (no per-tap scale to "
                                 "step through)")


def test_an_fp8_cache_decodes_with_its_scales(tmp_path):
    samples = simple_samples(3)
    scales = np.full((6, 3), 1.0, np.float32)
    for tap, s in enumerate((1.0, 2.0, 4.0)):
        scales[:, tap] = s / 448.0
    scales[2, 0] = np.nan   # token 2, tap 1: its four values decode to NaN
    cache = build(tmp_path, samples, [[0, 1, 2]], fmt="fp8", scales={0: scales})
    crc, finite, _ = chunks(cache, shards=["shard-00000"])
    # 18 tokens: 7 small token arrays (hidden_scale is one) of 5 chunks, hidden (12 bytes a token: 16-token
    # chunks) 2, offsets and sample_id 1 each
    assert crc.passed and crc.summary == "39 of 39 chunks decoded with CRC32C verified"
    assert finite.evidence["nan_per_tap"] == [4, 0, 0] and finite.evidence["inf_per_tap"] == [0, 0, 0]
    assert finite.evidence["first_offending"] == ["sample 0 (shard-00000)"]


def fake_shard(lengths, ids=None):
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return SimpleNamespace(offsets=offsets, num_samples=len(lengths),
                           sample_ids=np.asarray(ids if ids is not None else range(len(lengths)), np.int64))


def test_a_single_tap_or_too_few_samples_are_not_judged():
    single = TapSignatures(1).check([5])
    assert single.passed and single.skipped and single.summary == "skipped: a single tap has no step to compare"
    empty = TapSignatures(3).check([1, 2, 3])
    assert empty.skipped and empty.passed and empty.summary == "skipped: 0 samples, fewer than 20"
    for count, runs in ((19, False), (20, True)):
        sig = TapSignatures(2)
        shard = fake_shard([1] * count)
        sig.add("s", shard, 0, np.stack([np.full((count, 4), 1.0), np.full((count, 4), 2.0)], axis=1))
        check = sig.check([1, 2])
        assert check.skipped != runs, count
        if not runs:
            assert check.summary == "skipped: 19 samples, fewer than 20"


def test_tap_signature_outliers_by_hand():
    """Steps of log RMS from tap 10 to tap 20: ten samples at 0.9, one at 1.0, ten at 1.1 (median
    1.0, median absolute deviation 0.1, so sigma = 1.4826 x 0.1 + 1e-6 = 0.148261), one at 8.5 sigma
    above (flagged) and one at 7.5 sigma below (inside the limit of 8)."""
    sigma = 1.4826 * 0.1 + 1e-6
    steps = [0.9] * 10 + [1.0] + [1.1] * 10 + [1 + 8.5 * sigma, 1 - 7.5 * sigma]
    n = len(steps)
    sig = TapSignatures(2)
    shard = fake_shard([2] * n, ids=range(100, 100 + n))
    # Each token's values at tap 20 are exp(step) times tap 10's: its log RMS is higher by the step.
    values = np.stack([np.full((2 * n, 4), 1.0), np.repeat(np.exp(steps), 2)[:, None] * np.ones((2 * n, 4))], axis=1)
    sig.add("s", shard, 0, values[:5])
    sig.add("s", shard, 5, values[5:])     # a chunk that starts inside a sample
    check = sig.check([20, 10][::-1])
    assert not check.passed
    np.testing.assert_allclose(check.evidence["median_step"], [1.0], atol=1e-12)
    np.testing.assert_allclose(check.evidence["robust_sd"], [sigma], rtol=1e-9)
    assert abs(check.evidence["max_abs_z"] - 8.5) < 1e-6
    assert check.evidence["first_offending"] == [
        (f"sample 121 (s): log-RMS step tap 10 -> 20 is +{1 + 8.5 * sigma:.3f}, cache median +1.000 (z +8.5): taps "
         "swapped or from the wrong layer")]
    assert check.summary.startswith("23 samples: per-tap scale steps tap 10 -> 20 +1.000 (sd 0.148); 1 samples, e.g. "
                                    "sample 121 (s)")


def test_tap_signature_names_the_taps_in_layer_order_and_each_step():
    # Three taps given out of order (layers 3, 1, 2); 20 samples whose steps 1 -> 2 and 2 -> 3 are 0.5
    # and 1.0, and a sample with its two deeper taps swapped.
    n = 21
    rms = {1: np.ones(n), 2: np.full(n, np.exp(0.5)), 3: np.full(n, np.exp(1.5))}
    rms[2][20], rms[3][20] = rms[3][20], rms[2][20]
    values = np.stack([rms[layer][:, None] * np.ones((n, 4)) for layer in (3, 1, 2)], axis=1)
    sig = TapSignatures(3)
    sig.add("s", fake_shard([1] * n), 0, values)
    check = sig.check([3, 1, 2])
    assert check.summary.startswith("21 samples: per-tap scale steps tap 1 -> 2 +0.500 (sd 0.000), tap 2 -> 3 +1.000 "
                                    "(sd 0.000); 1 samples, e.g. sample 20 (s): log-RMS step tap 2 -> 3 is -1.000, cache "
                                    "median +1.000 (z -2000000.0): taps swapped")
    np.testing.assert_allclose(check.evidence["median_step"], [0.5, 1.0], atol=1e-12)


def test_tap_signature_limit_is_strict_and_the_sign_of_z_is_kept():
    """With every other step equal (no spread), sigma is the 1e-6 floor: a step of 8e-6 is exactly z
    = 8 (not beyond the limit), 9e-6 and -16e-6 are beyond it, on either side."""
    n = 23
    sig = TapSignatures(2)
    sums = np.zeros((n, 2))
    sums[20, 1], sums[21, 1], sums[22, 1] = 8 * 1e-6, 9 * 1e-6, -16 * 1e-6
    sig.sums["s"] = sums
    sig.shards["s"] = fake_shard([1] * n)
    check = sig.check([1, 2])
    assert [line.split(":")[0] for line in check.evidence["first_offending"]] == ["sample 21 (s)", "sample 22 (s)"]
    assert "(z +9.0)" in check.evidence["first_offending"][0] and "(z -16.0)" in check.evidence["first_offending"][1]


# -------------------------------------------------------------------------- model checks' parts


def layered_states(layers: int = 5) -> torch.Tensor:
    """hidden_states[j][t] = [100 j + s_t, 50 j - s_t], s = (0, 3, 1, 2): layers far apart; s steps
    both up and down (so no position shift brings a wrong layer closer) and s_{t-1} != s_{t+1} (so
    a shift by +1 and by -1 are told apart)."""
    s = torch.tensor([0.0, 3.0, 1.0, 2.0])
    return torch.stack([torch.stack([100 * j + s, 50 * j - s], dim=-1) for j in range(layers)])


def test_shifted_error_by_hand():
    from pipeline.verify.tap_alignment import shifted_error

    stored, ref = torch.tensor([[1.0], [2.0], [3.0], [4.0]]), torch.tensor([[1.0], [2.0], [4.0], [8.0]])
    assert shifted_error(stored, ref, 0) == 4.0   # |4 - 8|
    assert shifted_error(stored, ref, 1) == 1.0   # stored[t] against ref[t-1]: |2-1|, |3-2|, |4-4|
    assert shifted_error(stored, ref, -1) == 5.0  # stored[t] against ref[t+1]: |1-2|, |2-4|, |3-8|
    one = torch.tensor([[1.0]])
    assert shifted_error(one, one * 2, 0) == 1.0
    assert shifted_error(one, one * 2, 1) == shifted_error(one, one * 2, -1) == float("inf")


def test_tap_alignment_by_hand():
    from pipeline.verify.tap_alignment import TapAlignment

    states = layered_states()
    fresh = TapAlignment([1, 2])
    assert (fresh.max_abs, fresh.max_rel) == (0.0, 0.0)
    aligned = TapAlignment([1, 2])
    aligned.add(states, torch.stack([states[2], states[3]], dim=1))
    aligned.add(states, torch.stack([states[2], states[3]], dim=1))
    ok, summary, evidence = aligned.verdict(2)
    assert ok and summary == "2 samples: every tap best matches hidden_states[tap+1]"
    assert evidence == {"best_hidden_state_index": {"1": {"2": 2}, "2": {"3": 2}}, "best_position_shift": {"0": 4}}
    assert (aligned.max_abs, aligned.max_rel) == (0.0, 0.0)

    early = TapAlignment([1, 2])
    early.add(states, torch.stack([states[1], states[3]], dim=1))   # tap 1 taken from hidden_states[1]
    ok, summary, evidence = early.verdict(1)
    assert not ok and summary == "taps match the wrong layers: tap 1 -> hidden_states[1]"
    assert evidence["best_position_shift"] == {"0": 2}
    # |hidden_states[1] - hidden_states[2]| is 100 at most, against hidden_states[2]'s largest 203
    assert early.max_abs == 100.0 and early.max_rel == pytest.approx(100 / 203)

    for d, matches in ((1, "t-1"), (-1, "t+1")):
        shifted = TapAlignment([1, 2])
        late = torch.stack([torch.roll(states[2], d, 0), torch.roll(states[3], d, 0)], dim=1)
        shifted.add(states, late)
        ok, summary, _ = shifted.verdict(1)
        assert not ok and summary == f"hidden states shifted by {d:+d} position (stored[t] matches hidden_states[{matches}])"


def test_relative_error_against_an_all_zero_tap_uses_the_floor():
    from pipeline.verify.tap_alignment import TapAlignment

    states = torch.zeros(3, 2, 2)
    check = TapAlignment([0])
    check.add(states, torch.full((2, 1, 2), 0.5))
    assert check.max_abs == 0.5 and check.max_rel == pytest.approx(0.5 / 1e-6)


def first_coordinates_basis(n_taps: int, width: int):
    """A basis whose component i is coordinate 0 of tap i (orthonormal rows, unit scales)."""
    from pipeline.projection.basis import TapBasis

    components = torch.zeros(n_taps, n_taps * width)
    for i in range(n_taps):
        components[i, i * width] = 1.0
    return TapBasis(components=components, scales=torch.ones(n_taps), energy=1.0, pilot_tokens=1)


def test_projected_alignment_by_hand():
    """Each component is coordinate 0 of one tap (unit scales), so a row's rounding-scaled error is
    (z - ref) / |x| coordinate by coordinate, and every hypothesis can be worked out by hand."""
    from pipeline.verify.tap_alignment import ProjectedAlignment

    states, basis = layered_states(), first_coordinates_basis(2, 2)
    s = [0.0, 3.0, 1.0, 2.0]

    def stored(index=(2, 3), shift=0):
        # z_t = (hidden_states[index[k]][t][0] for each tap k), as [T, 1, R]
        z = torch.stack([states[j][:, 0] for j in index], dim=-1)
        return torch.roll(z, shift, 0)[:, None]

    good = ProjectedAlignment(basis, [1, 2])
    good.add(states, stored())
    good.add(states, stored())
    ok, summary, evidence = good.verdict(2)
    assert ok and summary == (f"2 samples: every projected row best matches the projection (basis "
                              f"{basis.digest()[:12]}) of hidden_states[tap+1] in place (each tap at its layer -1/+1 "
                              "and at every other tap's layer, and position shifts -1/+1, tried)")
    assert evidence["best_hidden_state_index"] == {"1": {"2": 2}, "2": {"3": 2}}
    assert evidence["best_position_shift"] == {"0": 2}
    assert (good.max_abs, good.noise, good.max_rel) == (0.0, 0.0, 0.0)

    early = ProjectedAlignment(basis, [1, 2])
    early.add(states, stored(index=(1, 2)))
    ok, summary, evidence = early.verdict(1)
    assert not ok and summary == ("projected rows match other layers than the taps': tap 1 -> hidden_states[1] "
                                  "(tap+1-1) in 1 of 1, tap 2 -> hidden_states[2] (tap+1-1, tap 1's) in 1 of 1")
    assert evidence["best_position_shift"] == {"0": 1}
    # in place: z - ref = -100 in both coordinates, over |x| = 200 + s and 300 + s
    by_hand = (sum((100 / (200 + v)) ** 2 + (100 / (300 + v)) ** 2 for v in s) / 8) ** 0.5
    assert early.max_abs == 100.0 and early.noise == pytest.approx(by_hand)

    one = ProjectedAlignment(basis, [1, 2])
    one.add(states, stored(index=(2, 4)))   # tap 2 from hidden_states[4]: one tap a layer late
    ok, summary, _ = one.verdict(1)
    assert not ok and summary == "projected rows match other layers than the taps': tap 2 -> hidden_states[4] (tap+1+1) in 1 of 1"

    swapped = ProjectedAlignment(basis, [1, 2])
    swapped.add(states, stored(index=(3, 2)))
    ok, summary, _ = swapped.verdict(1)
    assert not ok and summary == ("projected rows match other layers than the taps': tap 1 -> hidden_states[3] "
                                  "(tap+1+1, tap 2's) in 1 of 1, tap 2 -> hidden_states[2] (tap+1-1, tap 1's) in 1 of 1")

    for d, matches in ((1, "t-1"), (-1, "t+1")):
        late = ProjectedAlignment(basis, [1, 2])
        late.add(states, stored(shift=d))
        ok, summary, evidence = late.verdict(1)
        assert not ok and summary == (f"projected rows shifted by {d:+d} position (stored[t] matches the projection of "
                                      f"the taps at {matches}) in 1 of 1 samples")
        assert evidence["best_position_shift"] == {str(d): 1}


def test_projected_candidates_stop_at_the_models_layers():
    from pipeline.verify.tap_alignment import ProjectedAlignment

    states, basis = layered_states(layers=5), first_coordinates_basis(2, 2)
    check = ProjectedAlignment(basis, [0, 3])
    assert check.candidates(0, 5) == [1, 0, 2, 4]   # its own, one either side, tap 3's
    assert check.candidates(1, 5) == [4, 3, 1]      # hidden_states[5] is past the last
    z = torch.stack([states[0][:, 0], states[3][:, 0]], dim=-1)[:, None]
    check.add(states, z)
    assert check.verdict(1)[2]["best_hidden_state_index"] == {"0": {"0": 1}, "3": {"3": 1}}
    zero = ProjectedAlignment(first_coordinates_basis(1, 2), [0])
    zero.add(torch.zeros(3, 2, 2), torch.full((2, 1, 1), 0.5))   # taps of zeros: 0.5 is as wrong as can be
    assert zero.noise == pytest.approx(0.5 / 1e-30)


def test_the_tail_check_needs_a_stored_tap():
    from pipeline.verify.model_checks import tail_unavailable

    assert tail_unavailable(SimpleNamespace(projection=None, projected_rank=None)) is None
    assert tail_unavailable(SimpleNamespace(projection=object(), projected_rank=7)) == (
        "projected cache: the deepest tap is not stored (the taps are mixed into 7 components); --recompute N checks "
        "the projected rows and the predictions against a fresh forward instead")


def picks_of(lengths: dict[str, list[int]], n: int, max_length: int, seed: int = 0):
    from pipeline.verify.model_checks import stratified_picks

    reader = SimpleNamespace(manifest=SimpleNamespace(identity=SimpleNamespace(capture=SimpleNamespace(
        max_length=max_length))), shard=lambda name: fake_shard(lengths[name]))
    return stratified_picks(reader, list(lengths), n, seed)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stratified_picks_cover_every_shard_the_longest_and_the_truncated(seed):
    lengths = {"a": [3, 9, 5, 4], "b": [4] * 10 + [9, 2] + [4] * 8}   # max_length 9: a row 1, b row 10 truncated
    for n, want in ((0, 3), (4, 4), (7, 7), (100, 24)):
        picks = picks_of(lengths, n, 9, seed)
        assert len(picks) == want and len(set(picks)) == want, (n, picks)
        assert [p[0] for p in picks[:2]] == ["a", "b"]                  # one of every shard first
        assert all(row < len(lengths[name]) for name, row in picks)
        assert ("a", 1) in picks                                        # the longest
        if n >= 4:
            assert ("b", 10) in picks                                   # the truncated ones
    assert sorted(picks_of({"a": [2, 3]}, 0, 9, seed)) == [("a", 0), ("a", 1)]   # budget 2 for one shard
    # the longest and the truncated in one shard: every shard is still picked first, in order
    assert [p[0] for p in picks_of({"a": [3, 9, 4, 4], "b": [2, 2, 2], "c": [2] * 30}, 8, 9, seed)[:3]] == ["a", "b", "c"]


def test_stratified_picks_are_reproduced_by_their_seed():
    # verify-cache's report names its picks and its seed: the same seed picks them again, another
    # seed picks others
    lengths = {"a": [3, 9, 4, 4], "b": [2, 2, 2], "c": [2] * 30}
    assert picks_of(lengths, 8, 9, 0) == picks_of(lengths, 8, 9, 0) != picks_of(lengths, 8, 9, 1)
    # A change detector, not an oracle: the values this version draws, so that a report written by
    # an earlier release names the picks a rerun with its seed checks (a change here breaks that)
    assert picks_of(lengths, 8, 9, 0) == [("a", 3), ("b", 1), ("c", 1), ("a", 1), ("c", 9), ("c", 25), ("c", 24),
                                          ("c", 18)]
    assert picks_of(lengths, 8, 9, 1) == [("a", 1), ("b", 2), ("c", 27), ("b", 0), ("c", 9), ("c", 0), ("c", 24),
                                          ("c", 21)]


# ------------------------------------------------------------------- model checks with the target
#
# A cache written from the embedded target's own forward (taps 1, 3, 5 of its 8 layers: hidden_states
# [2], [4], [6]; top-3 logits): what extract stores, computed here directly. The tail recompute runs
# layers 6 and 7 from the stored tap of layer 5.

MODEL_TAPS = [1, 3, 5]


@pytest.fixture(scope="module")
def forward_samples(target, tokenizer, train_rows):
    from pipeline.data.conversations import parse_row
    from pipeline.data.loss_mask import ConversationMasker
    from pipeline.data.samples import row_tokens

    masker = ConversationMasker(tokenizer, "<|im_end|>", None, "keep")
    out = []
    for i, row in enumerate(train_rows[:4]):
        ids, mask, _ = row_tokens(parse_row(i, f"row {i}", row), masker)
        ids = ids[:40]
        with torch.no_grad():
            res = target(input_ids=torch.tensor([ids]), output_hidden_states=True)
        logits = res.logits[0].float()
        top = torch.topk(logits, TOP_K)
        out.append({"input_ids": np.asarray(ids, np.int32), "loss_mask": np.asarray(mask[:40], np.uint8),
                    "target_argmax": logits.argmax(-1).numpy().astype(np.int32),
                    "target_topk_ids": top.indices.numpy().astype(np.int32),
                    "target_topk_logits": top.values.numpy().astype(np.float32),
                    "target_logsumexp": torch.logsumexp(logits, -1).numpy().astype(np.float32),
                    "states": torch.stack(res.hidden_states)[:, 0]})          # [L+1, T, H], float32
    return out


def passes_at_and_fails_under(monkeypatch, key: str, value: float, run) -> None:
    """`run()`'s check passes with the bf16 tolerance `key` exactly at `value` (the bands are
    inclusive) and fails with it at the float just under."""
    from pipeline.verify import model_checks

    for tolerance, passed in ((value, True), (float(np.nextafter(value, 0)), False)):
        monkeypatch.setitem(model_checks.TAIL_TOLERANCE, "bf16", {**model_checks.TAIL_TOLERANCE["bf16"], key: tolerance})
        assert run().passed is passed


def model_cache(root: Path, samples: list[dict], *, layer_of=lambda i, tap: tap + 1) -> Path:
    """Taps stored from hidden_states[layer_of(sample, tap)] (tap + 1: the convention)."""
    written = []
    for i, s in enumerate(samples):
        taps = torch.stack([s["states"][layer_of(i, tap)] for tap in MODEL_TAPS], dim=1)   # [T, 3, H]
        written.append({**{k: v for k, v in s.items() if k != "states"}, "hidden": taps.numpy()})
    return build(root, written, [[0, 1], [2, 3]], chunking=CONVERSATION, taps=MODEL_TAPS, hidden=128, layers=8)


def test_the_tail_recompute_reproduces_a_sound_cache_and_names_a_sample_from_the_layer_before(
        tmp_path, target, forward_samples):
    from pipeline.verify.model_checks import check_tail

    good = model_cache(tmp_path / "good", forward_samples)
    tokens = sum(len(s["input_ids"]) for s in forward_samples)
    started = __import__("time").perf_counter()
    check = check_tail(CacheReader(good), ["shard-00000", "shard-00001"], target, 1.0, 0, batch_tokens=64)
    wall = __import__("time").perf_counter() - started
    assert check.passed, check.summary
    # DESIGN 10 / BENCHMARKS.md: bf16 tolerances 0.1 / 0.25 / 0.15, 4x with bf16 compute
    assert check.evidence["tolerance"] == {"argmax": 0.1, "topk": 0.25, "logsumexp": 0.15}
    assert (check.evidence["samples"], check.evidence["tokens"]) == (4, tokens)
    assert (check.evidence["layers_run"], check.evidence["num_hidden_layers"], check.evidence["layer_fraction"]) == (2, 8, 0.25)
    assert 0 <= check.evidence["seconds"] <= wall
    assert all(0 <= v < 0.05 for v in check.evidence["worst"].values()), check.evidence["worst"]
    # the stored tap is rounded to bf16: the recompute's logits differ a little, and the worst says so
    assert check.evidence["worst"]["topk"] > 0 and check.evidence["worst"]["logsumexp"] > 0
    assert check.summary.startswith(f"4 samples, {tokens} tokens: layers 6..7 + norm + lm_head from the stored tap 5 "
                                    "(2 of 8 layers) reproduce the stored predictions; worst argmax shortfall ")
    assert "(tolerance 0.1/0.25/0.15)" in check.summary
    wide = check_tail(CacheReader(good), ["shard-00000"], target, 1.0, 0, compute_dtype="bfloat16")
    assert wide.evidence["tolerance"] == {"argmax": 0.4, "topk": 1.0, "logsumexp": 0.6}

    early = model_cache(tmp_path / "early", forward_samples, layer_of=lambda i, tap: tap if i == 2 else tap + 1)
    # batch_tokens 16: every sample is longer than a batch may hold, so each is a batch of its own
    for batch_tokens in (64, 16):
        check = check_tail(CacheReader(early), ["shard-00000", "shard-00001"], target, 1.0, 0,
                           batch_tokens=batch_tokens)
        assert not check.passed
        assert check.evidence["offending_samples"] == 1 and check.evidence["samples"] == 4
        named = check.evidence["first_offending"][0]
        assert named.startswith("sample 2 (shard-00001): ")
        assert check.summary.startswith("4 samples: 1 samples, e.g. sample 2 (shard-00001): ")
        # the worst figures are the offending sample's: above the smallest tolerance
        assert max(check.evidence["worst"].values()) > 0.1, check.evidence["worst"]
        for position in re.findall(r"at position (-?\d+)", named):
            assert 0 <= int(position) < len(forward_samples[2]["input_ids"])


def test_tail_errors_keep_each_kinds_worst_position_across_logit_chunks(target, forward_samples):
    """Planted errors in the stored predictions of one sample: the worst of each kind is found
    wherever it is, in whichever 16-row logit chunk."""
    from pipeline.verify.model_checks import tail_errors

    s = forward_samples[0]
    sample = {k: v.copy() for k, v in s.items() if k != "states"}
    sample["tap"] = s["states"][6]                      # the deepest tap (layer 5) as stored, unrounded
    sample["target_logsumexp"][2] += 0.25                # chunk 0
    sample["target_logsumexp"][33] -= 0.5                # chunk 2: the worst
    sample["target_topk_logits"][20, 1] += 0.75          # chunk 1
    (worst,) = tail_errors(target, target.lm_head, 5, [sample], logits_chunk=16)
    assert worst["logsumexp"][1] == 33 and worst["logsumexp"][0] == pytest.approx(0.5, abs=1e-3)
    assert worst["topk"][1] == 20 and worst["topk"][0] == pytest.approx(0.75, abs=1e-3)
    assert worst["argmax"] == (0.0, -1)         # no argmax error anywhere: no position named


def test_the_tail_rate_checks_the_samples_whose_draw_is_below_it(tmp_path, target, forward_samples):
    import random

    from pipeline.verify.model_checks import check_tail

    good = model_cache(tmp_path, forward_samples)
    # Seed 4 draws 0.236, 0.103, 0.396, 0.155: at the first draw's rate, the first sample (a draw equal
    # to the rate) and the third are not checked, the second and fourth are.
    rate = random.Random(4).random()
    rng = random.Random(4)
    assert [rng.random() < rate for _ in range(4)] == [False, True, False, True]
    check = check_tail(CacheReader(good), ["shard-00000", "shard-00001"], target, rate, 4)
    assert check.evidence["samples"] == 2 and check.evidence["rate"] == rate
    none = check_tail(CacheReader(good), ["shard-00000", "shard-00001"], target, 0.0, 4)
    # nothing checked: every worst figure is still the 0 it starts from
    assert none.evidence["samples"] == 0 and none.evidence["worst"] == {"argmax": 0.0, "topk": 0.0, "logsumexp": 0.0}


def test_the_tail_tolerances_are_inclusive(tmp_path, target, forward_samples, monkeypatch):
    from pipeline.verify.model_checks import check_tail

    reader = CacheReader(model_cache(tmp_path, forward_samples))
    shards = ["shard-00000", "shard-00001"]
    worst = check_tail(reader, shards, target, 1.0, 0).evidence["worst"]["logsumexp"]
    assert worst > 0
    # the worst logsumexp error exactly at its tolerance passes; the tolerance just under it fails
    passes_at_and_fails_under(monkeypatch, "logsumexp", worst, lambda: check_tail(reader, shards, target, 1.0, 0))


def test_the_tail_recompute_checks_what_it_read_before_an_undecodable_chunk(tmp_path, target, forward_samples,
                                                                          monkeypatch):
    from pipeline.verify import model_checks
    from pipeline.verify.model_checks import check_tail

    # shard-00001: two 40-token samples (tokens 0..39, 40..79); its taps are stored 64 tokens a
    # file: c.1.0.0 holds tokens 64..79, the second sample's only
    cache = model_cache(tmp_path, forward_samples)
    assert CacheReader(cache).shard(1).offsets.tolist() == [0, 40, 80]
    damage_byte(cache / "shard-00001" / "hidden" / "c.1.0.0", 5)
    # one sample a read window: shard-00001's first sample is read before its second fails to
    # decode (the checksum check names the chunk); both of shard-00000's and that one are checked
    real = model_checks.shard_tokens
    monkeypatch.setattr(model_checks, "shard_tokens", lambda *a, **k: real(*a, **{**k, "max_tokens": 1}))
    check = check_tail(CacheReader(cache), ["shard-00000", "shard-00001"], target, 1.0, 0)
    assert check.passed and check.evidence["samples"] == 3


def test_the_fp8_tail_tolerances_are_the_measured_ones(tmp_path, target, forward_samples):
    from pipeline.verify.model_checks import check_tail

    reader = CacheReader(model_cache(tmp_path, forward_samples[:1] * 4))
    reader.hidden_format = "fp8"   # the tolerance band is chosen by the cache's format
    assert check_tail(reader, [], target, 1.0, 0).evidence["tolerance"] == {"argmax": 0.5, "topk": 1.5,
                                                                             "logsumexp": 0.6}


def test_the_full_recompute_of_a_projected_cache_without_its_basis_is_skipped_saying_why(tmp_path):
    from pipeline.verify.model_checks import check_recompute

    cache, _ = projected_cache(tmp_path, stored=False)
    # the basis is looked for before anything is run: no model needed to say why nothing can be
    check = check_recompute(CacheReader(cache), [("shard-00000", 0)], None, 0.02)
    assert check.passed and check.skipped
    assert check.summary.startswith(f"skipped: {cache / 'basis.safetensors'}: missing")


def test_the_full_recompute_counts_agreement_over_every_position(tmp_path, target, forward_samples, monkeypatch):
    from pipeline.verify.model_checks import check_recompute

    planted = {k: v.copy() if k != "states" else v for k, v in forward_samples[0].items()}
    # position 7: the stored argmax and top-k taken from the second-best logit; by hand: 39 of 40 agree
    planted["target_argmax"][7] = planted["target_topk_ids"][7, 1]
    planted["target_topk_ids"][7] = planted["target_topk_ids"][7, [1, 0, 2]]
    cache = model_cache(tmp_path, [planted, *forward_samples[1:]])
    assert len(planted["input_ids"]) == 40
    check = check_recompute(CacheReader(cache), [("shard-00000", 0)], target, 0.02)
    assert check.evidence["argmax_agreement"] == 39 / 40 and check.evidence["topk_agreement"] == 39 / 40
    assert "argmax agree 0.9750, top-k agree 0.9750; " in check.summary
    assert not check.passed and check.evidence["argmax_shortfall"] > 0
    # a shortfall exactly at the argmax tolerance passes (the band is inclusive), just above it fails
    passes_at_and_fails_under(monkeypatch, "argmax", check.evidence["argmax_shortfall"],
                              lambda: check_recompute(CacheReader(cache), [("shard-00000", 0)], target, 0.02))


def test_the_full_recompute_in_bf16_widens_the_argmax_tolerance_4x(tmp_path, target, forward_samples):
    import copy

    from pipeline.verify.model_checks import check_recompute

    cache = model_cache(tmp_path, forward_samples)
    bf16 = copy.deepcopy(target).to(torch.bfloat16)
    check = check_recompute(CacheReader(cache), [("shard-00000", 0)], bf16, 0.08)
    assert check.evidence["argmax_shortfall_tolerance"] == 0.4      # bf16's 0.1, 4x


def test_the_tail_recompute_of_a_projected_cache_is_skipped_saying_why(tmp_path):
    from pipeline.verify.model_checks import check_tail

    cache, _ = projected_cache(tmp_path)
    check = check_tail(CacheReader(cache), ["shard-00000"], None, 1.0, 0)   # said before any model is needed
    assert check.passed and check.skipped and check.summary.startswith("skipped: projected cache: the deepest tap")


def test_the_full_recompute_of_a_one_token_sample(tmp_path, target, forward_samples):
    from pipeline.verify.model_checks import check_recompute

    one = {k: (v[:, :1] if k == "states" else v[:1]) for k, v in forward_samples[0].items()}
    cache = model_cache(tmp_path, [one, *forward_samples[1:]])
    check = check_recompute(CacheReader(cache), [("shard-00000", 0)], target, 0.02)
    assert "argmax agree 1.0000, top-k agree 1.0000; " in check.summary
    assert check.evidence["argmax_agreement"] == 1.0 and check.evidence["topk_agreement"] == 1.0
    assert check.passed


def test_the_full_recompute_passes_a_sound_cache_and_names_a_layer_before(tmp_path, target, forward_samples):
    from pipeline.verify.model_checks import check_recompute

    good = model_cache(tmp_path / "good", forward_samples)
    picks = [("shard-00000", 0), ("shard-00001", 1)]
    check = check_recompute(CacheReader(good), picks, target, 0.02)
    assert check.passed, check.summary
    assert check.summary.startswith("2 samples: every tap best matches hidden_states[tap+1]; max abs err ")
    assert "argmax agree 1.0000, top-k agree 1.0000; kernels now " in check.summary
    assert check.evidence["argmax_agreement"] == 1.0 and check.evidence["topk_agreement"] == 1.0
    assert check.evidence["argmax_shortfall"] == 0.0 and check.evidence["argmax_shortfall_tolerance"] == 0.1
    assert check.evidence["picked"] == ["shard-00000 row 0", "shard-00001 row 1"]
    assert check.evidence["samples"] == 2 and 0 < check.evidence["max_rel"] < 0.02
    assert check.evidence["best_hidden_state_index"] == {"1": {"2": 2}, "3": {"4": 2}, "5": {"6": 2}}

    assert "drift between kernel paths" not in check.summary        # recorded with the path it runs now
    # the tolerances are inclusive: an error exactly at either passes
    exact = check_recompute(CacheReader(good), picks, target, check.evidence["max_rel"])
    assert exact.passed and exact.evidence["max_rel"] == check.evidence["max_rel"]

    early = model_cache(tmp_path / "early", forward_samples, layer_of=lambda i, tap: tap)
    check = check_recompute(CacheReader(early), picks, target, 0.02)
    assert not check.passed
    assert check.summary.startswith("taps match the wrong layers: tap 1 -> hidden_states[1], tap 3 -> hidden_states[3], "
                                    "tap 5 -> hidden_states[5]")
    # wrong layers fail whatever the tolerance allows
    assert not check_recompute(CacheReader(early), picks, target, 1e9).passed
