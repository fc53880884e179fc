"""Schema 2's file layout (issue 15): Zarr v3 sharding with flat keys, digests hashed while
writing, and the direct reader, each checked against an independent reference: Zarr's own
reader, sha256 of the bytes on disk, the zstd frame format, the schema's file-count formula."""

import json
import os
import random
import shutil

import numpy as np
import pytest
import zarr
from numcodecs import Zstd

from harness.caches import damage_byte, hash_files_on_disk, manifest_json, shard_digest
from harness.runs import cli, cli_here, write_rows
from pipeline.cache.commit import hash_shard, read_digests
from pipeline.cache.address import open_location
from pipeline.cache.reader import CacheReader, ShardReader
from pipeline.cache.schema import Chunking, array_specs, per_shard_files
from pipeline.cache.sharded import frame_content_size
from pipeline.config import ExtractConfig
from pipeline.errors import PipelineError
from stages.extract.run import run_extract

# Tiny chunks so that the embedded rows span many inner chunks and many files per array.
SMALL = {"hidden_chunk_bytes": 4096, "hidden_chunks_per_file": 4, "small_chunk_tokens": 64, "small_chunks_per_file": 3}


def extracted(root, rows, hidden_format):
    data = write_rows(root / "rows.jsonl", rows)
    run_extract(ExtractConfig(cache=str(root / "cache"), data=[str(data)], num_shards=2,
                              hidden_format=hidden_format, chunking=SMALL), None, progress=False)
    return root / "cache"


@pytest.fixture(scope="module")
def cache(tmp_path_factory, train_rows):
    return extracted(tmp_path_factory.mktemp("layout"), train_rows[:60], "bf16")


@pytest.fixture(scope="module")
def fp8_cache(tmp_path_factory, train_rows):
    return extracted(tmp_path_factory.mktemp("layout-fp8"), train_rows[:30], "fp8")


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_direct_reader_equals_zarrs_reader(request, fmt):
    cache = request.getfixturevalue("cache" if fmt == "bf16" else "fp8_cache")
    """Every token array, whole and in random ranges (inner-chunk and file boundaries included),
    with and without the chunk cache, decodes to exactly what Zarr itself reads."""
    reader = CacheReader(cache)
    rng = random.Random(0)
    for name in reader.shards:
        for cached in (0, 1 << 20):
            shard = reader.shard(name, chunk_cache_bytes=cached)
            for spec in array_specs(reader.hidden_format):
                if spec.per != "token":
                    continue
                reference = zarr.open_array(str(cache / name / spec.name), mode="r")[:]
                assert np.array_equal(shard.read_range(spec.name, 0, shard.num_tokens), reference), spec.name
                for _ in range(40):
                    a = rng.randrange(shard.num_tokens)
                    b = rng.randrange(a + 1, min(a + 700, shard.num_tokens) + 1)
                    assert np.array_equal(shard.read_range(spec.name, a, b), reference[a:b]), (spec.name, a, b)


def regular_files(root):
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_files_on_disk_match_the_schema_formula(cache):
    manifest = manifest_json(cache)
    capture = manifest["config"]["capture"]
    dims = {"n_taps": len(capture["target_layer_ids"]), "hidden_size": capture["hidden_size"], "top_k": capture["top_k"]}
    chunking = Chunking.from_options(SMALL)
    for name, record in manifest["shards"].items():
        files = regular_files(cache / name)
        formula = chunking.files(capture["hidden_format"], dims, record["tokens"]) + per_shard_files(capture["hidden_format"])
        assert len(files) == formula == record["files"], name
        assert not [f for f in files if f.parent.name == "c"], "no nested chunk-key directories"
    assert capture["storage"]["options"] == chunking.__dict__
    hidden = manifest["plan"]["storage"]["arrays"]["hidden"]
    assert hidden["file_tokens"] == hidden["chunk_tokens"] * SMALL["hidden_chunks_per_file"]


def test_digests_written_while_writing_equal_the_bytes_on_disk(cache):
    """The writer never re-reads a file; what it hashed on the way out must be what is on disk."""
    manifest = manifest_json(cache)
    for name, record in manifest["shards"].items():
        on_disk = hash_files_on_disk(cache / name)
        assert read_digests(open_location(cache), name) == on_disk == hash_shard(open_location(cache), name)
        assert shard_digest(cache / name) == record["digest"]
        assert record["bytes"] == sum(p.stat().st_size for p in regular_files(cache / name) if p.name != "digests.json")


def test_zstd_frame_content_size_is_read_from_the_header():
    for n in (0, 1, 255, 256, 65_791, 65_792, 3 * 2**20, 5_000_001):
        frame = Zstd(level=3).encode(np.random.default_rng(n).integers(0, 4, n, dtype=np.uint8).tobytes())
        assert frame_content_size(bytes(frame[:18])) == n
    assert frame_content_size(b"not a zstd frame") is None


@pytest.fixture
def copy(cache, tmp_path):
    shutil.copytree(cache, tmp_path / "cache")
    return tmp_path / "cache"


