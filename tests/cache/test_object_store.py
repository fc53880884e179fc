"""Caches in an object store (issue 27, DESIGN 11), against a real S3-compatible server (moto's
standalone server on 127.0.0.1) through the client users run; buckets are read back with boto3,
an independent client. The same cache in a directory and in a bucket is the same bytes, verifies
in both places (and after copying either way), and trains to the same losses; writers on
different shards of one prefix never lose each other's shards; bad locations fail in one line."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from harness.caches import assert_same_content, manifest_json
from harness.kill_trials import BATCH_TOKENS, SHARDS, checked_trials
from harness.marks import needs_s3
from harness.runs import REPO, stopped
from harness.s3_server import KEY_ID, SECRET, MotoServer, Outage, download, objects, use_server
from pipeline.config import ExtractConfig
from stages.extract.run import run_extract
from stages.verify_cache.options import VerifyOptions
from stages.verify_cache.run import run_verify

pytestmark = needs_s3


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    return use_server(monkeypatch, s3_server.env())


def extract_cfg(cache: str, data, **kwargs) -> ExtractConfig:
    return ExtractConfig(cache=cache, data=[str(data)], num_shards=SHARDS, batch_tokens=BATCH_TOKENS, **kwargs)


def file_hashes(files: dict[str, bytes]) -> dict[str, str]:
    return {k: hashlib.sha256(v).hexdigest() for k, v in files.items()}


def directory_files(root) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and not p.name.startswith(".")}


def run_cli(*args, env: dict, **kwargs):
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1", **env}, timeout=600, **kwargs)


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def test_a_bucket_cache_is_the_directory_cache_byte_for_byte(s3_server, s3_env, data, reference, tmp_path):
    bucket = s3_server.new_bucket()
    summary = run_extract(extract_cfg(f"s3://{bucket}/hs", data), None, progress=False)
    assert summary["shards_written"] == SHARDS and summary["cache"] == f"s3://{bucket}/hs"
    stored = objects(s3_server.client(), bucket, "hs/")
    on_disk = directory_files(reference)
    # Every shard file is the same bytes (manifest.json records when and where, so it differs).
    shard_files = {k for k in on_disk if k.startswith("shard-")}
    data_files = {k for k in shard_files if not k.endswith("digests.json")}
    assert {k for k in stored if k.startswith("shard-")} == shard_files
    assert file_hashes({k: stored[k] for k in data_files}) == file_hashes({k: on_disk[k] for k in data_files})
    digests = {k.split("/")[0]: json.loads(stored[k])["shard"]["digest"] for k in shard_files if k.endswith("digests.json")}
    assert digests == {name: rec["digest"] for name, rec in manifest_json(reference)["shards"].items()}

    for where in (f"s3://{bucket}/hs", str(reference)):
        report = run_verify(VerifyOptions(cache=where, tail_rate=0.5))
        assert report["passed"], [c for c in report["checks"] if c["status"] == "fail"]
        assert report["cache"] == where
    # Copied either way, a cache verifies where it lands.
    copied = download(s3_server.client(), bucket, "hs/", tmp_path / "copied")
    assert run_verify(VerifyOptions(cache=str(copied), tail_rate=0))["passed"]
    other = s3_server.new_bucket()
    for rel, blob in directory_files(reference).items():
        s3_server.client().put_object(Bucket=other, Key=f"up/{rel}", Body=blob)
    assert run_verify(VerifyOptions(cache=f"s3://{other}/up", tail_rate=0))["passed"]


def test_training_from_a_bucket_equals_training_from_a_directory(s3_server, s3_env, data, reference, tmp_path):
    from stages.train.run import resolve_config, run_train

    bucket = s3_server.new_bucket()
    for rel, blob in directory_files(reference).items():
        s3_server.client().put_object(Bucket=bucket, Key=f"c/{rel}", Body=blob)
    losses = {}
    copies = tmp_path / "copies"
    for name, cache, local in (("directory", str(reference), None), ("bucket", f"s3://{bucket}/c", None),
                               ("bucket via local copies", f"s3://{bucket}/c", str(copies))):
        out = tmp_path / name
        cfg, preset = resolve_config(None, {"cache": cache, "out": str(out), "max_steps": 3, "batch_sequences": 4,
                                            "micro_batch_sequences": 4, "log_every": 1, "cache_local": local,
                                            "cache_local_size": "64K"})
        run_train(cfg, preset_target=preset, warn=lambda *_: None)
        logs = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
        losses[name] = [row["loss"] for row in logs if "loss" in row]
    assert len(losses["directory"]) == 3
    assert losses["bucket"] == losses["directory"] == losses["bucket via local copies"]
    kept = [p for p in copies.rglob("*") if p.is_file()]
    assert kept and sum(p.stat().st_size for p in kept) <= 64 * 1024  # the budget holds
    for p in kept:  # each copy is its object, byte for byte
        rel = p.relative_to(next(copies.iterdir())).as_posix()
        assert p.read_bytes() == s3_server.client().get_object(Bucket=bucket, Key=f"c/{rel}")["Body"].read()


def test_local_copies_serve_rereads_within_their_budget(s3_server, s3_env, reference):
    """Two passes over every sample through --cache-local's copies: the second pass is served from
    disk where the budget allows, and what is read equals the directory cache."""
    from harness.caches import ARRAYS
    from pipeline.cache.local_copy import LocalCopies
    from pipeline.cache.address import open_location
    from pipeline.cache.reader import CacheReader

    bucket = s3_server.new_bucket()
    for rel, blob in directory_files(reference).items():
        s3_server.client().put_object(Bucket=bucket, Key=f"c/{rel}", Body=blob)
    want = CacheReader(reference)
    copies = LocalCopies(open_location(f"s3://{bucket}/c"), reference.parent / "copies", 10**9)
    got = CacheReader(copies)
    for _ in range(2):
        for name in want.shards:
            a, b = want.shard(name), got.shard(name)
            for sid in a.sample_ids:
                for key in (*ARRAYS, "hidden"):
                    assert (a.read(key, int(sid)) == b.read(key, int(sid))).all(), (name, sid, key)
    assert copies.misses > 0 and copies.hits > copies.misses


@pytest.mark.parametrize("where", ["bucket", "directory without locks"])
def test_concurrent_writers_of_one_cache_never_lose_each_others_shards(s3_server, s3_env, data, reference, tmp_path, where):
    if where == "bucket":
        cache = f"s3://{s3_server.new_bucket()}/shared"
        extra = []
    else:
        cache = str(tmp_path / "shared")
        extra = ["--no-shard-locks"]
    args = ["extract", "--cache", cache, "--data", str(data), "--num-shards", str(SHARDS), "--batch-tokens",
            str(BATCH_TOKENS), "--json", *extra]
    env = {**os.environ, **s3_env, "COLUMNS": "200"}
    procs = [subprocess.Popen([sys.executable, "-m", "cli", *args, "--shards", shards], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for shards in ("0", "1-2")]
    results = [(p.communicate(timeout=600), p.returncode) for p in procs]
    assert all(code == 0 for _, code in results), [err[-2000:] for (_, err), _ in results]
    written = sum(json.loads(out)["shards_written"] for (out, _), _ in results)
    assert written == SHARDS
    if where == "bucket":
        local = download(s3_server.client(), cache.split("/")[2], "shared/", tmp_path / "from-bucket")
    else:
        local = tmp_path / "shared"
    assert sorted(manifest_json(local)["shards"]) == [f"shard-{i:05d}" for i in range(SHARDS)]
    assert_same_content(local, reference)


def test_a_store_cut_off_mid_commit_fails_in_one_line_and_the_rerun_resumes(s3_server, s3_env, data, reference, tmp_path):
    """The client retries, then gives up in one line naming the shard; nothing half-written looks
    committed; with the store back, the same command completes the cache to the reference's bytes."""
    bucket = s3_server.new_bucket()
    relay = Outage(s3_server.port)
    env = {**s3_env, "AWS_ENDPOINT_URL": relay.endpoint, "DFLASH_S3_RETRY_SECONDS": "2"}
    args = ["extract", "--cache", f"s3://{bucket}/c", "--data", str(data), "--num-shards", str(SHARDS),
            "--batch-tokens", str(BATCH_TOKENS)]
    proc = subprocess.Popen([sys.executable, "-m", "cli", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env, "COLUMNS": "200", "PIPELINE_FAILPOINT": "writer.fsynced@2:stop"})
    deadline = time.time() + 300
    while time.time() < deadline and not stopped(proc.pid):
        time.sleep(0.05)
    assert stopped(proc.pid), "the extraction never reached its second commit"
    relay.cut()  # the store goes away between the shard's files and its commit record
    os.kill(proc.pid, signal.SIGCONT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "shard-00001: write failed" in lines[0] and "cannot reach the endpoint" in lines[0], stderr
    assert "Traceback" not in stderr and SECRET not in stderr
    relay.restore()
    stored = objects(s3_server.client(), bucket, "c/")
    assert "shard-00001/digests.json" not in stored and "shard-00000/digests.json" in stored
    resumed = run_cli(*args, "--json", env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["shards_written"] == SHARDS - 1
    assert_same_content(download(s3_server.client(), bucket, "c/", tmp_path / "final"), reference)




def in_process(*args, env: dict):
    """The CLI through typer's runner, in this process (no interpreter start per call)."""
    from typer.testing import CliRunner

    from cli import app
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1", **env})
    result.returncode = result.exit_code
    return result


def test_bad_locations_fail_in_one_line_with_nothing_committed(s3_server, s3_env, data, tmp_path):
    def fails(cache: str, message: str, *extra, env: dict | None = None):
        result = in_process("extract", "--cache", cache, "--data", str(data), "--num-shards", str(SHARDS), *extra,
                            env=env or s3_env)
        assert result.returncode == 1, result.stderr
        lines = error_lines(result)
        assert len(lines) == 1 and message in lines[0], result.stderr
        assert "Traceback" not in result.stderr and SECRET not in result.stderr + result.stdout
        return lines[0]

    fails("s3://no-such-bucket-here/c", "NoSuchBucket")
    fails(f"s3://{s3_server.new_bucket()}/c", "cannot reach the endpoint",
          env={**s3_env, "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "DFLASH_S3_RETRY_SECONDS": "1"})
    fails("s3://Not_A_Bucket/c", "is not a valid S3 bucket name")
    fails("gs://bucket/c", "unsupported cache location scheme 'gs'")

    bucket = s3_server.new_bucket()
    s3_server.client().put_object(Bucket=bucket, Key="data/train.parquet", Body=b"someone else's")
    fails(f"s3://{bucket}/data", "holds train.parquet but no cache manifest.json")
    assert set(objects(s3_server.client(), bucket)) == {"data/train.parquet"}

    bucket = s3_server.new_bucket()
    first = in_process("extract", "--cache", f"s3://{bucket}/c", "--data", str(data), "--num-shards", str(SHARDS),
                       "--shards", "0", env=s3_env)
    assert first.returncode == 0, first.stderr
    before = objects(s3_server.client(), bucket)
    fails(f"s3://{bucket}/c", "was created with a different configuration (capture.top_k: 32 -> 8", "--top-k", "8")
    assert objects(s3_server.client(), bucket) == before

    verify = in_process("verify-cache", "s3://no-such-bucket-here/c", env=s3_env)
    assert verify.returncode == 2 and len(error_lines(verify)) == 1 and "NoSuchBucket" in verify.stderr  # 2: cannot verify


def test_refused_credentials_are_one_line_without_the_secret(data, tmp_path):
    """A server that checks signatures (moto with authentication on): an unknown key is refused."""
    guarded = MotoServer(INITIAL_NO_AUTH_ACTION_COUNT="0")
    try:
        env = {**guarded.env(), "AWS_ACCESS_KEY_ID": "AKIAUNKNOWN000000000", "DFLASH_S3_RETRY_SECONDS": "1"}
        result = in_process("extract", "--cache", "s3://some-bucket/c", "--data", str(data), env=env)
        assert result.returncode == 1
        lines = error_lines(result)
        assert len(lines) == 1 and "InvalidAccessKeyId" in lines[0], result.stderr
        assert SECRET not in result.stderr + result.stdout
    finally:
        guarded.stop()


def test_profile_files_supply_credentials_and_endpoint(s3_server, data, tmp_path):
    """No AWS_* keys in the environment: the named profile of the shared files is used."""
    bucket = s3_server.new_bucket()
    (tmp_path / "credentials").write_text(f"[team]\naws_access_key_id = {KEY_ID}\naws_secret_access_key = {SECRET}\n")
    (tmp_path / "config").write_text(f"[profile team]\nregion = us-east-1\nendpoint_url = {s3_server.endpoint}\n")
    env = {k: None for k in os.environ if k.startswith("AWS_")}  # None: unset for the call
    env.update(AWS_PROFILE="team", AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "credentials"),
               AWS_CONFIG_FILE=str(tmp_path / "config"))
    result = in_process("extract", "--cache", f"s3://{bucket}/c", "--data", str(data), "--num-shards", str(SHARDS),
                        "--shards", "0", "--json", env=env)
    assert result.returncode == 0, result.stderr
    assert "shard-00000/digests.json" in objects(s3_server.client(), bucket, "c/")


def test_no_credentials_are_named_as_such_by_every_command(s3_server, data, tmp_path):
    """No AWS_* keys, no profile: the client never reaches the bucket (it asks the instance
    metadata service for a role, here a port nothing listens on, and gets none), and its own error
    reads like a refusal by the store. Every command says instead what is missing and how to give it."""
    from harness.ports import free_port

    bucket = s3_server.new_bucket()
    env = {k: None for k in os.environ if k.startswith("AWS_")}  # None: unset for the call
    env.update(AWS_ENDPOINT_URL=s3_server.endpoint, AWS_REGION="us-east-1", DFLASH_S3_RETRY_SECONDS="1",
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-credentials"), AWS_CONFIG_FILE=str(tmp_path / "no-config"),
               AWS_METADATA_ENDPOINT=f"http://127.0.0.1:{free_port()}")
    cache = f"s3://{bucket}/c"
    for args, code in [(["cache-info", cache], 1), (["verify-cache", cache], 2),
                       (["extract", "--cache", cache, "--data", str(data), "--num-shards", str(SHARDS)], 1),
                       (["train", "--cache", cache, "--out", str(tmp_path / "run")], 1)]:
        result = in_process(*args, env=env)
        assert result.returncode == code, (args, result.stderr)
        lines = error_lines(result)
        assert len(lines) == 1, (args, result.stderr)
        line = lines[0]
        assert line.startswith(f"error: {cache}") and "no AWS credentials" in line, line
        assert "no AWS_ACCESS_KEY_ID in the environment" in line and f"no profile 'default' in {tmp_path / 'no-credentials'}" in line
        assert "no instance role found (the instance metadata service at http://127.0.0.1:" in line and "could not be reached" in line
        assert "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in line and "AWS_PROFILE" in line
        assert "cannot reach the endpoint" not in line  # the bucket's endpoint was never the problem
    assert objects(s3_server.client(), bucket) == {}


def test_the_missing_extra_is_named_in_one_line(tmp_path):
    code = ("import sys; sys.modules['obstore'] = None; sys.argv = ['pipeline', 'verify-cache', 's3://bucket/c']; "
            "import cli; cli.app()")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2  # verify-cache: 2 = could not verify
    assert error_lines(result) == ['error: S3 caches need the optional extra: pip install "dflash-pipeline[s3]" (obstore)']


def test_kill_9_against_a_bucket(s3_server, s3_env, data, tmp_path):
    """kill -9 at every phase of extraction into a bucket (one trial per failpoint, one after a
    random delay; `DFLASH_S3_KILL_TRIALS=N` runs N per failpoint for a measurement): what a reader
    sees after the kill, judged on a copy read with boto3, is only whole shards, and every resume
    completes the cache to an uninterrupted run's bytes."""
    per_failpoint = int(os.environ.get("DFLASH_S3_KILL_TRIALS", "1"))
    reference = tmp_path / "reference"  # the trial driver writes its own uninterrupted run here
    aimed = checked_trials(tmp_path, data, reference, per_failpoint=per_failpoint, timed=per_failpoint,
                           s3={"endpoint": s3_server.endpoint, "bucket": s3_server.new_bucket()}, env=s3_env)
    assert all(t["after_kill"]["partial"] for t in aimed if t["failpoint"].startswith("writer.fsynced"))
