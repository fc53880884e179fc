"""A cache must never mix identities (issue 44, DESIGN 6 and 11).

1. Every reader for training and evaluation (train, eval --cache, the direct reader and the
   stream built on it, --cache-local copies) refuses a committed shard whose recorded identity
   differs from the manifest's, in one line naming the shard, the field and both values; no
   option trains on it; verify-cache still names it. The mixed cache is made as users make it:
   shard 1 of a cache extracted with other taps copied over (`cp -r`, `aws s3 sync`).
2. extract refuses a store that does not honour create-if-absent writes, before it writes
   anything (a real relay in front of moto's server that drops `If-None-Match`: see
   harness/s3_server.py `ForgetfulRelay`), and never commits a shard once the manifest it
   created or adopted has been replaced by another identity.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from harness.caches import ARRAYS, edit_record
from harness.runs import REPO, cli, cli_here, stopped
from pipeline.cache.address import open_location
from pipeline.cache.manifest import create_manifest, identity_conflicts, read_manifest
from pipeline.cache.reader import CacheReader, open_cache
from pipeline.cache.store_probe import check_create_if_absent
from pipeline.config import ExtractConfig
from pipeline.errors import PipelineError
from harness.marks import needs_s3
from harness.s3_server import ForgetfulRelay, objects, use_server
from stages.extract.run import run_extract


@pytest.fixture(scope="module")
def other_taps(tmp_path_factory, twelve_rows_cache):
    """The same 12 conversations in the same 3 shards, extracted with taps [0, 2, 4] (the shared
    reference cache has the default [1, 3, 5])."""
    cache = tmp_path_factory.mktemp("other-taps") / "cache"
    run_extract(ExtractConfig(cache=str(cache), data=[str(twelve_rows_cache["data"])], num_shards=3, batch_tokens=256,
                              layers=[0, 2, 4]), None, progress=False)
    return cache


@pytest.fixture
def mixed(tmp_path, twelve_rows_cache, other_taps):
    """The reference cache with its shard 1 replaced by the other-taps cache's shard 1."""
    cache = tmp_path / "mixed"
    shutil.copytree(twelve_rows_cache["cache"], cache)
    shutil.rmtree(cache / "shard-00001")
    shutil.copytree(other_taps / "shard-00001", cache / "shard-00001")
    return cache


def _assert_names_the_shard(message: str, cache) -> None:
    assert f"{cache}: shard-00001 was extracted with another identity" in message, message
    assert "target_layer_ids: shard [0, 2, 4] vs manifest [1, 3, 5]" in message, message
    assert f"pipeline verify-cache {cache}" in message and "pipeline extract --shards 1" in message, message


def test_train_refuses_a_shard_of_other_taps(mixed, tmp_path):
    result = cli("train", "--cache", str(mixed), "--out", str(tmp_path / "run"), "--max-steps", "2",
                 "--allow-mixed-provenance", "--allow-incomplete-cache")  # neither flag admits it
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    _assert_names_the_shard(lines[0], mixed)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_every_reader_refuses_it_and_verify_names_it(mixed, tmp_path):
    with pytest.raises(PipelineError) as direct:
        CacheReader(mixed)
    _assert_names_the_shard(str(direct.value), mixed)
    # The training stream and eval --cache read only through this reader (train's own test above).
    verify = cli_here("verify-cache", str(mixed), "--json")
    assert verify.returncode == 1
    report = json.loads(verify.stdout)
    provenance = next(c for c in report["checks"] if c["check"] == "provenance")
    assert provenance["status"] == "fail"
    assert provenance["evidence"]["problems"] == ["shard-00001: target_layer_ids [0, 2, 4] differs from the cache's [1, 3, 5]"]


def test_the_way_out_it_names_works(mixed, twelve_rows_cache):
    """Remove the foreign shard and extract it again with the cache's settings: the cache opens,
    and the shard holds what the original extraction wrote (the independent reference)."""
    shutil.rmtree(mixed / "shard-00001")
    result = cli_here("extract", "--data", str(twelve_rows_cache["data"]), "--cache", str(mixed), "--num-shards", "3",
                      "--batch-tokens", "256", "--shards", "1")
    assert result.returncode == 0, result.stderr
    mended, reference = CacheReader(mixed).shard(1), CacheReader(twelve_rows_cache["cache"]).shard(1)
    assert list(mended.sample_ids) == list(reference.sample_ids)
    for sid in map(int, reference.sample_ids):
        for name in ARRAYS:
            np.testing.assert_array_equal(mended.read(name, sid), reference.read(name, sid))
        assert np.array_equal(mended.hidden(sid).float().numpy(), reference.hidden(sid).float().numpy())


