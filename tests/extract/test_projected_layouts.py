"""A projected cache (`extract --project-taps R`) has one basis however it is written: by one
process, by two data-parallel processes under torchrun (rank 0 fits, the other waits and reads
the stored basis: the same bytes as one process), by tensor parallelism (the same rows up to the
sharded matmuls' rounding), and by two launchers started at once on the same cache (one basis
stored, every shard naming its digest)."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from harness.caches import assert_same_content, manifest_json
from harness.runs import REPO, cli_here, stopped, torchrun, write_rows
from pipeline.cache.reader import open_cache
from pipeline.projection.basis_file import cache_basis

PROJECT = ["--project-taps", "40", "--pilot-tokens", "1500"]


@pytest.fixture(scope="module")
def data(tmp_path_factory, train_rows):
    return write_rows(tmp_path_factory.mktemp("data") / "convs.jsonl", train_rows[:24])


def extract_args(cache, data, *extra):
    return ("extract", "--cache", str(cache), "--data", str(data), "--num-shards", "4", "--batch-tokens", "256",
            *PROJECT, "--json", *extra)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    cache = tmp_path_factory.mktemp("ref") / "cache"
    result = cli_here(*extract_args(cache, data))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["projection"]["basis"] == "fitted"
    return cache


def basis_digest_everywhere(cache) -> str:
    """The basis file's digest as the manifest and every shard record name it (one value)."""
    manifest = manifest_json(cache)
    digest = manifest["config"]["capture"]["projection"]["digest"]
    assert {rec["identity"]["projection_digest"] for rec in manifest["shards"].values()} == {digest}
    assert len(manifest["shards"]) == 4
    return digest


def reconstructed(cache) -> dict[int, np.ndarray]:
    """Each sample's taps as its rows stand for them (P^T s z), float64."""
    reader = open_cache(cache)
    basis = cache_basis(reader)
    out = {}
    for name in reader.shards:
        shard = reader.shard(name)
        for sid in map(int, shard.sample_ids):
            out[sid] = basis.reconstruct(shard.hidden(sid).float(), 3).double().numpy()
    return out


def test_two_data_parallel_processes_write_the_one_process_cache(tmp_path, data, reference):
    cache = tmp_path / "dp2"
    result = torchrun(2, *extract_args(cache, data))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (cache / "basis.safetensors").read_bytes() == (reference / "basis.safetensors").read_bytes()
    assert basis_digest_everywhere(cache) == basis_digest_everywhere(reference)
    assert_same_content(cache, reference)


def test_tensor_parallel_2_stores_the_same_rows_up_to_rounding(tmp_path, data, reference):
    cache = tmp_path / "tp2"
    result = torchrun(2, *extract_args(cache, data, "--tp", "2"))
    assert result.returncode == 0, result.stderr[-3000:]
    basis_digest_everywhere(cache)
    mine, theirs = reconstructed(cache), reconstructed(reference)
    assert sorted(mine) == sorted(theirs)
    for sid in mine:
        scale = np.abs(theirs[sid]).max()
        np.testing.assert_allclose(mine[sid], theirs[sid], atol=0.03 * scale, err_msg=f"sample {sid}")


def test_two_launchers_at_once_store_one_basis(tmp_path, data):
    cache = tmp_path / "two"
    launchers = [launch(cache, data, "--shards", shards) for shards in ("0-1", "2-3")]
    for p in launchers:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    digest = basis_digest_everywhere(cache)
    assert cache_basis(open_cache(cache)).digest() == digest


