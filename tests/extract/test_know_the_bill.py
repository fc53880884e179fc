"""Know the bill before, and what you hold after (issue 39): `extract --dry-run` against what a
real extraction wrote, and `pipeline cache-info` against the records and files read
independently (plain JSON and file sizes, not the tool's parser), in a directory and a bucket."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import zarr

from harness.caches import manifest_json
from harness.runs import cli_here
from pipeline.config import ExtractConfig
from harness.marks import needs_s3
from harness.s3_server import ForgetfulRelay, MotoServer
from stages.extract.run import run_extract

EXTRACT = ["--num-shards", "3", "--batch-tokens", "256"]  # the twelve-row caches' settings


def _dry(data, cache, *extra) -> dict:
    result = cli_here("extract", "--dry-run", "--data", str(data), "--cache", str(cache), *EXTRACT, *extra, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _raw_array_bytes(cache: Path) -> int:
    """Every array's uncompressed size as Zarr declares it (shape x itemsize), shard by shard."""
    total = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # digests.json is not a Zarr node
        for shard in sorted(cache.glob("shard-*")):
            total += sum(array.nbytes for _, array in zarr.open_group(str(shard), mode="r").arrays())
    return total


def _stored_bytes(cache: Path) -> int:
    """What the shards' files hold on disk, digests.json (the commit record) aside."""
    return sum(p.stat().st_size for p in cache.glob("shard-*/**/*") if p.is_file() and p.name != "digests.json")


@pytest.fixture(scope="module")
def alike(tmp_path_factory, train_rows):
    """Twelve rows of one kind (no tool schemas) and their caches in both formats, so that a pilot
    shard holds rows like the rest. Rows that share a long prefix (the same tool schemas in the
    system turn) have the same hidden states over it, which zstd finds within a shard: the shared
    twelve rows put two such rows in shard 0 and one in each other shard, and shard 0's ratio
    then under-predicted the whole cache by 14% (BENCHMARKS.md "Know the bill")."""
    from harness.runs import write_rows

    root = tmp_path_factory.mktemp("alike")
    data = write_rows(root / "convs.jsonl", [r for r in train_rows if not r.get("tools")][:12])
    caches = {}
    for fmt in ("bf16", "fp8"):
        caches[fmt] = root / fmt
        run_extract(ExtractConfig(cache=str(caches[fmt]), data=[str(data)], num_shards=3, batch_tokens=256,
                                  hidden_format=fmt), None, progress=False)
    return data, caches


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_the_dry_run_bill_is_what_extract_writes(fmt, tmp_path, alike):
    """Rows, tokens, samples, files and raw bytes exactly; stored bytes within 3% once the
    compression ratio of a pilot shard (cache-info's stored_vs_raw of shard 0 alone) is passed."""
    data, real = alike[0], alike[1][fmt]
    target = tmp_path / "cache-to-be"
    bill = _dry(data, target, "--hidden-format", fmt, "--assume-tokens-per-s", "500")
    assert not target.exists()  # nothing written, not even the directory
    records = manifest_json(real)["shards"]
    assert bill["tokens"] == sum(r["tokens"] for r in records.values())
    assert bill["samples"] == sum(r["samples"] for r in records.values())
    assert bill["supervised_tokens"] == sum(r["counts"]["supervised_tokens"] for r in records.values())
    assert [s["samples"] for s in bill["shards"]] == [records[f"shard-0000{i}"]["samples"] for i in range(3)]
    assert bill["files"] == sum(1 for p in real.glob("shard-*/**/*") if p.is_file())
    assert bill["raw_bytes"] == _raw_array_bytes(real)
    assert bill["extract_seconds"] == pytest.approx(bill["tokens"] / 500)
    stored = _stored_bytes(real)
    assert stored <= bill["stored_bytes"]  # without a measured ratio the estimate is an upper bound

    pilot = tmp_path / "pilot"
    shutil.copytree(real, pilot)
    for name in ("shard-00001", "shard-00002"):
        shutil.rmtree(pilot / name)
    info = cli_here("cache-info", str(pilot), "--json")
    assert info.returncode == 0, info.stderr
    ratio = json.loads(info.stdout)["bytes"]["stored_vs_raw"]
    assert 0.3 < ratio < 1.0
    estimate = _dry(data, target, "--hidden-format", fmt, "--assume-compression", str(ratio))["stored_bytes"]
    assert estimate == pytest.approx(stored, rel=0.03)


