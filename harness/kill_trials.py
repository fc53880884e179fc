"""Kill -9 trials of `pipeline extract`, driven from one process so that CI can afford many.

The driver imports the pipeline once and runs no torch work itself; every extraction (the
uninterrupted reference, each killed run, each resume) is a forked child running the real
`run_extract` on a real cache, ended by a real SIGKILL: either from a failpoint at an exact
phase (pipeline/faults.py) or from the driver after a random delay. Forking saves the ~3 s of
imports a fresh interpreter pays, which is what makes 20+ trials fit in CI.

    python -m harness.kill_trials PLAN.json   ->  JSON results on stdout   (from the repository root)

`run_trials` runs that driver in a new process; `checked_trials` (the fault and object-store
tests) also asserts what every trial must show.

PLAN: {"root", "data", "num_shards", "batch_tokens", "seed", "per_failpoint", "timed"}, and
optionally "s3": {"endpoint", "bucket"} (credentials from the environment): each trial's cache is
then s3://BUCKET/trial-NN, and what a reader would see is judged on a fresh copy of the prefix
read with boto3 (an independent client) into ROOT/trial-NN.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness.caches import assert_same_content, manifest_json, shard_digest
from harness.runs import REPO

PHASES = ("extract.batch", "extract.encoded", "writer.chunk", "writer.fsynced", "writer.committed")
SHARDS, BATCH_TOKENS = 3, 256
CHILD_TIMEOUT_S = 300  # an extraction child still running after this is killed and reported "timeout"
# Small files, so that kills land between the file writes of a shard, not only at its commit.
SMALL_FILES = {"hidden_chunk_bytes": 8192, "hidden_chunks_per_file": 4, "small_chunk_tokens": 256,
               "small_chunks_per_file": 4}


def run_trials(plan: dict, plan_path: Path, env: dict | None = None, timeout: float | None = 900) -> dict:
    """Write `plan` to `plan_path` and run the driver on it in a new process: its JSON report, or
    RuntimeError with the end of its stderr."""
    plan_path.write_text(json.dumps(plan))
    result = subprocess.run([sys.executable, "-m", "harness.kill_trials", str(plan_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **(env or {}), "OMP_NUM_THREADS": "1", "PIPELINE_FAILPOINT": ""})
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout)


def checked_trials(tmp_path: Path, data, reference: Path, *, per_failpoint: int, timed: int, s3: dict | None = None,
                   env: dict | None = None) -> list[dict]:
    """SHARDS shards of BATCH_TOKENS-token batches of `data`, killed per_failpoint times at random
    hits of each failpoint and `timed` times after a random delay, each resumed; asserts that
    nothing partial ever looks committed, every resume completes exactly the missing shards, and
    the content equals `reference`'s (an uninterrupted run). Returns the trials aimed at failpoints."""
    from stages.verify_cache.options import VerifyOptions
    from stages.verify_cache.run import run_verify

    plan = {"root": str(tmp_path), "data": str(data), "num_shards": SHARDS, "batch_tokens": BATCH_TOKENS,
            "seed": 9, "per_failpoint": per_failpoint, "timed": timed, **({"s3": s3} if s3 else {}),
            "chunking": SMALL_FILES}
    trials = run_trials(plan, tmp_path / "plan.json", env)["trials"]
    aimed = [t for t in trials if "failpoint" in t]
    assert len(aimed) == per_failpoint * len(PHASES) and all(t["run"] == "killed" for t in aimed), [t["run"] for t in aimed]
    assert {t["failpoint"].split("@")[0] for t in aimed} == set(PHASES)
    assert sum(t["run"] == "killed" for t in trials) >= len(aimed) + (1 if timed else 0)
    for t in trials:
        after = t["after_kill"]
        assert after["listed_intact"], t  # never a partial shard listed as committed
        assert t["resume"] == "ok", t
        assert t["resumed_shards_written"] == SHARDS - len(after["listed"]), t
        done = t["after_resume"]
        assert len(done["listed"]) == SHARDS and done["listed_intact"], t
        assert not done["partial"], t
        cache = tmp_path / os.path.basename(t["cache"])
        assert_same_content(cache, reference)
        assert run_verify(VerifyOptions(cache=cache, tail_rate=0))["passed"], t  # content is already compared exactly above
    return aimed


