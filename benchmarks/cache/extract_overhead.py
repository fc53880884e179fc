"""Extraction overhead and storage, measured side by side in one run.

    python benchmarks/cache/extract_overhead.py [--hidden 512] [--tokens 24576] [--json]

1. Overhead: a randomly initialised Qwen3_5ForCausalLM big enough that one forward batch takes
   well over 50 ms here, fed pre-tokenized rows. The bare forward runs `model(input_ids,
   output_hidden_states=True)` over exactly the batches extract forms (same length sorting,
   same padding); extract runs the whole stage (read, forward, top-k/logsumexp, encode,
   compress, checksum, write, commit). Rounds alternate bare/extract so drift hits both.
   Reported: extract tokens/s in the shard loop (model load and dataset scan excluded; they
   are reported separately) divided by bare tokens/s.
2. Storage: the embedded tiny target over its 1,000 training conversations, bf16 and fp8:
   stored bytes per token, the hidden array against raw bf16, and the top-k share.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.config import ExtractConfig  # noqa: E402
from pipeline.embedded import TARGET_DIR  # noqa: E402
from pipeline.timing_machine import describe_machine  # noqa: E402
from pipeline.cache.shard_plan import shard_rows  # noqa: E402
from pipeline.data.samples import length_batches  # noqa: E402
from stages.extract.run import run_extract  # noqa: E402


def build_target(out: Path, hidden: int, layers: int) -> Path:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig.from_pretrained(TARGET_DIR)
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = hidden, hidden * 3, layers
    config.layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    config.head_dim = 64
    config.linear_key_head_dim = config.linear_value_head_dim = 64
    config.linear_num_key_heads, config.linear_num_value_heads = 4, 8
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TARGET_DIR / name, out / name)
    return out


def pretokenized_rows(path: Path, num_tokens: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    rows, total = [], 0
    while total < num_tokens:
        n = rng.randint(192, 512)
        rows.append([rng.randrange(vocab) for _ in range(n)])
        total += n
    with open(path, "w") as f:
        for ids in rows:
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 8 + [1] * (len(ids) - 8)}) + "\n")
    return rows


def extract_batches(rows: list[list[int]], num_shards: int, batch_tokens: int) -> list[list]:
    """Exactly the batches extract forms: per shard, length-sorted, under the token budget."""
    batches = []
    for shard in range(num_shards):
        samples = [(i, rows[i], None) for i in shard_rows(shard, len(rows), num_shards)]
        batches += length_batches(samples, batch_tokens)
    return batches


@torch.no_grad()
def bare_forward(target: Path, rows: list[list[int]], batch_tokens: int, num_shards: int) -> dict:
    from transformers import AutoModelForCausalLM

    # The device and dtype extract picks by default: bf16 on a GPU, float32 on the CPU.
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, use_kernels=False).to(device).eval()
    batches = extract_batches(rows, num_shards, batch_tokens)
    times, tokens = [], 0
    start = time.perf_counter()
    for batch in batches:
        width = max(len(s[1]) for s in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        for r, s in enumerate(batch):
            ids[r, :len(s[1])] = torch.tensor(s[1])
        t0 = time.perf_counter()
        model(input_ids=ids.to(device), output_hidden_states=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        tokens += sum(len(s[1]) for s in batch)
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "batches": len(batches),
            "median_batch_ms": 1000 * statistics.median(times)}


def extract_once(target: Path, data: Path, cache: Path, batch_tokens: int, num_shards: int, **kw) -> dict:
    if cache.exists():
        shutil.rmtree(cache)
    cfg = ExtractConfig(target=str(target), data=[str(data)], cache=str(cache), num_shards=num_shards,
                        batch_tokens=batch_tokens, **kw)
    return run_extract(cfg, None, progress=False)


def num_parameters(target: Path) -> int:
    import math

    from safetensors import safe_open
    with safe_open(str(target / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def hidden_share(cache: Path) -> tuple[int, int]:
    """(stored bytes of the hidden arrays, stored bytes of the top-k arrays)."""
    hidden = sum(p.stat().st_size for p in cache.glob("shard-*/hidden*/**/*") if p.is_file())
    topk = sum(p.stat().st_size for p in cache.glob("shard-*/target_topk*/**/*") if p.is_file())
    return hidden, topk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512, help="hidden size of the random target (default %(default)s)")
    parser.add_argument("--layers", type=int, default=8,
                        help="decoder layers of the random target, at least 8 for its 5 taps (default %(default)s)")
    parser.add_argument("--tokens", type=int, default=24576,
                        help="tokens of pre-tokenized rows for the overhead part (default %(default)s)")
    parser.add_argument("--batch-tokens", type=int, default=2048,
                        help="forward batch budget in tokens, padding included (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="bare/extract rounds; medians are reported (default %(default)s)")
    parser.add_argument("--num-shards", type=int, default=4,
                        help="shards of the overhead part's extraction (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="no effect: the result is always printed as JSON")
    args = parser.parse_args()
    # Bad values end here in one line, not in a traceback after the target is built.
    for name in ("hidden", "tokens", "batch_tokens", "rounds", "num_shards"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.layers < 8:  # extract taps default_taps(layers, 5): five distinct layers below the last need 8
        parser.error(f"--layers must be at least 8 (extract taps 5 layers below the last), got {args.layers}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    work = Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    try:
        target = build_target(work / "target", args.hidden, args.layers)
        data = work / "rows.jsonl"
        rows = pretokenized_rows(data, args.tokens, 500)
        bare_runs, extract_runs, background_runs = [], [], []
        for _ in range(args.rounds):
            bare_runs.append(bare_forward(target, rows, args.batch_tokens, args.num_shards))
            extract_runs.append(extract_once(target, data, work / "cache", args.batch_tokens, args.num_shards))
            background_runs.append(extract_once(target, data, work / "cache", args.batch_tokens, args.num_shards,
                                                writer_queue=4))
        bare_tps = statistics.median(r["tokens_per_s"] for r in bare_runs)
        ext_tps = statistics.median(r["stream_tokens_per_s"] for r in extract_runs)
        bg_tps = statistics.median(r["stream_tokens_per_s"] for r in background_runs)
        overhead = {
            "target": {"hidden": args.hidden, "layers": args.layers, "parameters": num_parameters(target)},
            "tokens": bare_runs[0]["tokens"], "batches": bare_runs[0]["batches"],
            "median_bare_batch_ms": statistics.median(r["median_batch_ms"] for r in bare_runs),
            "bare_tokens_per_s": [round(r["tokens_per_s"], 1) for r in bare_runs],
            "extract_stream_tokens_per_s": [round(r["stream_tokens_per_s"], 1) for r in extract_runs],
            "extract_setup_seconds": [round(r["setup_seconds"], 2) for r in extract_runs],
            "writer_default": extract_runs[0]["writer"],
            "ratio_extract_over_bare": ext_tps / bare_tps,
            "extract_background_writer_tokens_per_s": [round(r["stream_tokens_per_s"], 1) for r in background_runs],
            "ratio_background_writer_over_bare": bg_tps / bare_tps,
        }
        storage = {}
        for fmt in ("bf16", "fp8"):
            cache = work / f"tiny-{fmt}"
            s = extract_once("embedded", "embedded:train", cache, 8192, 8, hidden_format=fmt)
            hidden_bytes, topk_bytes = hidden_share(cache)
            tokens = s["tokens"]
            storage[fmt] = {
                "tokens": tokens,
                "bytes_per_token": s["bytes_per_token"],
                "hidden_bytes_per_token": hidden_bytes / tokens,
                "raw_bf16_hidden_bytes_per_token": s["raw_bf16_hidden_bytes_per_token"],
                "hidden_vs_raw_bf16": s["raw_bf16_hidden_bytes_per_token"] / (hidden_bytes / tokens),
                "topk_share_of_stored": topk_bytes / s["stored_bytes"],
            }
        result = {"overhead": overhead, "storage": storage, "machine": describe_machine()}
        print(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
