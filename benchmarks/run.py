"""The benchmark suite: every figure a ratio measured side by side in one run.

    python benchmarks/run.py [--quick] [--json] [--out DIR]

Prints the table and writes it (table.md, results.json) to --out (default benchmark-results/).

1. Extraction overhead: extract tokens/s / bare target forward tokens/s on the same batches
   (benchmarks/cache/extract_overhead.py; a random Qwen3_5ForCausalLM big enough that a batch takes
   >= 50 ms here). Goal >= 0.95.
2. Storage: bytes per token on the embedded target, bf16 and fp8, hidden vs raw bf16, top-k
   share; extrapolated to 1 B tokens of Qwen3.6-27B (5 taps x 5120), assuming the same hidden
   compression ratio.
3. Read path: decoded hidden-state bytes/s on one core (the process pinned to one CPU),
   sequential over shards and in the trainer's shuffled sample order, against the same bytes
   from an uncompressed in-memory array (the ceiling); cores needed for 1.3 GB/s.
4. Train step: from the cache stream vs the same batches in memory (goal >= 0.95), batched
   anchors vs a per-anchor loop (benchmarks/training/train_throughput.py), and the step's model FLOP/s
   against this CPU's measured float32 matmul FLOP/s.
5. Scaling: extract and train time at 1x, 2x, 4x the data; the reader's peak memory while
   streaming caches of 1x, 2x, 4x the size (separate processes).
6. GPU: not measured unless a GPU is present (the table says so).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.cache import extract_overhead as eo  # noqa: E402
from benchmarks.training import train_throughput as tt  # noqa: E402

from pipeline.cache.reader import CacheReader  # noqa: E402
from pipeline.config import ExtractConfig  # noqa: E402
from pipeline.training.stream import SampleStream, StreamState  # noqa: E402
from pipeline.embedded import TRAIN_DATA  # noqa: E402
from pipeline.timing_machine import describe_machine, machine_line  # noqa: E402
from stages.extract.run import run_extract  # noqa: E402

QWEN_TAPS, QWEN_HIDDEN = 5, 5120
NEEDED_DECODE_BYTES_PER_S = 1.3e9


def extract_cache(cache: Path, rows: int | None = None, shards: int = 8, fmt: str = "bf16") -> dict:
    data = TRAIN_DATA
    if rows:
        data = cache.parent / f"rows-{rows}.jsonl"
        lines = TRAIN_DATA.read_text(encoding="utf-8").splitlines()
        data.write_text("\n".join((lines * (rows // len(lines) + 1))[:rows]) + "\n", encoding="utf-8")
    if cache.exists():
        shutil.rmtree(cache)
    return run_extract(ExtractConfig(cache=str(cache), data=[str(data)], num_shards=shards, hidden_format=fmt), None,
                       progress=False)


# --------------------------------------------------------------------------- 1 + 2


def overhead(work: Path, quick: bool) -> dict:
    target = eo.build_target(work / "target", 512, 8)
    data = work / "rows.jsonl"
    rows = eo.pretokenized_rows(data, 8192 if quick else 24576, 500)
    bare, ext = [], []
    for _ in range(1 if quick else 2):
        bare.append(eo.bare_forward(target, rows, 2048, 4))
        ext.append(eo.extract_once(target, data, work / "ocache", 2048, 4))
    ratio = statistics.median(r["stream_tokens_per_s"] for r in ext) / statistics.median(r["tokens_per_s"] for r in bare)
    return {"target_parameters": eo.num_parameters(target), "median_bare_batch_ms": bare[0]["median_batch_ms"],
            "bare_tokens_per_s": statistics.median(r["tokens_per_s"] for r in bare),
            "extract_tokens_per_s": statistics.median(r["stream_tokens_per_s"] for r in ext),
            "ratio": ratio, "goal": 0.95, "met": ratio >= 0.95}


def storage(work: Path) -> dict:
    out = {}
    for fmt in ("bf16", "fp8"):
        cache = work / f"storage-{fmt}"
        s = extract_cache(cache, fmt=fmt)
        hidden, topk = eo.hidden_share(cache)
        tokens = s["tokens"]
        ratio = s["raw_bf16_hidden_bytes_per_token"] / (hidden / tokens)
        other = (s["stored_bytes"] - hidden) / tokens        # top-k and per-token bookkeeping, independent of H
        qwen = QWEN_TAPS * QWEN_HIDDEN * 2 / ratio + other
        out[fmt] = {"bytes_per_token": s["bytes_per_token"], "hidden_vs_raw_bf16": ratio,
                    "topk_share": topk / s["stored_bytes"], "qwen_bytes_per_token": qwen,
                    "qwen_tb_per_billion_tokens": qwen * 1e9 / 1e12}
    return out


# --------------------------------------------------------------------------- 3


def read_path(cache: Path) -> dict:
    """Decode rates on one core: pinned, then restored."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reader = CacheReader(cache)
        # Sequential: whole hidden arrays, shard by shard.
        t0 = time.perf_counter()
        decoded = 0
        arrays = []
        for name in reader.shards:
            shard = reader.shard(name)
            bits = shard.array("hidden")[:]
            decoded += bits.nbytes
            arrays.append(bits)
        sequential = decoded / (time.perf_counter() - t0)
        # Shuffled: the trainer's sample order through the stream's chunk cache (decode only, no prepare).
        stream = SampleStream(reader, seed=0, state=StreamState())
        t0 = time.perf_counter()
        shuffled_bytes = sum(s["hidden"].numel() * 2 for _, s in stream.epoch())
        shuffled = shuffled_bytes / (time.perf_counter() - t0)
        # Ceiling: the same bytes from memory, copied and viewed as bf16.
        t0 = time.perf_counter()
        copied = sum(torch.from_numpy(a.copy()).view(torch.bfloat16).numel() * 2 for a in arrays)
        ceiling = copied / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(torch_threads)
        os.sched_setaffinity(0, before)
    return {"sequential_bytes_per_s_per_core": sequential, "shuffled_bytes_per_s_per_core": shuffled,
            "memory_ceiling_bytes_per_s": ceiling, "sequential_over_ceiling": sequential / ceiling,
            "cores_for_1_3_GB_s_sequential": NEEDED_DECODE_BYTES_PER_S / sequential,
            "cores_for_1_3_GB_s_shuffled": NEEDED_DECODE_BYTES_PER_S / shuffled,
            "decoded_bytes": decoded}


