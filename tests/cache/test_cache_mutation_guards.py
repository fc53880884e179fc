"""Guards that kill the mutants the rest of tests/cache let live (issue 81, benchmarks/mutation):
the schema's formulae, the writer and the reader, each against an oracle of its own: sizes and
counts worked by hand from the layout rule (DESIGN 5, pipeline/cache/schema.py's docstring), a
shard written by ShardWriter read back with Zarr itself and hashed from the bytes on disk, bf16
values chosen to be exact. No target model: a synthetic cache of two shards is written in well
under a second."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from harness.caches import damage_byte
from pipeline.cache import schema
from pipeline.cache.address import open_location
from pipeline.cache.identity import parse_identity
from pipeline.cache.location import LocalLocation
from pipeline.cache.manifest import SourcesRecord, new_manifest, parse_manifest
from pipeline.cache.reader import CacheReader, ShardReader, expected_files, open_cache
from pipeline.cache.schema import Chunking
from pipeline.cache.writer import AlreadyCommitted, BackgroundWriter, ShardWriter
from pipeline.errors import PipelineError
from pipeline.files import write_json_atomic

# The arrays by name, spelled here on purpose (DESIGN 5), with stored dtype, inner dims and per.
SHARED = {
    "input_ids": ("int32", (), "token"),
    "loss_mask": ("uint8", (), "token"),
    "target_argmax": ("int32", (), "token"),
    "target_topk_ids": ("int32", ("top_k",), "token"),
    "target_topk_logits": ("float32", ("top_k",), "token"),
    "target_logsumexp": ("float32", (), "token"),
    "offsets": ("int64", (), "sample"),
    "sample_id": ("int64", (), "sample"),
}
TOKEN_ARRAYS = [n for n, (_, _, per) in SHARED.items() if per == "token"]

# The flagship's taps (DESIGN 7: 5 taps x 5120, bf16): 51,200 bytes a token.
FLAGSHIP = {"n_taps": 5, "hidden_size": 5120, "top_k": 8}


# --------------------------------------------------------------------------------------- schema


def test_shard_names_are_five_digits_and_nothing_else_is_one():
    assert schema.shard_name(7) == "shard-00007"
    assert schema.shard_lock_name(3) == ".shard-00003.lock"
    assert schema.shard_index("shard-00007") == 7
    assert schema.shard_index("shard-99999") == 99999
    for bad in ("shard-7", "shard-000070", "../shard-00000", "shard-00000/x", "xshard-00001", ""):
        with pytest.raises(ValueError, match="not a shard name"):
            schema.shard_index(bad)


def test_the_array_table_is_the_design_one():
    for fmt, hidden in (("bf16", {"hidden": ("uint16", ("tap_rows", "tap_width"), "token")}),
                        ("fp8", {"hidden": ("uint8", ("tap_rows", "tap_width"), "token"),
                                 "hidden_scale": ("float32", ("tap_rows",), "token")})):
        specs = schema.array_specs(fmt)
        assert [s.name for s in specs] == [*SHARED, *hidden]
        assert {s.name: (s.dtype, s.inner, s.per) for s in specs} == {**SHARED, **hidden}
        assert [s.name for s in schema.token_specs(fmt)] == [*TOKEN_ARRAYS, *hidden]
        # Only offsets has one entry more than there are samples (a start and an end).
        assert [s.name for s in specs if s.fencepost] == ["offsets"]
        assert [s.name for s in specs if s.full_width] == ["hidden"]
    with pytest.raises(ValueError, match="hidden_format"):
        schema.array_specs("fp16")
    assert schema.role_names(schema.SAMPLE_TOKENS) == ("input_ids", "loss_mask")
    assert schema.role_names(schema.HARD_LABEL, schema.SOFT_LABEL) == (
        "target_argmax", "target_topk_ids", "target_topk_logits", "target_logsumexp")
    with pytest.raises(ValueError, match="hidden format"):
        schema.role_names(schema.SAMPLE_TOKENS, schema.HIDDEN_STATE)


def test_shapes_by_hand():
    dims = {"n_taps": 2, "hidden_size": 4, "top_k": 3}
    want = {"input_ids": (10,), "loss_mask": (10,), "target_argmax": (10,), "target_topk_ids": (10, 3),
            "target_topk_logits": (10, 3), "target_logsumexp": (10,), "offsets": (4,), "sample_id": (3,),
            "hidden": (10, 2, 4), "hidden_scale": (10, 2)}
    got = {s.name: s.shape(dims, samples=3, tokens=10) for s in schema.array_specs("fp8")}
    assert got == want
    # A projected cache stores one row of R values a token (and one fp8 scale for it).
    projected = {**dims, "projected_rank": 5}
    got = {s.name: s.shape(projected, samples=3, tokens=10) for s in schema.array_specs("fp8")}
    assert got == {**want, "hidden": (10, 1, 5), "hidden_scale": (10, 1)}
    assert schema.tap_rows(dims) == (2, 4) and schema.tap_rows(projected) == (1, 5)


def test_the_records_are_frozen_and_keyword_only():
    spec = schema.array_specs("bf16")[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.dtype = "int64"
    with pytest.raises(dataclasses.FrozenInstanceError):
        Chunking().small_chunks_per_file = 2
    with pytest.raises(TypeError):
        schema.ArraySpec("x", "int32", (), "token", "l", "r")
    with pytest.raises(TypeError):
        Chunking(4096, 4, 64, 3)
    # samples and tokens cannot be swapped by position
    with pytest.raises(TypeError):
        spec.length(3, 10)
    with pytest.raises(TypeError):
        spec.shape({}, 3, 10)
    with pytest.raises(TypeError):
        schema.raw_shard_bytes("bf16", {}, 3, 10)


def test_the_default_chunking_is_the_documented_one():
    # Chunking's docstring: 4 MiB hidden chunks, 256 a file; 65,536-token small chunks, 16 a file.
    assert dataclasses.asdict(Chunking()) == {"hidden_chunk_bytes": 4_194_304, "hidden_chunks_per_file": 256,
                                              "small_chunk_tokens": 65_536, "small_chunks_per_file": 16}
    assert Chunking.from_options(None) == Chunking() == Chunking.from_options({})
    assert Chunking.from_options({"small_chunks_per_file": 2}).small_chunks_per_file == 2
    with pytest.raises(ValueError, match=r"unknown chunking option\(s\) \['bogus'\]"):
        Chunking.from_options({"bogus": 1, "small_chunks_per_file": 2})
    assert Chunking(small_chunks_per_file=3).record() == {
        "format": "zarr v3 sharding_indexed (inner: bytes, zstd, crc32c; index: crc32c, at the end)",
        "chunk_key": "default, separator '.'",
        "options": {"hidden_chunk_bytes": 4_194_304, "hidden_chunks_per_file": 256, "small_chunk_tokens": 65_536,
                    "small_chunks_per_file": 3}}


@pytest.mark.parametrize("field", ["hidden_chunk_bytes", "hidden_chunks_per_file", "small_chunk_tokens",
                                   "small_chunks_per_file"])
def test_chunking_options_are_integers_in_1_to_2_to_the_32(field):
    for good in (1, 2, 4_294_967_296):
        assert getattr(Chunking(**{field: good}), field) == good
    for bad in (0, -1, 4_294_967_297, 2.0, "4", None):
        with pytest.raises(ValueError, match=field):
            Chunking(**{field: bad})


def test_flagship_geometry_by_hand():
    c, bf16 = Chunking(), "bf16"
    hidden, ids = (next(s for s in schema.array_specs(bf16) if s.name == n) for n in ("hidden", "input_ids"))
    # 4 MiB / 51,200 bytes = 81.9 tokens -> the power of two below: 64; 256 chunks a file.
    assert schema.token_bytes(hidden, FLAGSHIP) == 51_200
    assert c.chunk_tokens(hidden, FLAGSHIP) == 64 and c.file_tokens(hidden, FLAGSHIP) == 16_384
    assert c.chunk_tokens(ids, FLAGSHIP) == 65_536 and c.file_tokens(ids, FLAGSHIP) == 1_048_576
    geometry = c.geometry(bf16, FLAGSHIP)
    assert geometry["arrays"]["hidden"] == {"chunk_tokens": 64, "file_tokens": 16_384}
    assert geometry["arrays"]["target_topk_ids"] == {"chunk_tokens": 65_536, "file_tokens": 1_048_576}
    assert set(geometry["arrays"]) == {*TOKEN_ARRAYS, "hidden"}
    # One file of every token array: hidden 16,384 x 51,200; ids, argmax, logsumexp 2^20 x 4; mask 2^20 x 1;
    # top-k ids and logits 2^20 x 8 x 4.
    buffer = 16_384 * 51_200 + 3 * 1_048_576 * 4 + 1_048_576 + 2 * 1_048_576 * 32
    assert geometry["writer_buffer_bytes"] == c.writer_buffer_bytes(bf16, FLAGSHIP) == buffer == 919_601_152
    # 1e9 tokens: ceil(1e9 / 16,384) = 61,036 hidden files, ceil(1e9 / 2^20) = 954 of each of the 6
    # small token arrays, and one file each for offsets and sample_id.
    assert c.files(bf16, FLAGSHIP, 10**9) == 61_036 + 6 * 954 + 2
    # Exactly one file, one token over it.
    assert c.files(bf16, FLAGSHIP, 16_384) == 1 + 6 + 2
    assert c.files(bf16, FLAGSHIP, 16_385) == 2 + 6 + 2
    # fp8: 25,600 bytes a token -> 163.8 -> 128-token chunks, 32,768-token files; hidden_scale is small.
    assert c.files("fp8", FLAGSHIP, 32_769) == 2 + 6 + 1 + 2


def test_chunk_tokens_is_the_largest_power_of_two_within_the_chunk_bytes_and_at_least_16():
    c = Chunking()
    cases = [  # (format, n_taps, hidden_size, expected chunk tokens), by hand
        ("fp8", 1, 1, 4_194_304),      # 1 byte a token: 2^22 tokens
        ("bf16", 1, 40_000, 32),       # 80,000 bytes: 52.4 tokens -> 32
        ("bf16", 1, 32_768, 64),       # 65,536 bytes: exactly 64
        ("bf16", 64, 65_536, 16),      # 8 MiB a token: under one token, so the floor of 16
        ("bf16", 3, 21_846, 16),       # 131,076 bytes: 31.99 -> 16
    ]
    for fmt, taps, width, want in cases:
        dims = {"n_taps": taps, "hidden_size": width, "top_k": 1}
        hidden = next(s for s in schema.array_specs(fmt) if s.full_width)
        assert c.chunk_tokens(hidden, dims) == want, (fmt, taps, width)
    assert Chunking(hidden_chunk_bytes=4096).chunk_tokens(
        next(s for s in schema.array_specs("fp8") if s.full_width), {"n_taps": 1, "hidden_size": 3, "top_k": 1}) == 1024


def test_raw_bytes_and_metadata_files_by_hand():
    dims = {"n_taps": 2, "hidden_size": 4, "top_k": 3}
    # 10 tokens, 3 samples: ids 40 + mask 10 + argmax 40 + top-k ids 120 + logits 120 + lse 40
    # + offsets 4 x 8 + sample ids 3 x 8, + hidden 10 x 2 x 4 x 2 (bf16) or x 1 + scales 10 x 2 x 4 (fp8)
    shared = 40 + 10 + 40 + 120 + 120 + 40 + 32 + 24
    assert schema.raw_shard_bytes("bf16", dims, samples=3, tokens=10) == shared + 160
    assert schema.raw_shard_bytes("fp8", {**dims, "hidden_size": 5}, samples=3, tokens=10) == shared + 100 + 80
    # The group's zarr.json, one per array, digests.json
    assert schema.per_shard_files("bf16") == 1 + 9 + 1
    assert schema.per_shard_files("fp8") == 1 + 10 + 1
    assert schema.file_key("hidden", 3, 3) == "hidden/c.3.0.0"
    assert schema.file_key("offsets", 0, 1) == "offsets/c.0"


LIMITS = {"n_taps": 64, "hidden_size": 65_536, "top_k": 1_024, "vocab_size": 16_777_216}


@pytest.mark.parametrize("key", sorted(LIMITS))
def test_declared_sizes_are_bounded(key):
    ok = {"n_taps": 3, "hidden_size": 8, "top_k": 2, "vocab_size": 100}
    schema.check_dims({**ok, key: 1})
    schema.check_dims({**ok, key: LIMITS[key]})
    for bad in (0, -1, LIMITS[key] + 1, 2.0, "3", None):
        with pytest.raises(ValueError, match=key):
            schema.check_dims({**ok, key: bad})


def test_a_projected_rank_is_under_the_full_width():
    ok = {"n_taps": 3, "hidden_size": 8, "top_k": 2, "vocab_size": 100}
    for projected_rank in (None, 1, 23):
        schema.check_dims({**ok, "projected_rank": projected_rank})
    for projected_rank in (0, -1, 24, 25, 2.0, "2"):
        with pytest.raises(ValueError, match="projected_rank"):
            schema.check_dims({**ok, "projected_rank": projected_rank})


def test_fp8_max_is_the_largest_finite_e4m3fn():
    assert schema.FP8_MAX == float(torch.finfo(torch.float8_e4m3fn).max) == 448.0


def _raw_manifest(version, shards):
    return {"format": schema.FORMAT_NAME, "schema_version": version, "shards": shards}


def test_the_schema_version_read_and_written_is_2():
    # "Schema 2 (this one)": a manifest of schema 2 gets past the version check, 3 does not.
    with pytest.raises(PipelineError, match="invalid shard name"):
        parse_manifest(_raw_manifest(2, {"x": {}}), "m")
    with pytest.raises(PipelineError, match="schema_version 3 is not supported"):
        parse_manifest(_raw_manifest(3, {}), "m")


def test_at_most_as_many_shards_as_there_are_five_digit_names():
    # shard-00000 .. shard-99999: 100,000 names. A mapping of more is refused for its size, one of
    # 100,000 gets to the names.
    with pytest.raises(PipelineError, match="at most 100000 entries"):
        parse_manifest(_raw_manifest(2, {f"x{i}": {} for i in range(100_001)}), "m")
    with pytest.raises(PipelineError, match="invalid shard name 'x0'"):
        parse_manifest(_raw_manifest(2, {f"x{i}": {} for i in range(100_000)}), "m")


# --------------------------------------------------------------------------- a synthetic cache

DIMS = {"n_taps": 2, "hidden_size": 4, "top_k": 3}
# hidden: 16 bytes a token, so 16-token chunks (the floor), one chunk a file; small arrays: 2-token
# chunks, 2 a file (4 tokens).
SMALL = Chunking(hidden_chunk_bytes=64, hidden_chunks_per_file=1, small_chunk_tokens=2, small_chunks_per_file=2)
SHARD0 = [(7, 5), (3, 1), (12, 7), (20, 20), (9, 7)]  # (sample id, tokens): 40 tokens
SHARD1 = [(30, 3), (31, 2)]


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """The bfloat16 bit pattern of float32 values that bfloat16 holds exactly."""
    bits = np.asarray(values, np.float32).view(np.uint32)
    assert not (bits & 0xFFFF).any(), "not exact in bfloat16"
    return (bits >> 16).astype(np.uint16)


def sample_rows(sid: int, n: int, first: int) -> dict[str, np.ndarray]:
    """Distinct values everywhere: token t of the shard (global position first + i) is recognisable."""
    pos = np.arange(first, first + n)
    ids = (1000 * sid + np.arange(n)).astype(np.int32)
    taps = np.stack([(pos[:, None] + 0.25 * np.arange(4)) * sign for sign in (1, -1)], axis=1)  # [n, 2, 4]
    return {"input_ids": ids, "loss_mask": (pos % 2).astype(np.uint8), "target_argmax": ids + 1,
            "target_topk_ids": ids[:, None] + np.arange(3, dtype=np.int32),
            "target_topk_logits": (-pos[:, None] - np.arange(3)).astype(np.float32),
            "target_logsumexp": (pos + 0.5).astype(np.float32), "hidden": bf16_bits(taps)}


def expected_arrays(samples) -> dict[str, np.ndarray]:
    rows, first = [], 0
    for sid, n in samples:
        rows.append(sample_rows(sid, n, first))
        first += n
    return {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}


def write_shard(location, index, samples, *, chunking=SMALL, attrs=None, **kwargs):
    writer = ShardWriter(location, index, dims=DIMS, hidden_format="bf16", num_tokens=sum(n for _, n in samples),
                         chunking=chunking, attrs=attrs, **kwargs)
    first = 0
    for sid, n in samples:
        writer.append(sid, sample_rows(sid, n, first))
        first += n
    return writer, writer.commit()


def write_manifest(cache: Path, *, num_shards: int = 2, chunking: Chunking = SMALL) -> None:
    made_up = "synthetic (tests/cache/test_cache_mutation_guards.py)"
    identity = parse_identity({
        "num_shards": num_shards,
        "target": {"model_type": made_up, "config_sha256": made_up, "num_hidden_layers": 4, "weights": {}},
        "tokenizer": {"files_sha256": made_up, "chat_template_sha256": made_up, "chat_template_kwargs": None,
                      "thinking": "on", "generation_prompt": "", "reasoning": "keep", "boundary_tokens": made_up,
                      "end_of_turn": "<|im_end|>"},
        "data": {"num_rows": 0, "files": [], "generated_by": made_up},
        "capture": {"target_layer_ids": [1, 2], "tap_convention": made_up, "num_hidden_layers": 4,
                    "hidden_size": DIMS["hidden_size"], "vocab_size": 100_000, "top_k": DIMS["top_k"],
                    "hidden_format": "bf16", "stored_dtype": made_up, "compute_dtype": "float32", "max_length": 64,
                    "overlong": "error", "on_error": "fail", "zstd_level": 3, "checksum": made_up,
                    "storage": chunking.record()}})
    plan = {"assignment": made_up, "num_rows": 0, "num_shards": num_shards, "storage": {}}
    manifest = new_manifest(identity=identity, provenance={}, plan=plan, sources=SourcesRecord())
    write_json_atomic(cache / "manifest.json", manifest.to_json())


def make_cache(root: Path) -> Path:
    cache = root / "cache"
    cache.mkdir(parents=True)
    write_manifest(cache)
    location = open_location(cache)
    write_shard(location, 0, SHARD0, attrs={"note": "zero"})
    write_shard(location, 1, SHARD1)
    return cache


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return make_cache(tmp_path_factory.mktemp("guards"))


@pytest.fixture
def copy(cache, tmp_path) -> Path:
    shutil.copytree(cache, tmp_path / "cache")
    return tmp_path / "cache"


# ----------------------------------------------------------------------------------- the writer


def test_what_the_writer_wrote_reads_back_through_zarr(cache):
    want = expected_arrays(SHARD0)
    group = zarr.open_group(str(cache / "shard-00000"), mode="r")
    for name, values in want.items():
        np.testing.assert_array_equal(group[name][:], values, err_msg=name)
    np.testing.assert_array_equal(group["offsets"][:], [0, 5, 6, 13, 33, 40])
    np.testing.assert_array_equal(group["sample_id"][:], [7, 3, 12, 20, 9])
    assert group["offsets"].dtype == np.int64 and group["sample_id"].dtype == np.int64
    # The chunking given, not the default: 16-token hidden chunks one a file, 2-token small chunks two a file.
    assert (group["hidden"].chunks, group["hidden"].shards) == ((16, 2, 4), (16, 2, 4))
    assert (group["input_ids"].chunks, group["input_ids"].shards) == ((2,), (4,))
    assert group["target_topk_ids"].shards == (4, 3)
    # Per-sample arrays are one plain chunk each.
    assert group["offsets"].chunks == (6,) and group["offsets"].shards is None
    assert group["sample_id"].chunks == (5,)


def test_files_on_disk_are_what_the_layout_says(cache):
    shard = cache / "shard-00000"
    files = sorted(p.relative_to(shard).as_posix() for p in shard.rglob("*") if p.is_file())
    data = [f for f in files if not f.endswith("zarr.json") and f != "digests.json"]
    # 40 tokens: hidden in 16-token files -> 3; every small token array in 4-token files -> 10 each.
    want = [f"hidden/c.{i}.0.0" for i in range(3)] + ["offsets/c.0", "sample_id/c.0"]
    want += [f"{name}/c.{i}" + (".0" if name.startswith("target_topk") else "") for name in TOKEN_ARRAYS
             for i in range(10)]
    assert sorted(data) == sorted(want)
    metadata = [f for f in files if f not in data]
    assert len(metadata) == schema.per_shard_files("bf16")
    assert SMALL.files("bf16", DIMS, 40) == len(data)


def test_the_commit_record_lists_every_file_with_its_size_and_sha256(cache):
    shard = cache / "shard-00000"
    record = json.loads((shard / "digests.json").read_text())
    on_disk = {p.relative_to(shard).as_posix(): p for p in shard.rglob("*") if p.is_file() and p.name != "digests.json"}
    assert set(record["files"]) == set(on_disk)
    for rel, entry in record["files"].items():
        data = on_disk[rel].read_bytes()
        assert entry["bytes"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest(), rel
    info = record["shard"]
    assert info["samples"] == 5 and info["tokens"] == 40
    assert (info["sample_id_min"], info["sample_id_max"]) == (3, 20)
    assert info["note"] == "zero"  # the writer's attrs
    assert info["bytes"] == sum(p.stat().st_size for p in on_disk.values())
    assert info["files"] == len(on_disk) + 1  # and digests.json itself
    attrs = json.loads((shard / "zarr.json").read_text())["attributes"]
    assert attrs["shard"] == "shard-00000" and attrs["note"] == "zero" and attrs["tokens"] == 40


def test_the_default_writer_compresses_at_extracts_default_level(tmp_path):
    from pipeline.config import ExtractConfig

    location = open_location(tmp_path)
    writer = ShardWriter(location, 0, dims=DIMS, hidden_format="bf16", num_tokens=5)
    writer.append(7, sample_rows(7, 5, 0))
    writer.commit()
    meta = json.loads((tmp_path / "shard-00000" / "input_ids" / "zarr.json").read_text())
    inner = meta["codecs"][0]["configuration"]["codecs"]
    assert [c["name"] for c in inner] == ["bytes", "zstd", "crc32c"]
    assert inner[1]["configuration"]["level"] == ExtractConfig.__dataclass_fields__["zstd_level"].default == 3
    # A missing chunk reads as zeros: the fill value is 0 (the reader's missing-file check relies on it).
    assert meta["fill_value"] == 0
    assert 0 <= writer.fsync_seconds < 60


def test_an_all_zero_file_is_still_written(tmp_path):
    """Every inner chunk is stored, even an all-zero one: otherwise a file of zeros would be
    absent, and the reader refuses a shard with a missing file."""
    location = open_location(tmp_path)
    write_manifest(tmp_path, num_shards=1)
    writer = ShardWriter(location, 0, dims=DIMS, hidden_format="bf16", num_tokens=8, chunking=SMALL)
    rows = sample_rows(4, 8, 0)
    rows["loss_mask"][:] = 0
    writer.append(4, rows)
    writer.commit()
    assert sorted(p.name for p in (tmp_path / "shard-00000" / "loss_mask").glob("c.*")) == ["c.0", "c.1"]
    np.testing.assert_array_equal(CacheReader(tmp_path).shard(0).read("loss_mask", 4), np.zeros(8))


def test_sample_lengths_are_checked(tmp_path):
    location = open_location(tmp_path)
    writer = ShardWriter(location, 0, dims=DIMS, hidden_format="bf16", num_tokens=10, chunking=SMALL)
    with pytest.raises(ValueError, match="disagree in length or are empty"):
        writer.append(1, {**sample_rows(1, 3, 0), "loss_mask": np.ones(2, np.uint8)})
    with pytest.raises(ValueError, match="disagree in length or are empty"):
        writer.append(1, sample_rows(1, 0, 0))
    writer.append(1, sample_rows(1, 1, 0))   # one token is a sample
    writer.append(2, sample_rows(2, 6, 1))
    with pytest.raises(ValueError, match="more tokens than the 10 announced"):
        writer.append(3, sample_rows(3, 4, 7))  # 1 + 6 + 4 = 11
    writer.append(3, sample_rows(3, 2, 7))
    with pytest.raises(ValueError, match="9 tokens written, 10 announced"):
        writer.commit()
    writer.append(4, sample_rows(4, 1, 9))
    assert writer.commit()["tokens"] == 10


def test_an_empty_shard_is_not_committed(tmp_path):
    writer = ShardWriter(open_location(tmp_path), 0, dims=DIMS, hidden_format="bf16", num_tokens=3)
    with pytest.raises(ValueError, match="refusing to commit an empty shard"):
        writer.commit()


def test_the_writer_takes_keywords(tmp_path):
    with pytest.raises(TypeError):
        ShardWriter(open_location(tmp_path), 0, DIMS, "bf16", 3)


class RacedLocation(LocalLocation):
    """A directory where another writer's commit record lands just before this one's."""

    def put_if_absent(self, key, data):
        if key.endswith("digests.json"):
            super().put_if_absent(key, b'{"theirs": true}')
        return super().put_if_absent(key, data)


def test_a_shard_committed_meanwhile_by_another_writer_is_left_to_it(tmp_path):
    writer = ShardWriter(RacedLocation(tmp_path), 0, dims=DIMS, hidden_format="bf16", num_tokens=5, chunking=SMALL)
    writer.append(7, sample_rows(7, 5, 0))
    with pytest.raises(AlreadyCommitted, match="shard-00000: committed by another writer meanwhile"):
        writer.commit()
    # Their record stands, and nothing of the shard was removed.
    assert json.loads((tmp_path / "shard-00000" / "digests.json").read_text()) == {"theirs": True}
    assert (tmp_path / "shard-00000" / "input_ids" / "c.0").is_file()


class FailingLocation(LocalLocation):
    """A directory whose make_durable fails with `error`; delete_prefix fails too once armed."""

    def __init__(self, root, error, *, delete_fails=False):
        super().__init__(root)
        self.error, self.delete_fails, self.armed = error, delete_fails, False

    def make_durable(self, keys):
        self.armed = True
        raise self.error

    def delete_prefix(self, prefix):
        if self.armed and self.delete_fails:
            raise OSError(errno.EIO, "the store is gone")
        super().delete_prefix(prefix)


@pytest.mark.parametrize("error, delete_fails", [
    (OSError(errno.ENOSPC, "No space left on device"), False),
    (OSError(errno.ENOSPC, "No space left on device"), True),
    (PipelineError("the bucket refused the write"), False),
])
def test_a_failed_write_is_one_line_and_the_partial_shard_is_removed(tmp_path, error, delete_fails):
    location = FailingLocation(tmp_path, error, delete_fails=delete_fails)
    writer = ShardWriter(location, 0, dims=DIMS, hidden_format="bf16", num_tokens=5, chunking=SMALL)
    writer.append(7, sample_rows(7, 5, 0))
    with pytest.raises(PipelineError, match="shard-00000: write failed .* the shard is not committed") as e:
        writer.commit()
    assert ("(no space left on the device)" in str(e.value)) or ("(the bucket refused the write)" in str(e.value))
    if not delete_fails:
        assert not (tmp_path / "shard-00000").exists()


def test_a_write_failing_in_append_or_at_creation_is_one_line_too(tmp_path, monkeypatch):
    from pipeline.cache import writer as writer_module

    def disk_full(name):
        if name == "writer.chunk":   # just after a file of a token array was written
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_module, "failpoint", disk_full)
    writer = ShardWriter(open_location(tmp_path), 0, dims=DIMS, hidden_format="bf16", num_tokens=40, chunking=SMALL)
    with pytest.raises(PipelineError, match=r"shard-00000: write failed \(no space left on the device\)"):
        writer.append(7, sample_rows(7, 8, 0))   # two files of the small arrays fill up

    class FullAtCreation(LocalLocation):
        def delete_prefix(self, prefix):
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(PipelineError, match=r"shard-00000: write failed \(no space left on the device\)"):
        ShardWriter(FullAtCreation(tmp_path / "other"), 0, dims=DIMS, hidden_format="bf16", num_tokens=4)


def test_an_unknown_error_is_not_disguised(tmp_path):
    location = FailingLocation(tmp_path, RuntimeError("a bug"))
    writer = ShardWriter(location, 0, dims=DIMS, hidden_format="bf16", num_tokens=5, chunking=SMALL)
    writer.append(7, sample_rows(7, 5, 0))
    with pytest.raises(RuntimeError, match="^a bug$"):
        writer.commit()


# --------------------------------------------------------------------------- the background writer


def accepted_while_busy(writer: BackgroundWriter, expected: int) -> int:
    """How many callables `writer` takes (submit returns) while its thread is busy with one."""
    busy, release, count = threading.Event(), threading.Event(), [0]
    writer.submit(lambda: (busy.set(), release.wait(30)))
    assert busy.wait(30)

    def fill():
        for _ in range(expected + 2):
            writer.submit(lambda: None)
            count[0] += 1

    filler = threading.Thread(target=fill, daemon=True)
    filler.start()
    deadline = time.monotonic() + 10
    while count[0] < expected and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    taken = count[0]
    release.set()
    filler.join(30)
    writer.close()
    return taken


@pytest.mark.parametrize("depth, expected", [(1, 1), (2, 2), (None, 4)])
def test_the_queue_holds_depth_pending_callables(depth, expected):
    writer = BackgroundWriter() if depth is None else BackgroundWriter(depth)
    assert accepted_while_busy(writer, expected) == expected


def test_depth_0_runs_inline_and_others_on_the_thread():
    where = []
    inline = BackgroundWriter(0)
    inline.submit(lambda: where.append(threading.get_ident()))
    assert where == [threading.get_ident()]
    inline.close()
    for depth in (1, 2):
        threaded, ran = BackgroundWriter(depth), []
        threaded.submit(lambda ran=ran: ran.append(threading.get_ident()))
        threaded.submit(lambda ran=ran: ran.append(threading.get_ident()))
        threaded.close()
        assert len(ran) == 2 and threading.get_ident() not in ran


def test_an_error_on_the_thread_is_raised_on_the_caller_and_nothing_runs_after_it():
    writer, ran = BackgroundWriter(2), []

    def fail():
        raise KeyError("disk")

    writer.submit(fail)
    writer.submit(lambda: ran.append(1))
    with pytest.raises(KeyError, match="disk"):
        writer.close()
    assert ran == []
    with pytest.raises(KeyError):
        writer.submit(lambda: None)


def test_a_process_that_never_closes_its_writer_still_exits():
    code = "from pipeline.cache.writer import BackgroundWriter\nw = BackgroundWriter(2)\nw.submit(lambda: None)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr


# ----------------------------------------------------------------------------------- the reader


def test_every_sample_reads_back_whole_and_by_range(cache):
    reader = CacheReader(cache)
    assert reader.shards == ["shard-00000", "shard-00001"]
    assert reader.sample_ids() == [3, 7, 9, 12, 20, 30, 31]
    shard = reader.shard(0)
    assert (shard.num_samples, shard.num_tokens) == (5, 40)
    want, first = expected_arrays(SHARD0), 0
    for sid, n in SHARD0:
        assert shard.span(sid) == (first, first + n)
        for name in TOKEN_ARRAYS:
            np.testing.assert_array_equal(shard.read(name, sid), want[name][first:first + n], err_msg=(name, sid))
            np.testing.assert_array_equal(shard.read(name, sid, 1, 3), want[name][first + 1:first + min(3, n)])
            np.testing.assert_array_equal(shard.read(name, sid, 0, 1000), want[name][first:first + n])
        taps = np.stack([(np.arange(first, first + n)[:, None] + 0.25 * np.arange(4)) * s for s in (1, -1)], 1)
        hidden = shard.hidden(sid)
        assert hidden.dtype == torch.bfloat16
        np.testing.assert_array_equal(hidden.float().numpy(), taps)
        np.testing.assert_array_equal(shard.hidden(sid, 1).float().numpy(), taps[1:])
        sample = shard.sample(sid)
        assert set(sample) == {*TOKEN_ARRAYS, "hidden"}
        first += n
    np.testing.assert_array_equal(shard.hidden_range(16, 33, 1).numpy(), -(np.arange(16, 33)[:, None] + 0.25 * np.arange(4)))
    np.testing.assert_array_equal(shard.read_range("offsets", 1, 3), [5, 6])
    np.testing.assert_array_equal(shard.read_range("input_ids", 4, 7), want["input_ids"][4:7])
    with pytest.raises(PipelineError, match="no sample 99"):
        shard.span(99)


def test_find_takes_a_sample_to_its_shard(cache):
    reader = CacheReader(cache)
    for sid, shard in ((3, "shard-00000"), (20, "shard-00000"), (12, "shard-00000"), (30, "shard-00001"),
                       (31, "shard-00001")):
        assert reader.find(sid).name == shard
    for sid in (2, 4, 21, 32):
        with pytest.raises(PipelineError, match=f"sample {sid} is in no committed shard"):
            reader.find(sid)


def test_the_expected_files_follow_the_arrays_file_length(cache):
    group = zarr.open_group(str(cache / "shard-00000"), mode="r")
    assert expected_files(group["hidden"], "hidden") == ["hidden/c.0.0.0", "hidden/c.1.0.0", "hidden/c.2.0.0"]
    assert expected_files(group["target_topk_ids"], "t") == [f"t/c.{i}.0" for i in range(10)]
    assert expected_files(group["offsets"], "offsets") == ["offsets/c.0"]


def test_readers_take_keywords(cache):
    location = open_location(cache)
    with pytest.raises(TypeError):
        ShardReader(location, "shard-00000", "bf16", {})
    with pytest.raises(TypeError):
        CacheReader(cache, "report")
    with pytest.raises(TypeError):
        CacheReader(cache).shard(0, 1024)
    with pytest.raises(TypeError):
        open_cache(cache, None, None, "report")


def test_a_shard_is_checked_against_the_manifests_counts(cache):
    location = open_location(cache)
    files = CacheReader(cache).files("shard-00000")
    ShardReader(location, "shard-00000", "bf16", files=files, expected=(5, 40))
    ShardReader(location, "shard-00000", "bf16", files=files)
    for expected, message in (((5, 41), (r"input_ids: declares shape \(40,\), but the manifest says 5 samples "
                                         "and 41 tokens")),
                              ((4, 40), r"offsets: declares shape \(6,\), but the manifest says 4 samples"),
                              ((5, None), "no sample/token counts"), (("5", 40), "no sample/token counts")):
        with pytest.raises(PipelineError, match=message) as e:
            ShardReader(location, "shard-00000", "bf16", files=files, expected=expected)
        assert "cannot open shard" not in str(e.value)


def test_a_missing_array_is_named(copy):
    shutil.rmtree(copy / "shard-00000" / "target_logsumexp")
    files = CacheReader(copy, foreign="report").files("shard-00000")
    with pytest.raises(PipelineError, match="shard-00000/target_logsumexp: array missing"):
        ShardReader(open_location(copy), "shard-00000", "bf16", files=files)


def test_a_missing_file_is_named(cache):
    files = CacheReader(cache).files("shard-00000")
    location = open_location(cache)
    present = {k: v for k, v in files.items() if not k.startswith("input_ids/c.") and k != "hidden/c.1.0.0"}
    with pytest.raises(PipelineError, match=r"input_ids: chunk file\(s\) \[0, 1, 2, 3, 4\] missing of 10"):
        ShardReader(location, "shard-00000", "bf16", files=present)
    with pytest.raises(PipelineError, match=r"hidden: chunk file\(s\) \[1\] missing of 3"):
        ShardReader(location, "shard-00000", "bf16", files={k: v for k, v in files.items() if k != "hidden/c.1.0.0"})


def test_a_directory_that_is_no_shard_cannot_be_opened(tmp_path):
    (tmp_path / "shard-00000").mkdir()
    with pytest.raises(PipelineError, match="shard-00000: cannot open shard"):
        ShardReader(open_location(tmp_path), "shard-00000", "bf16", files={})


def test_damage_is_named_by_sample_file_and_chunk(copy):
    damage_byte(copy / "shard-00000" / "input_ids" / "c.1", 5)  # the file's first inner chunk (chunk 2: tokens 4, 5)
    shard = CacheReader(copy).shard(0)
    with pytest.raises(PipelineError) as e:
        shard.read("input_ids", 7)  # tokens 0..4: chunks 0, 1 and 2
    message = str(e.value)
    assert "read of sample 7 failed" in message and "input_ids/c.1" in message and "inner chunk 2" in message
    assert message.count("read failed") == 0
    with pytest.raises(PipelineError, match=r"no_such_array\[0:2\]: read failed \(KeyError"):
        shard.read_range("no_such_array", 0, 2)


def test_a_chunk_budget_decodes_a_shared_chunk_once(cache, monkeypatch):
    from pipeline.cache import sharded

    decoded = []
    original = sharded.ShardedArray._decode
    monkeypatch.setattr(sharded.ShardedArray, "_decode",
                        lambda self, path, c, *a: (decoded.append((self.name, c)), original(self, path, c, *a)))
    reader = CacheReader(cache)
    direct = {"files": reader.files("shard-00000"), "expected": (5, 40)}
    # Samples 7 (tokens 0..5) and 3 (token 5) share input_ids' chunk 2 (tokens 4..6). No budget (the
    # default, of the cache's reader and of a shard's): each read decodes what it covers.
    for make, decodes in ((lambda: reader.shard(0), 2), (lambda: reader.shard(0, chunk_cache_bytes=1 << 20), 1),
                          (lambda: ShardReader(open_location(cache), "shard-00000", "bf16", **direct), 2),
                          (lambda: ShardReader(open_location(cache), "shard-00000", "bf16", chunk_cache_bytes=1 << 20,
                                               **direct), 1)):
        decoded.clear()
        shard = make()
        shard.read("input_ids", 7)
        shard.read("input_ids", 3)
        assert decoded.count(("input_ids", 2)) == decodes


def test_only_committed_shards_are_read(copy):
    reader = CacheReader(copy)
    with pytest.raises(PipelineError, match="shard-00002 is not a committed shard"):
        reader.shard(2)
    with open(copy / "shard-00001" / "input_ids" / "c.0", "ab") as f:
        f.write(b"x")  # its size no longer the one its record lists
    reader = CacheReader(copy)
    assert reader.shards == ["shard-00000"]
    with pytest.raises(PipelineError, match="shard-00001 is not committed: "):
        reader.shard("shard-00001")
    with pytest.raises(PipelineError, match="no manifest.json"):
        CacheReader(copy / "shard-00000")


def test_a_shard_of_another_identity_is_refused_for_reading(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    write_manifest(cache, num_shards=2)
    location = open_location(cache)
    write_shard(location, 0, SHARD0)
    assert CacheReader(cache).foreign == {}
    write_shard(location, 1, SHARD1, attrs={"schema_version": 3})
    with pytest.raises(PipelineError, match="shard-00001 was extracted with another identity"):
        CacheReader(cache)
    assert list(CacheReader(cache, foreign="report").foreign) == ["shard-00001"]


def test_open_cache_refuses_a_local_copy_of_a_local_cache(cache, tmp_path):
    assert open_cache(cache).shards == ["shard-00000", "shard-00001"]
    assert open_cache(str(cache), foreign="report").shards == ["shard-00000", "shard-00001"]
    with pytest.raises(PipelineError, match="already on this machine's filesystem"):
        open_cache(cache, local=tmp_path / "copies", local_size="1M")