def test_the_dry_run_reads_no_weights(tmp_path, embedded, twelve_rows_cache):
    target = tmp_path / "config-and-tokenizer-only"
    shutil.copytree(embedded.TARGET_DIR, target, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    bill = _dry(twelve_rows_cache["data"], tmp_path / "cache", "--target", str(target))
    reference = _dry(twelve_rows_cache["data"], tmp_path / "cache")
    assert bill["tokens"] == reference["tokens"] > 0
    # Not the embedded preset's three taps: an 8-layer target's default five (DESIGN 3.1), from its config.
    assert bill["taps"] == [1, 2, 3, 4, 5] and reference["taps"] == [1, 3, 5]
    # ids, mask, argmax, top-32 ids + logits, logsumexp, then the taps: 5 x 128 bf16.
    assert bill["raw_bytes_per_token"] == 4 + 1 + 4 + 32 * 8 + 4 + 5 * 128 * 2


def test_the_dry_run_refuses_what_extract_refuses(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
                   '{"messages": 3}\n')
    result = cli_here("extract", "--dry-run", "--data", str(bad), "--cache", str(tmp_path / "c"))
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and f"{bad}:2" in result.stderr, result.stderr
    stray = cli_here("extract", "--data", str(bad), "--cache", str(tmp_path / "c"), "--assume-compression", "0.5")
    assert stray.returncode == 1 and "go with --dry-run" in stray.stderr


def test_cache_info_sums_the_records(twelve_rows_cache):
    cache = twelve_rows_cache["cache"]
    result = cli_here("cache-info", str(cache), "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    raw = manifest_json(cache)
    records = raw["shards"]
    assert info["completeness"] == {"committed": 3, "planned": 3, "complete": True, "missing": [], "missing_rows": 0,
                                    "broken": {}, "other_identity": {}}
    assert info["identity"]["capture"]["target_layer_ids"] == raw["config"]["capture"]["target_layer_ids"]
    assert info["identity"]["tokenizer"]["chat_template_sha256"] == raw["config"]["tokenizer"]["chat_template_sha256"]
    assert info["counts"]["tokens"] == sum(r["tokens"] for r in records.values())
    for key in ("supervised_tokens", "truncated", "malformed", "rows"):
        assert info["counts"][key] == sum(r["counts"][key] for r in records.values()), key
    assert info["bytes"]["stored"] == _stored_bytes(cache)
    assert info["bytes"]["files"] == sum(1 for p in cache.glob("shard-*/**/*") if p.is_file())
    assert info["bytes"]["raw"] == _raw_array_bytes(cache)
    assert info["bytes"]["per_token"] == pytest.approx(_stored_bytes(cache) / info["counts"]["tokens"])
    kinds = {op: {r["kernels"]["ops"][op]["kind"] for r in records.values()} for op in next(iter(records.values()))["kernels"]["ops"]}
    assert {op: {k.split(" ")[0] for k in groups} for op, groups in info["provenance"]["ops"].items()} == kinds
    assert info["provenance"]["kernel_path"]["torch"]["shards"] == 3
    assert info["provenance"]["hosts"] == {records["shard-00000"]["host"]: {"shards": 3, "names": sorted(records)}}
    assert "digests.json" in info["shard_records"] and info["read"]["requests"] is None
    human = cli_here("cache-info", str(cache))
    assert "shards committed / planned" in human.stdout and "3 / 3" in human.stdout


def test_cache_info_names_what_is_wrong(tmp_path, twelve_rows_cache):
    cache = tmp_path / "cache"
    shutil.copytree(twelve_rows_cache["cache"], cache)
    shutil.rmtree(cache / "shard-00002")
    record = json.loads((cache / "shard-00001" / "digests.json").read_text())
    record["shard"]["identity"]["top_k"] = 16
    record["shard"]["kernels"]["ops"]["chunk_gated_delta_rule"]["kind"] = "fla"
    (cache / "shard-00001" / "digests.json").write_text(json.dumps(record))
    info = json.loads(cli_here("cache-info", str(cache), "--json").stdout)
    assert info["completeness"]["committed"] == 2 and info["completeness"]["missing"] == ["shard-00002"]
    assert info["completeness"]["other_identity"] == {"shard-00001": ["top_k: shard 16 vs manifest 32"]}
    assert info["provenance"]["ops"]["chunk_gated_delta_rule"] == {
        "fla": {"shards": 1, "names": ["shard-00001"]}, "torch": {"shards": 1, "names": ["shard-00000"]}}


@needs_s3
def test_cache_info_on_a_bucket_counts_its_requests(tmp_path, twelve_rows_cache):
    """The same summary from a bucket as from the directory it was copied from, in as many
    requests as the relay in front of the server counts (manifest, listing, one per record)."""
    server = MotoServer()
    relay = ForgetfulRelay(server.port, drop=())  # forwards everything, counts it
    try:
        bucket = server.new_bucket()
        client = server.client()
        cache = twelve_rows_cache["cache"]
        for path in sorted(p for p in cache.rglob("*") if p.is_file()):
            client.put_object(Bucket=bucket, Key=f"hs/{path.relative_to(cache).as_posix()}", Body=path.read_bytes())
        result = cli_here("cache-info", f"s3://{bucket}/hs", "--json", env=server.env(relay.endpoint))
        assert result.returncode == 0, result.stderr
        remote = json.loads(result.stdout)
    finally:
        relay.stop()
        server.stop()
    local = json.loads(cli_here("cache-info", str(cache), "--json").stdout)
    for key in ("identity", "completeness", "provenance", "counts", "bytes"):
        assert remote[key] == local[key], key
    reads = [r for r in relay.requests if r[0] in ("GET", "HEAD")]
    assert remote["read"]["requests"] == len(relay.requests) == len(reads)
    assert len(reads) == 1 + 1 + 1 + 3  # reachability LIST, manifest GET, one LIST page, three records