@pytest.mark.parametrize("where", ["inner chunk", "index"])
def test_damage_is_named_by_file_and_chunk(copy, where):
    target = copy / "shard-00001" / "hidden" / "c.1.0.0"
    size = target.stat().st_size
    damage_byte(target, size // 3 if where == "inner chunk" else size - 10, 0x01)
    shard = CacheReader(copy).shard("shard-00001")
    message = r"inner chunk \d+: CRC32C mismatch" if where == "inner chunk" else "index CRC32C mismatch"
    with pytest.raises(PipelineError, match=f"{target}: .*{message}" if where == "inner chunk" else f"{target}: {message}"):
        shard.read_range("hidden", 0, shard.num_tokens)
    report = json.loads(cli_here("verify-cache", str(copy), "--tail-rate", "0", "--json").stdout)
    checks = {c["check"]: c for c in report["checks"]}
    assert checks["checksums"]["status"] == "fail" and str(target) in json.dumps(checks["checksums"])
    assert checks["digests"]["status"] == "fail"
    assert "shard-00001/hidden/c.1.0.0: sha256 or size differs from digests.json" in json.dumps(checks["digests"])


def test_a_truncated_file_is_refused(copy):
    """The commit record no longer matches, so the shard is not committed, and says why; the
    direct reader refuses the short file too (a cache that lists shards in its manifest)."""
    target = copy / "shard-00000" / "input_ids" / "c.0"
    os.truncate(target, 10)
    reader = CacheReader(copy)
    assert "shard-00000" not in reader.shards
    with pytest.raises(PipelineError, match=r"shard-00000 is not committed: .*its commit record does not match its "
                                            r"files \(input_ids/c.0 is 10 bytes, the record says \d+\)"):
        reader.shard("shard-00000")
    shard = ShardReader(reader.location, "shard-00000", reader.hidden_format, files=reader.files("shard-00000"))
    with pytest.raises(PipelineError, match=f"{target}: 10 bytes, shorter than its index"):
        shard.read("input_ids", int(shard.sample_ids[0]))


def test_a_missing_file_is_named_when_the_shard_opens(copy):
    (copy / "shard-00000" / "loss_mask" / "c.1").unlink()
    reader = CacheReader(copy)
    with pytest.raises(PipelineError, match=r"shard-00000 is not committed: .*loss_mask/c.1 is listed but missing"):
        reader.shard("shard-00000")
    with pytest.raises(PipelineError, match=r"shard-00000/loss_mask: chunk file\(s\) \[1\] missing of"):
        ShardReader(reader.location, "shard-00000", reader.hidden_format, files=reader.files("shard-00000"))


def test_an_edited_digest_list_is_caught_by_the_manifest_digest(copy):
    """The file list is checked too: editing it to match damaged data changes the shard's digest."""
    target = copy / "shard-00000" / "target_argmax" / "c.0"
    damage_byte(target, 20, 0x01)
    listing = json.loads((copy / "shard-00000" / "digests.json").read_text())
    size, sha = hash_files_on_disk(copy / "shard-00000")["target_argmax/c.0"]
    listing["files"]["target_argmax/c.0"] = {"bytes": size, "sha256": sha}
    (copy / "shard-00000" / "digests.json").write_text(json.dumps(listing))
    report = json.loads(cli_here("verify-cache", str(copy), "--tail-rate", "0", "--json").stdout)
    digests = next(c for c in report["checks"] if c["check"] == "digests")
    assert digests["status"] == "fail"
    assert digests["evidence"]["mismatched"] == ["shard-00000: digest of its files differs from its commit record"]


@pytest.mark.parametrize("command", ["train", "verify-cache"])
def test_a_schema_1_cache_is_refused_in_one_line(copy, tmp_path, command):
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["schema_version"] = 1
    (copy / "manifest.json").write_text(json.dumps(manifest))
    args = ["--cache", str(copy), "--out", str(tmp_path / "run"), "--max-steps", "1"] if command == "train" else [str(copy)]
    result = (cli if command == "train" else cli_here)(command, *args)  # one in a real process
    assert result.returncode == 1
    text = (result.stderr if command == "train" else result.stdout + result.stderr)
    assert "schema_version 1 (one file per chunk) is not read by this version" in text
    assert "re-run `pipeline extract` into a new --cache directory" in text


def test_unknown_chunking_options_are_refused(tmp_path):
    with pytest.raises(PipelineError, match=r"chunking: unknown chunking option\(s\) \['hidden_chunk_kb'\]"):
        run_extract(ExtractConfig(cache=str(tmp_path / "c"), num_shards=1, chunking={"hidden_chunk_kb": 4}), "0",
                    progress=False)
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_an_index_pointing_outside_its_file_is_refused_even_when_its_crc_matches(copy):
    """The index is untrusted: an entry whose offset + size would wrap around 2^64 is refused."""
    import google_crc32c

    target = copy / "shard-00000" / "input_ids" / "c.0"
    data = bytearray(target.read_bytes())
    per_file = SMALL["small_chunks_per_file"]
    start = len(data) - (per_file * 16 + 4)
    index = np.frombuffer(bytes(data[start:-4]), "<u8").reshape(per_file, 2).copy()
    index[0] = (2**64 - 2, 5)
    data[start:-4] = index.tobytes()
    data[-4:] = google_crc32c.value(bytes(data[start:-4])).to_bytes(4, "little")
    target.write_bytes(bytes(data))
    shard = CacheReader(copy).shard("shard-00000")
    with pytest.raises(PipelineError, match=f"{target}: index points outside the file's data"):
        shard.read("input_ids", int(shard.sample_ids[0]))