# --------------------------------------------------------------------------- 4


def matmul_flops(n: int = 1024, repeats: int = 10) -> float:
    """float32 matmul FLOP/s on the device the train step uses."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        n, repeats = 8192, 20
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n ** 3 * repeats / (time.perf_counter() - t0)


def step_flops(config, batch) -> float:
    """Model FLOPs of one training step (forward x 3 for forward + backward), counting what the
    step computes: dense attention over [context ; all blocks] as SDPA does with a mask."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    nq, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    n_taps = len(config.target_layer_ids)
    total = 0.0
    for _, seq in batch:
        if seq is None:
            continue
        t, q = seq.num_tokens, seq.block_ids.numel()
        per_layer = 2 * q * h * nq * hd + 2 * 2 * (t + q) * h * nkv * hd + 2 * q * nq * hd * h + 3 * 2 * q * h * i
        per_layer += 2 * 2 * q * (t + q) * nq * hd
        total += 2 * t * n_taps * h * h + config.num_hidden_layers * per_layer + 2 * q * h * v
    return 3 * total


def train_step(cache: Path, steps: int) -> dict:
    cfg, reader, runner = tt.setup(cache)
    batches = list(tt.stream_batches(cfg, reader, runner, steps))
    fresh = list(tt.stream_batches(cfg, reader, runner, steps))
    t0 = time.perf_counter()
    for i, b in enumerate(fresh):
        runner.step(b, i, with_metrics=False)
    memory_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    count = 0
    for b in tt.stream_batches(cfg, reader, runner, steps):
        runner.step(b, 0, with_metrics=False)
        count += tt.tokens(b)
    stream_s = time.perf_counter() - t0
    few = batches[:2]
    t0 = time.perf_counter()
    for b in few:
        runner.step(b, 0, with_metrics=False)
    batched_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for b in few:
        tt.per_anchor_step(runner, b, cfg)
    loop_s = time.perf_counter() - t0
    flops = sum(step_flops(runner.drafter.config, b) for b in batches)
    peak = matmul_flops()
    tokens = sum(map(tt.tokens, batches))
    return {"memory_tokens_per_s": tokens / memory_s, "stream_tokens_per_s": count / stream_s,
            "stream_over_memory": (count / stream_s) / (tokens / memory_s), "goal": 0.95,
            "met": (count / stream_s) / (tokens / memory_s) >= 0.95,
            "batched_over_per_anchor_loop": loop_s / batched_s,
            "step_flops_per_s": flops / memory_s, "matmul_flops_per_s": peak, "mfu_vs_matmul": flops / memory_s / peak}


