"""Several nodes (issue 27, DESIGN 11): two torchrun launchers on this machine stand in for two
nodes (`--nnodes 2`, c10d rendezvous on 127.0.0.1, gloo). What a node writes and what a run
learns do not depend on how many nodes ran: the cache equals a one-node run's shard for shard
(in a directory and in a bucket), two nodes x 1 process train exactly as one node x 2 processes,
and a worker killed mid-run is restarted by torchrun and resumes from the last checkpoint to the
uninterrupted run's bytes."""

from __future__ import annotations

import json
import subprocess

import pytest

from harness.caches import manifest_json
from harness.marks import needs_s3
from harness.runs import small_cache, torchrun, two_nodes, write_rows
from harness.s3_server import MotoServer, download
from pipeline.distributed import SHARED_STORE_OPT_OUT, elastic_restart_hazard

SHARDS = 4
TRAIN = ["--max-steps", "8", "--log-every", "1", "--checkpoint-every", "4", "--micro-batch-sequences", "2", "--json"]


def failures(results: list[subprocess.CompletedProcess]) -> str:
    """Each launcher's exit code, the lines of its stderr that name an error (a worker's own
    traceback sits above torchrun's summary, out of reach of a plain tail) and the tail."""
    said = []
    for rank, r in enumerate(results):
        lines = r.stderr.splitlines()
        errors = [x for x in lines if any(w in x for w in ("Error", "error:", "Traceback", "Exception", "timeout"))]
        said.append(f"launcher {rank}: exit {r.returncode}\n  " + "\n  ".join(errors[-30:]) + "\n  tail:\n"
                    + "\n".join(lines[-15:]))
    return "\n".join(said)


@pytest.fixture(scope="module")
def data(tmp_path_factory, train_rows):
    return write_rows(tmp_path_factory.mktemp("nodes") / "convs.jsonl", train_rows[:16])


@pytest.fixture(scope="module")
def one_node(tmp_path_factory, train_rows):
    """The same rows extracted by one process."""
    return small_cache(tmp_path_factory.mktemp("one-node"), train_rows[:16], SHARDS)


def digests(cache) -> dict[str, str]:
    return {name: rec["digest"] for name, rec in manifest_json(cache)["shards"].items()}


def test_two_node_extract_equals_one_node_in_a_directory(data, one_node, tmp_path):
    cache = tmp_path / "cache"
    results = two_nodes("extract", "--cache", str(cache), "--data", str(data), "--num-shards", str(SHARDS), "--json")
    assert all(r.returncode == 0 for r in results), failures(results)
    assert len(digests(cache)) == SHARDS and digests(cache) == digests(one_node)
    records = manifest_json(cache)["shards"].values()
    assert {r["layout"]["dp"] for r in records} == {2}


@needs_s3
def test_two_node_extract_equals_one_node_in_a_bucket(data, one_node, tmp_path):
    server = MotoServer()
    try:
        bucket = server.new_bucket()
        results = two_nodes("extract", "--cache", f"s3://{bucket}/hs", "--data", str(data), "--num-shards", str(SHARDS),
                            "--json", env=server.env())
        assert all(r.returncode == 0 for r in results), failures(results)
        copied = download(server.client(), bucket, "hs/", tmp_path / "copied")
    finally:
        server.stop()
    assert digests(copied) == digests(one_node)


def read_log(run) -> list[dict]:
    return [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines()]


def export_bytes(run) -> dict[str, bytes]:
    return {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted((run / "drafter").rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def two_node_run(one_node, tmp_path_factory):
    run = tmp_path_factory.mktemp("two-nodes") / "run"
    results = two_nodes("train", "--cache", str(one_node), "--out", str(run), *TRAIN)
    assert all(r.returncode == 0 for r in results), failures(results)
    return run


def test_two_nodes_train_as_one_node_with_two_processes(one_node, two_node_run, tmp_path):
    run = tmp_path / "one-node"
    result = torchrun(2, "train", "--cache", str(one_node), "--out", str(run), *TRAIN)
    assert result.returncode == 0, result.stderr[-3000:]
    for x, y in zip(read_log(run), read_log(two_node_run), strict=True):
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5), x["step"]
    assert export_bytes(run) == export_bytes(two_node_run)


def test_a_killed_worker_is_restarted_and_resumes_to_the_same_bytes(one_node, two_node_run, tmp_path):
    """Rank 0 dies by SIGKILL right after its step-4 checkpoint; torchrun (`--max-restarts 1`)
    restarts the group on both nodes, the run resumes from that checkpoint and ends byte-identical.
    The launchers run with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as the README says: with torch's
    shared rendezvous store a restarted worker read its peer's previous address and hung or failed
    in 3 of 7 trials (BENCHMARKS.md)."""
    run = tmp_path / "run"
    env = {"PIPELINE_FAILPOINT": "checkpoint.renamed@1:once", "PIPELINE_FAILPOINT_MARKER": str(tmp_path / "killed-once"),
           SHARED_STORE_OPT_OUT: "1"}
    results = two_nodes("train", "--cache", str(one_node), "--out", str(run), *TRAIN, env=env, max_restarts=1,
                        timeout=300)
    assert (tmp_path / "killed-once").exists(), "the failpoint never fired"
    assert all(r.returncode == 0 for r in results), failures(results)
    assert json.loads((run / "run.json").read_text())["resumed_from_step"] == 4
    assert export_bytes(run) == export_bytes(two_node_run)
    whole = {row["step"]: row["loss"] for row in read_log(two_node_run)}
    assert {row["step"]: row["loss"] for row in read_log(run)} == whole


@pytest.mark.parametrize("env, warned", [
    ({"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}, True),
    ({"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_USE_AGENT_STORE": "True", SHARED_STORE_OPT_OUT: "1"}, False),
    ({"TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"}, False),
    ({}, False),
])
def test_restarts_with_the_shared_rendezvous_store_are_warned_about(monkeypatch, env, warned):
    for key in ("TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", SHARED_STORE_OPT_OUT):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    hazard = elastic_restart_hazard()
    assert (hazard is not None) == warned
    if warned:
        assert f"{SHARED_STORE_OPT_OUT}=1" in hazard