def child(cache: Path | str, plan: dict, *, failpoint: str = "", writer_queue: int = 0, hits_file: Path | None = None,
          summary_file: Path | None = None) -> int:
    """Fork a child that extracts into `cache`; returns its pid. The child never returns."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        from pipeline import faults
        from pipeline.config import ExtractConfig
        from stages.extract.run import run_extract

        os.environ[faults.ENV] = failpoint
        cfg = ExtractConfig(cache=str(cache), data=[plan["data"]], num_shards=plan["num_shards"],
                            batch_tokens=plan["batch_tokens"], writer_queue=writer_queue,
                            chunking=plan.get("chunking", {}))
        summary = run_extract(cfg, None, progress=False)
        if hits_file is not None:
            hits_file.write_text(json.dumps(dict(faults.HITS)))
        if summary_file is not None:
            summary_file.write_text(json.dumps(summary))
        code = 0
    except BaseException as e:  # noqa: BLE001 - reported through the exit code and stderr
        print(f"child {os.getpid()}: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
        os._exit(code)


def poll(pid: int, deadline: float) -> str | None:
    """None while the child runs; then 'ok' | 'failed' | 'killed' | 'signal N' | 'timeout' (killed
    by the driver at `deadline`)."""
    done, status = os.waitpid(pid, os.WNOHANG)
    if not done:
        if time.time() <= deadline:
            return None
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return "timeout"
    if os.WIFSIGNALED(status):
        return "killed" if os.WTERMSIG(status) == signal.SIGKILL else f"signal {os.WTERMSIG(status)}"
    return "ok" if os.WEXITSTATUS(status) == 0 else "failed"


def wait(pid: int, timeout: float = CHILD_TIMEOUT_S) -> str:
    """poll() until the child ends."""
    deadline = time.time() + timeout
    while (status := poll(pid, deadline)) is None:
        time.sleep(0.005)
    return status


def inspect(cache: Path) -> dict:
    """What a reader would see right after the kill: committed shards (by the protocol's rule,
    read without the tool's parser) must be whole, byte for byte; any other shard directory is a
    partial write that no reader sees."""
    listed = manifest_json(cache)["shards"] if (cache / "manifest.json").exists() else {}
    intact = all(shard_digest(cache / name) == rec["digest"] for name, rec in listed.items())
    dirs = sorted(p.name for p in cache.glob("shard-*") if p.is_dir()) if cache.exists() else []
    return {"listed": sorted(listed), "listed_intact": intact, "partial": [d for d in dirs if d not in listed]}


def main(plan_path: str) -> None:
    # Imported here, before any fork, so that no child pays for them (transformers imports the
    # model and tokenizer modules lazily, ~3 s).
    import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import stages.extract.run  # noqa: F401

    plan = json.loads(Path(plan_path).read_text())
    root = Path(plan["root"])
    start = time.perf_counter()
    hits_file = root / "reference-hits.json"
    status = wait(child(root / "reference", plan, hits_file=hits_file))
    assert status == "ok", f"reference run: {status}"
    reference_seconds = time.perf_counter() - start
    hits = json.loads(hits_file.read_text())
    rng = random.Random(plan["seed"])
    trials = []
    for phase in PHASES:
        for _ in range(plan["per_failpoint"]):
            trials.append({"failpoint": f"{phase}@{rng.randint(1, hits[phase])}"})
    for _ in range(plan["timed"]):
        trials.append({"kill_after_s": round(rng.uniform(0.1, 1.0) * reference_seconds, 3)})
    bucket = plan.get("s3", {}).get("bucket")

    def look(i: int) -> Path:
        view = root / f"trial-{i:02d}"
        if bucket:
            import shutil

            import boto3

            from harness.s3_server import download

            shutil.rmtree(view, ignore_errors=True)
            view.mkdir()
            download(boto3.client("s3", endpoint_url=plan["s3"]["endpoint"]), bucket, f"trial-{i:02d}/", view)
        return view

    def cache_of(i: int) -> Path | str:
        return f"s3://{bucket}/trial-{i:02d}" if bucket else root / f"trial-{i:02d}"

    # Trials run two at a time (each has its own cache; within a trial the kill, the look, the
    # resume and the look stay in order): the driver mostly waits, the children take a core each.
    pending = list(range(len(trials)))
    running: dict[int, tuple[int, str, float, float | None]] = {}  # pid -> (trial, stage, deadline, kill at)
    parallel = max(1, min(2, os.cpu_count() or 1))
    while pending or running:
        while pending and len(running) < parallel:
            i = pending.pop(0)
            trial = trials[i]
            trial["writer_queue"] = i % 2 * 2  # alternate the inline writer and the background thread
            trial["cache"] = str(look(i) if bucket else cache_of(i))
            pid = child(cache_of(i), plan, failpoint=trial.get("failpoint", ""), writer_queue=trial["writer_queue"])
            kill_at = time.time() + trial["kill_after_s"] if "kill_after_s" in trial else None
            running[pid] = (i, "run", time.time() + CHILD_TIMEOUT_S, kill_at)
        for pid, (i, stage, deadline, kill_at) in list(running.items()):
            if kill_at is not None and time.time() >= kill_at:
                os.kill(pid, signal.SIGKILL)  # a child that has just ended is a zombie until polled: no error
                running[pid] = (i, stage, deadline, None)
            status = poll(pid, deadline)
            if status is None:
                continue
            del running[pid]
            trial = trials[i]
            if stage == "run":
                trial["run"] = status
                trial["after_kill"] = inspect(look(i))
                resume = child(cache_of(i), plan, summary_file=root / f"resume-{i:02d}.json")
                running[resume] = (i, "resume", time.time() + CHILD_TIMEOUT_S, None)
            else:
                trial["resume"] = status
                if status == "ok":
                    summary = json.loads((root / f"resume-{i:02d}.json").read_text())
                    trial["resumed_shards_written"] = summary["shards_written"]
                trial["after_resume"] = inspect(look(i))
        time.sleep(0.005)
    print(json.dumps({"reference": str(root / "reference"), "hits": hits, "reference_seconds": reference_seconds,
                      "trials": trials, "seconds": time.perf_counter() - start}))


if __name__ == "__main__":
    main(sys.argv[1])