# Each identity field a shard repeats, changed in shard 1's commit record as a writer of another
# identity would have written it: the reader names the field and both values.
FIELDS = {
    "top_k": lambda identity: 7,
    "hidden_format": lambda identity: "fp8",
    "hidden_size": lambda identity: 256,
    "vocab_size": lambda identity: 1024,
    "target_config_sha256": lambda identity: "0" * 64,
    "target_weights": lambda identity: {**identity["target_weights"], "files": {"model.safetensors": "1" * 64}},
    "tokenizer_files_sha256": lambda identity: "2" * 64,
    "chat_template_sha256": lambda identity: "3" * 64,
    "thinking": lambda identity: "on" if identity["thinking"] == "off" else "off",
}


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_each_identity_field_of_a_shard_is_compared(field, tmp_path, twelve_rows_cache):
    cache = tmp_path / "cache"
    shutil.copytree(twelve_rows_cache["cache"], cache)
    before = {}

    def change(record):
        before["value"] = record["identity"][field]
        record["identity"][field] = FIELDS[field](record["identity"])
    edit_record(cache, "shard-00001", change)
    with pytest.raises(PipelineError, match=rf"shard-00001 was extracted with another identity .*\({field}: shard ") as e:
        CacheReader(cache)
    assert "vs manifest" in str(e.value) and len(str(e.value).splitlines()) == 1
    assert str(before["value"])[:20] in str(e.value) or field == "target_weights"


def test_schema_version_of_a_shard_is_compared(tmp_path, twelve_rows_cache):
    cache = tmp_path / "cache"
    shutil.copytree(twelve_rows_cache["cache"], cache)
    edit_record(cache, "shard-00002", lambda record: record.update(schema_version=3))
    with pytest.raises(PipelineError, match=r"shard-00002 .*\(schema_version: shard 3 vs manifest 2\)"):
        CacheReader(cache)


def test_a_shard_written_before_a_field_was_recorded_is_read(tmp_path, twelve_rows_cache):
    """Shards of earlier versions lack target_weights and thinking: not compared, still read."""
    cache = tmp_path / "cache"
    shutil.copytree(twelve_rows_cache["cache"], cache)
    for name in ("shard-00000", "shard-00001", "shard-00002"):
        edit_record(cache, name, lambda record: [record["identity"].pop(k) for k in ("target_weights", "thinking")])
    assert CacheReader(cache).shards == ["shard-00000", "shard-00001", "shard-00002"]


def test_extract_never_commits_under_a_replaced_manifest(tmp_path, twelve_rows_cache):
    """A writer frozen after its first batch finds, when it resumes, that manifest.json now holds
    another identity (what a store without create-if-absent lets a second extract do, or a sync
    of another cache over this one): it exits in one line and commits nothing."""
    cache = tmp_path / "cache"
    env = {**os.environ, "PIPELINE_FAILPOINT": "extract.batch@1:stop", "COLUMNS": "200", "NO_COLOR": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "cli", "extract", "--data", str(twelve_rows_cache["data"]),
                             "--cache", str(cache), "--num-shards", "3", "--batch-tokens", "256"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not stopped(proc.pid):
            assert proc.poll() is None, proc.communicate()[1]
            time.sleep(0.2)
        manifest = json.loads((cache / "manifest.json").read_text())
        manifest["config"]["capture"]["target_layer_ids"] = [0, 2, 4]
        (cache / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        os.kill(proc.pid, signal.SIGCONT)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "manifest.json: replaced by another extract with a different configuration" in lines[0]
    assert "capture.target_layer_ids: [0, 2, 4] -> [1, 3, 5]" in lines[0] and "shard-00000" in lines[0]
    assert not list(cache.glob("shard-*/digests.json"))  # nothing committed
    assert read_manifest(cache).shards == {}




def test_a_directory_honours_create_if_absent(tmp_path):
    location = open_location(tmp_path / "cache")
    location.ensure_root()
    probe = check_create_if_absent(location)
    assert probe.key.startswith(".create-if-absent-probe-")
    assert list((tmp_path / "cache").iterdir()) == []  # the probe leaves nothing


@pytest.fixture
def forgetful(s3_server):
    relay = ForgetfulRelay(s3_server.port)
    yield relay
    relay.stop()


@needs_s3
def test_extract_refuses_a_store_that_ignores_create_if_absent(s3_server, forgetful, twelve_rows_cache):
    """Two extracts of different taps started together into one prefix of a store that accepts a
    second conditional PUT: both stop in one line before writing anything (before this check,
    one exited 0 and the cache's manifest named taps its shards did not hold)."""
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}/hs"
    env = {**os.environ, **s3_server.env(forgetful.endpoint), "COLUMNS": "200", "NO_COLOR": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "cli", "extract", "--data", str(twelve_rows_cache["data"]),
                               "--cache", url, "--num-shards", "3", "--layers", layers], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for layers in ("1,3,5", "0,2,4")]
    for proc in procs:
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 1
        lines = stderr.strip().splitlines()
        assert len(lines) == 1, stderr
        assert lines[0].startswith(f"error: {url}: the store does not honour create-if-absent writes"), lines[0]
    assert objects(s3_server.client(), bucket) == {}
    # What the relay saw: each extract's probe, two conditional writes and one delete, before anything else.
    assert [m for m, _, _ in forgetful.requests].count("PUT") == 4
    assert all(had for m, _, had in forgetful.requests if m == "PUT")


