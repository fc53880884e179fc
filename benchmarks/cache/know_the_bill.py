"""Know the bill (issue 39): `extract --dry-run` against real extractions, at the flagship shape,
and `pipeline cache-info` on a directory and a bucket.

    python benchmarks/cache/know_the_bill.py [--rows 100000]     # prints one JSON document

1. The embedded target, 240 training conversations in 4 shards, bf16 and fp8: the dry run's
   tokens, files and raw bytes against what `pipeline extract` then writes; the stored-bytes
   estimate at the default (1.0, an upper bound) and with the compression ratio that cache-info
   reports for a pilot extraction of shard 0 alone.
2. A Qwen3.6-27B-shaped target directory (config.json and the real Qwen3.6 tokenizer and chat
   template from the shared fixtures; no weights: the dry run reads none): hidden 5,120, 64
   layers, vocab 248,320, the default 5 taps; `--rows` conversations made from the embedded
   training set (each row a different one of its 1,000, cycled, with its row number in the user
   turn so no two rows are equal), 64 shards; the dry run's wall time and bill.
3. cache-info on the embedded bf16 cache in a directory and the same files in a bucket of moto's
   S3 server on 127.0.0.1 (needs the [test] extra): wall time and requests, counted by the client
   and by a relay in front of the server.

Each figure is one run on this machine; the commands are real CLI subprocesses.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO.parent / "shared" / "fixtures"


def pipeline(*args: str, env: dict | None = None) -> dict:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "cli", *args, "--json"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise SystemExit(f"pipeline {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout)
    out["_wall_s"] = time.perf_counter() - start
    return out


def embedded_rows(n: int) -> list[dict]:
    from pipeline.embedded import TRAIN_DATA
    rows = [json.loads(line) for line in TRAIN_DATA.read_text().splitlines()]
    out = []
    for i in range(n):
        row = json.loads(json.dumps(rows[i % len(rows)]))
        first_user = next(m for m in row["messages"] if m["role"] == "user")
        first_user["content"] = f"[{i}] {first_user['content']}"
        out.append({"messages": row["messages"]})
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def embedded_bills(work: Path) -> dict:
    from pipeline.embedded import TRAIN_DATA
    data = write_jsonl(work / "embedded.jsonl", [json.loads(x) for x in TRAIN_DATA.read_text().splitlines()[:240]])
    results = {}
    for fmt in ("bf16", "fp8"):
        cache = work / f"cache-{fmt}"
        common = ["--data", str(data), "--cache", str(cache), "--num-shards", "4", "--hidden-format", fmt]
        bill = pipeline("extract", "--dry-run", *common)
        pipeline("extract", *common, "--shards", "0")
        ratio = pipeline("cache-info", str(cache))["bytes"]["stored_vs_raw"]
        calibrated = pipeline("extract", "--dry-run", *common, "--assume-compression", str(ratio))
        real = pipeline("extract", *common)
        info = pipeline("cache-info", str(cache))
        results[fmt] = {
            "tokens": (bill["tokens"], info["counts"]["tokens"]), "files": (bill["files"], info["bytes"]["files"]),
            "raw_bytes": (bill["raw_bytes"], info["bytes"]["raw"]),
            "stored_estimate_upper_bound": bill["stored_bytes"], "pilot_ratio": ratio,
            "stored_estimate_with_pilot_ratio": calibrated["stored_bytes"], "stored_real": info["bytes"]["stored"],
            "error_with_pilot_ratio": calibrated["stored_bytes"] / info["bytes"]["stored"] - 1,
            "real_extract_wall_s": real["_wall_s"], "dry_run_wall_s": bill["_wall_s"]}
    return results


def flagship_shaped_target(out: Path) -> Path | None:
    """config.json of Qwen3.6-27B's text shape + the real tokenizer and template; no weights."""
    tokenizer, template = FIXTURES / "tokenizers" / "qwen3.6", FIXTURES / "chat_templates" / "qwen3.6.jinja"
    if not tokenizer.is_dir() or not template.is_file():
        return None
    from transformers import AutoTokenizer

    from pipeline.toy.model import tiny_config
    tok = AutoTokenizer.from_pretrained(tokenizer)
    config = tiny_config(vocab_size=248320, eos_id=tok.convert_tokens_to_ids("<|im_end|>"),
                         pad_id=tok.convert_tokens_to_ids("<|endoftext|>")).to_dict()
    config.update(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
                  num_key_value_heads=4, head_dim=256,
                  layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in tokenizer.iterdir():
        shutil.copy(f, out / f.name)
    shutil.copy(template, out / "chat_template.jinja")
    return out


def flagship_bill(work: Path, rows: int) -> dict | None:
    target = flagship_shaped_target(work / "qwen3.6-27b-shaped")
    if target is None:
        return None
    data = write_jsonl(work / "rows.jsonl", embedded_rows(rows))
    bill = pipeline("extract", "--dry-run", "--target", str(target), "--data", str(data), "--cache", str(work / "never"),
                    "--num-shards", "64", "--assume-tokens-per-s", "20000")
    keep = ("taps", "hidden_size", "vocab_size", "rows", "valid_rows", "tokens", "supervised_tokens", "samples_per_shard",
            "raw_bytes_per_token", "raw_bytes", "files", "files_per_shard", "extract_seconds", "dry_run_seconds", "_wall_s")
    return {k: bill[k] for k in keep}


def cache_info_reads(work: Path) -> dict:
    cache = work / "cache-bf16"
    local = pipeline("cache-info", str(cache))
    out = {"directory": {"wall_s": local["_wall_s"], "in_process_s": local["read"]["seconds"],
                         "records": local["read"]["records"]}}
    sys.path.insert(0, str(REPO))
    from harness.s3_server import ForgetfulRelay, MotoServer, boto3
    if boto3 is None:  # without the [test] extra's S3 server: the directory only
        return out
    server = MotoServer()
    relay = ForgetfulRelay(server.port, drop=())
    try:
        bucket = server.new_bucket()
        client = server.client()
        for path in sorted(p for p in cache.rglob("*") if p.is_file()):
            client.put_object(Bucket=bucket, Key=f"hs/{path.relative_to(cache).as_posix()}", Body=path.read_bytes())
        remote = pipeline("cache-info", f"s3://{bucket}/hs", env=server.env(relay.endpoint))
    finally:
        relay.stop()
        server.stop()
    out["bucket"] = {"wall_s": remote["_wall_s"], "in_process_s": remote["read"]["seconds"],
                     "requests_counted_by_client": remote["read"]["requests"],
                     "requests_seen_by_relay": len(relay.requests), "records": remote["read"]["records"],
                     "same_summary_as_directory": all(remote[k] == local[k] for k in
                                                      ("identity", "completeness", "provenance", "counts", "bytes"))}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000, help="rows of the flagship-shaped dry run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        result = {"embedded": embedded_bills(work), "flagship_shaped": flagship_bill(work, args.rows),
                  "cache_info": cache_info_reads(work)}
    print(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