# --------------------------------------------------------------------------- 5


def reader_peak_rss(cache: Path) -> tuple[float, float]:
    """(largest RSS while streaming, RSS after imports) in MiB, of a fresh process that streams
    every sample of `cache` once; RSS is sampled every 20 samples (ru_maxrss would only show
    the import peak)."""
    code = ("import sys; from pipeline.cache.reader import CacheReader; "
            "from pipeline.training.stream import SampleStream, StreamState\n"
            "def rss():\n"
            "    return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20\n"
            "base = rss(); peak = base\n"
            "for i, _ in enumerate(SampleStream(CacheReader(sys.argv[1]), seed=0, state=StreamState()).epoch()):\n"
            "    peak = max(peak, rss()) if i % 20 == 0 else peak\n"
            "print(max(peak, rss()), base)")
    out = subprocess.run([sys.executable, "-c", code, str(cache)], capture_output=True, text=True, check=True,
                         cwd=HERE.parent).stdout.split()
    return float(out[0]), float(out[1])


def scaling(work: Path, quick: bool) -> dict:
    base = 250 if quick else 500
    rows = {"extract_s": [], "train_s": [], "reader_peak_rss_mib": [], "reader_import_rss_mib": [], "samples": []}
    for k in (1, 2, 4):
        cache = work / f"scale-{k}"
        t0 = time.perf_counter()
        extract_cache(cache, rows=base * k, shards=4 * k)
        rows["extract_s"].append(time.perf_counter() - t0)
        rows["samples"].append(base * k)
        cfg, reader, runner = tt.setup(cache)
        steps = (base * k) // cfg.schedule.batch_sequences // (4 if quick else 2)
        t0 = time.perf_counter()
        for b in tt.stream_batches(cfg, reader, runner, steps):
            runner.step(b, 0, with_metrics=False)
        rows["train_s"].append(time.perf_counter() - t0)
        peak, imported = reader_peak_rss(cache)
        rows["reader_peak_rss_mib"].append(peak)
        rows["reader_import_rss_mib"].append(imported)
    rows["extract_per_sample_ratio_4x_over_1x"] = (rows["extract_s"][2] / 4) / rows["extract_s"][0]
    rows["train_per_sample_ratio_4x_over_1x"] = (rows["train_s"][2] / 4) / rows["train_s"][0]
    rows["reader_rss_ratio_4x_over_1x"] = rows["reader_peak_rss_mib"][2] / rows["reader_peak_rss_mib"][0]
    return rows


# --------------------------------------------------------------------------- report