def launch(cache, data, *extra, env=None):
    return subprocess.Popen([sys.executable, "-m", "cli", *extract_args(cache, data, *extra)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def stored_basis_digest(cache) -> str:
    from pipeline.cache.address import open_location
    from pipeline.projection.basis_file import read_basis
    return read_basis(open_location(str(cache))).digest()


def test_a_start_killed_between_the_basis_and_the_manifest_resumes_with_the_stored_basis(tmp_path, data):
    """Issue 77.1: extract stores basis.safetensors before manifest.json; a kill -9 in between
    left a location the same command refused as "not a cache". The rerun goes on with the
    stored basis; another R, or whole taps, is one line."""
    cache = tmp_path / "cache"
    killed = launch(cache, data, env={"PIPELINE_FAILPOINT": "pilot.basis@1"})
    _, err = killed.communicate(timeout=600)
    assert killed.returncode == -signal.SIGKILL, err[-2000:]
    assert (cache / "basis.safetensors").is_file() and not (cache / "manifest.json").exists()
    left = stored_basis_digest(cache)

    other_rank = cli_here("extract", "--cache", str(cache), "--data", str(data), "--num-shards", "4",
                          "--project-taps", "20", "--pilot-tokens", "1500")
    assert other_rank.returncode == 1 and "projects" in other_rank.stderr and "--project-taps 20" in other_rank.stderr
    whole = cli_here("extract", "--cache", str(cache), "--data", str(data), "--num-shards", "4")
    lines = [line for line in whole.stderr.splitlines() if line.startswith("error:")]
    assert whole.returncode == 1 and len(lines) == 1 and "basis.safetensors" in lines[0], whole.stderr
    assert "--project-taps" in lines[0] and "Traceback" not in whole.stderr
    assert not (cache / "manifest.json").exists()

    rerun = cli_here(*extract_args(cache, data))
    assert rerun.returncode == 0, rerun.stderr
    assert json.loads(rerun.stdout)["projection"]["basis"] == "read from the cache"
    assert basis_digest_everywhere(cache) == left == stored_basis_digest(cache)


def test_a_launcher_started_after_the_basis_exists_uses_it(tmp_path, data):
    """Issue 77.1: launcher A is frozen right after storing the basis (before its manifest);
    launcher B, started then on the other shards, reads that basis and completes; A goes on."""
    cache = tmp_path / "cache"
    a = launch(cache, data, "--shards", "0-1", env={"PIPELINE_FAILPOINT": "pilot.basis@1:stop"})
    try:
        deadline = time.monotonic() + 600
        while not (cache / "basis.safetensors").is_file() or not stopped(a.pid):
            assert a.poll() is None, a.communicate()[1][-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert not (cache / "manifest.json").exists()
        b = cli_here(*extract_args(cache, data, "--shards", "2-3"))
        assert b.returncode == 0, b.stderr
        assert json.loads(b.stdout)["projection"]["basis"] == "read from the cache"
    finally:
        os.kill(a.pid, signal.SIGCONT)
    _, err = a.communicate(timeout=600)
    assert a.returncode == 0, err[-3000:]
    assert basis_digest_everywhere(cache) == stored_basis_digest(cache)


def test_a_pilot_failing_on_rank_0_ends_every_rank_within_seconds(tmp_path, data):
    """Issue 77.5. Two nodes (two torchrun launchers, one process each, gloo): rank 0 runs the
    pilot's forwards alone and fails there (an error it does not expect, as CUDA's out of memory).
    Rank 1, waiting for the basis, must not wait out NCCL's watchdog (10 minutes), nor end on gloo's
    broken connection with a page of C++ frames (what it did before): it stops within seconds, with
    one line naming rank 0's failure.
    Nothing of a cache is left looking complete."""
    from harness.runs import two_nodes

    cache = tmp_path / "cache"
    start = time.perf_counter()
    results = two_nodes(*extract_args(cache, data), env={"PIPELINE_FAILPOINT": "pilot.forward@1:raise"}, timeout=240)
    seconds = time.perf_counter() - start
    print(f"both launchers ended {seconds:.1f} s after they started")
    assert [r.returncode for r in results] == [1, 1], [r.stderr[-2000:] for r in results]
    assert "failpoint pilot.forward: a planted failure" in results[0].stderr  # rank 0: its own traceback
    said = [x for x in results[1].stderr.splitlines() if x.startswith("error:")]
    assert said == ["error: rank 0 failed while running the pilot and fitting the tap basis (RuntimeError: failpoint "
                    "pilot.forward: a planted failure)"], results[1].stderr[-3000:]
    assert not (cache / "manifest.json").exists() and not (cache / "basis.safetensors").exists()