@needs_s3
def test_the_probe_costs_three_requests_and_passes_on_moto(s3_server, forgetful, monkeypatch):
    bucket = s3_server.new_bucket()
    use_server(monkeypatch, s3_server.env())
    probe = check_create_if_absent(open_location(f"s3://{bucket}/hs"))
    assert objects(s3_server.client(), bucket) == {}
    use_server(monkeypatch, s3_server.env(forgetful.endpoint))
    with pytest.raises(PipelineError, match="does not honour create-if-absent"):
        check_create_if_absent(open_location(f"s3://{bucket}/hs"))
    methods = [m for m, _, _ in forgetful.requests]
    assert methods[:2] == ["PUT", "PUT"] and len(methods) == 3 and methods[2] in ("DELETE", "POST")
    assert objects(s3_server.client(), bucket) == {}
    assert probe.milliseconds > 0


@needs_s3
def test_a_replaced_manifest_is_seen_on_such_a_store(s3_server, forgetful, twelve_rows_cache, monkeypatch):
    """On the forgetful store both creators 'create' manifest.json; the second one's read-back
    holds its own identity, and the first one's check before each commit sees the other."""
    bucket = s3_server.new_bucket()
    reference = read_manifest(twelve_rows_cache["cache"])  # stands for the first extract's manifest
    theirs_capture = dataclasses.replace(reference.identity.capture, target_layer_ids=[0, 2, 4])
    theirs = dataclasses.replace(reference, identity=dataclasses.replace(reference.identity, capture=theirs_capture),
                                 shards={})
    mine = dataclasses.replace(reference, shards={})
    use_server(monkeypatch, s3_server.env(forgetful.endpoint))
    location = open_location(f"s3://{bucket}/hs")
    first, created_first = create_manifest(location, mine)
    second, created_second = create_manifest(location, theirs)
    assert created_first and created_second  # the store let both create it
    assert first.identity == mine.identity and second.identity == theirs.identity
    conflicts = identity_conflicts(location, mine.identity)
    assert [(d.field, d.recorded, d.other) for d in conflicts] == [("capture.target_layer_ids", [0, 2, 4], [1, 3, 5])]


@needs_s3
def test_cache_local_copies_refuse_a_mixed_bucket(s3_server, mixed, tmp_path, monkeypatch):
    bucket = s3_server.new_bucket()
    client = s3_server.client()
    for path in sorted(p for p in mixed.rglob("*") if p.is_file()):
        client.put_object(Bucket=bucket, Key=f"hs/{path.relative_to(mixed).as_posix()}", Body=path.read_bytes())
    url = f"s3://{bucket}/hs"
    use_server(monkeypatch, s3_server.env())
    with pytest.raises(PipelineError) as e:
        open_cache(url, local=tmp_path / "copies", local_size="1G")
    _assert_names_the_shard(str(e.value), url)
    assert not list(tmp_path.glob("copies/**/shard-*"))  # refused before any shard was copied

