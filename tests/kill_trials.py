"""Kill -9 trials of `pipeline extract`, driven from one process so that CI can afford many.

The driver imports the pipeline once and runs no torch work itself; every extraction (the
uninterrupted reference, each killed run, each resume) is a forked child running the real
`run_extract` on a real cache, ended by a real SIGKILL: either from a failpoint at an exact
phase (pipeline/faults.py) or from the driver after a random delay. Forking saves the ~3 s of
imports a fresh interpreter pays, which is what makes 20+ trials fit in CI.

    python tests/kill_trials.py PLAN.json   ->  JSON results on stdout

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
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Imported here, before any fork, so that no child pays for them (transformers imports the
# model and tokenizer modules lazily, ~3 s).
import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: E402, F401
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402, F401

from pipeline import faults  # noqa: E402
from extract_helpers import manifest_json, shard_digest  # noqa: E402
from pipeline.config import ExtractConfig  # noqa: E402
from stages.extract import run_extract  # noqa: E402

PHASES = ("extract.batch", "extract.encoded", "writer.chunk", "writer.fsynced", "writer.committed")


def child(cache: Path | str, plan: dict, *, failpoint: str = "", writer_queue: int = 0, hits_file: Path | None = None,
          summary_file: Path | None = None) -> int:
    """Fork a child that extracts into `cache`; returns its pid. The child never returns."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
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


def wait(pid: int, timeout: float = 300) -> str:
    """'ok' | 'failed' | 'killed' | 'signal N'."""
    deadline = time.time() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.time() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.005)
    if os.WIFSIGNALED(status):
        return "killed" if os.WTERMSIG(status) == signal.SIGKILL else f"signal {os.WTERMSIG(status)}"
    return "ok" if os.WEXITSTATUS(status) == 0 else "failed"


def inspect(cache: Path) -> dict:
    """What a reader would see right after the kill: committed shards (by the protocol's rule,
    read without the tool's parser) must be whole, byte for byte; any other shard directory is a
    partial write that no reader sees."""
    listed = manifest_json(cache)["shards"] if (cache / "manifest.json").exists() else {}
    intact = all(shard_digest(cache / name) == rec["digest"] for name, rec in listed.items())
    dirs = sorted(p.name for p in cache.glob("shard-*") if p.is_dir()) if cache.exists() else []
    return {"listed": sorted(listed), "listed_intact": intact, "partial": [d for d in dirs if d not in listed]}


def main(plan_path: str) -> None:
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
            from s3_helpers import download
            shutil.rmtree(view, ignore_errors=True)
            view.mkdir()
            download(boto3.client("s3", endpoint_url=plan["s3"]["endpoint"]), bucket, f"trial-{i:02d}/", view)
        return view

    for i, trial in enumerate(trials):
        trial["writer_queue"] = i % 2 * 2  # alternate the inline writer and the background thread
        cache = f"s3://{bucket}/trial-{i:02d}" if bucket else root / f"trial-{i:02d}"
        trial["cache"] = str(look(i) if bucket else cache)
        pid = child(cache, plan, failpoint=trial.get("failpoint", ""), writer_queue=trial["writer_queue"])
        if "kill_after_s" in trial:
            time.sleep(trial["kill_after_s"])
            os.kill(pid, signal.SIGKILL)
        trial["run"] = wait(pid)
        trial["after_kill"] = inspect(look(i))
        summary_file = root / f"resume-{i:02d}.json"
        trial["resume"] = wait(child(cache, plan, summary_file=summary_file))
        if trial["resume"] == "ok":
            summary = json.loads(summary_file.read_text())
            trial["resumed_shards_written"] = summary["shards_written"]
        trial["after_resume"] = inspect(look(i))
    print(json.dumps({"reference": str(root / "reference"), "hits": hits, "reference_seconds": reference_seconds,
                      "trials": trials, "seconds": time.perf_counter() - start}))


if __name__ == "__main__":
    main(sys.argv[1])