def markdown(r: dict, command: str) -> str:
    o, s, rp, t, sc = r["overhead"], r["storage"], r["read_path"], r["train"], r["scaling"]
    ok = lambda met: "met" if met else "**missed**"  # noqa: E731
    lines = [
        # The CPU's bf16 support beside the times: CPU wall times differ by up to 10x with it.
        f"Command: `{command}`. Machine: {machine_line({**r['machine'], 'gpu': None})}, "
        f"torch {r['machine']['torch']}, {r['machine']['torch_threads']} threads; {r['machine']['gpu']}. Date: {r['date']}.",
        "",
        "| # | measurement | value | goal |",
        "|---|---|---|---|",
        f"| 1 | extract / bare forward tokens/s ({o['target_parameters'] / 1e6:.1f} M-param target, {o['median_bare_batch_ms']:.0f} ms per bare batch) | {o['ratio']:.3f} ({o['extract_tokens_per_s']:,.0f} / {o['bare_tokens_per_s']:,.0f}) | >= 0.95: {ok(o['met'])} |",
    ]
    for fmt in ("bf16", "fp8"):
        x = s[fmt]
        lines.append(f"| 2 | storage {fmt}: bytes/token (tiny target); hidden vs raw bf16; top-k share; Qwen3.6-27B extrapolated | "
                     f"{x['bytes_per_token']:,.1f} B; {x['hidden_vs_raw_bf16']:.2f}x; {x['topk_share']:.1%}; "
                     f"{x['qwen_bytes_per_token'] / 1e3:,.1f} KB/token = {x['qwen_tb_per_billion_tokens']:,.1f} TB per 1 B tokens | |")
    lines += [
        f"| 3 | decoded hidden bytes/s on one core: sequential / shuffled samples / in-memory ceiling | {rp['sequential_bytes_per_s_per_core'] / 1e6:,.0f} / {rp['shuffled_bytes_per_s_per_core'] / 1e6:,.0f} / {rp['memory_ceiling_bytes_per_s'] / 1e6:,.0f} MB/s | |",
        f"| 3 | cores to decode 1.3 GB/s (Qwen3.6-27B drafter at 26k tokens/s): sequential / shuffled | {rp['cores_for_1_3_GB_s_sequential']:.1f} / {rp['cores_for_1_3_GB_s_shuffled']:.1f} | |",
        f"| 4 | train step from the cache stream / from memory | {t['stream_over_memory']:.3f} ({t['stream_tokens_per_s']:,.0f} / {t['memory_tokens_per_s']:,.0f} tokens/s) | >= 0.95: {ok(t['met'])} |",
        f"| 4 | batched-anchor step / per-anchor loop | {t['batched_over_per_anchor_loop']:.2f}x | |",
        f"| 4 | train-step model FLOP/s / float32 matmul FLOP/s | {t['step_flops_per_s'] / 1e9:.1f} / {t['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s = {t['mfu_vs_matmul']:.1%} | |",
        f"| 5 | extract s at {sc['samples'][0]}/{sc['samples'][1]}/{sc['samples'][2]} samples; per-sample 4x/1x | {' / '.join(f'{x:.1f}' for x in sc['extract_s'])}; {sc['extract_per_sample_ratio_4x_over_1x']:.2f} | linear: ~1 |",
        f"| 5 | train s (same steps per sample); per-sample 4x/1x | {' / '.join(f'{x:.1f}' for x in sc['train_s'])}; {sc['train_per_sample_ratio_4x_over_1x']:.2f} | linear: ~1 |",
        f"| 5 | reader peak RSS streaming 1x/2x/4x caches (MiB; {sc['reader_import_rss_mib'][0]:.0f} of it after imports); 4x/1x | {' / '.join(f'{x:.0f}' for x in sc['reader_peak_rss_mib'])}; {sc['reader_rss_ratio_4x_over_1x']:.2f} | flat: ~1 |",
        f"| 6 | GPU | {r['machine']['gpu']} | |",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, one round (minutes, not tens of minutes)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    parser.add_argument("--out", type=Path, default=Path("benchmark-results"), help="folder for table.md and results.json")
    args = parser.parse_args()
    if args.out.exists() and not args.out.is_dir():  # found now, not after the whole run
        parser.error(f"--out must be a folder, not a file: {args.out}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    work = Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    started = time.perf_counter()
    try:
        machine = describe_machine()
        result = {"machine": {**machine, "processor": platform.processor() or platform.machine(),
                              "gpu": machine["gpu"] or "no GPU: GPU figures not measured"},
                  "date": time.strftime("%Y-%m-%d")}
        print("1/5 extraction overhead", file=sys.stderr)
        result["overhead"] = overhead(work, args.quick)
        print("2/5 storage", file=sys.stderr)
        result["storage"] = storage(work)
        print("3/5 read path", file=sys.stderr)
        result["read_path"] = read_path(work / "storage-bf16")
        print("4/5 train step", file=sys.stderr)
        result["train"] = train_step(work / "storage-bf16", 12 if args.quick else 36)
        print("5/5 scaling", file=sys.stderr)
        result["scaling"] = scaling(work, args.quick)
        result["seconds"] = time.perf_counter() - started
        result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    finally:
        shutil.rmtree(work, ignore_errors=True)
    command = "python benchmarks/run.py" + (" --quick" if args.quick else "")
    table = markdown(result, command)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(table)
    (args.out / "results.json").write_text(json.dumps(result, indent=2, default=float) + "\n")
    if args.json:
        print(json.dumps(result, indent=2, default=float))
    else:
        print(table)


if __name__ == "__main__":
    main()
