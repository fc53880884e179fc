"""Peak memory of one training micro-step at the flagship width, the full-logits path vs the
chunked loss (issue 17), measured on CPU with reduced counts, then a per-query fit.

Each measurement runs in a fresh process: build a drafter at hidden 5120, vocabulary 248,320 and
the reference head geometry (32 query / 8 KV heads, head_dim 128, intermediate 17408) with
`--layers` layers, one 3,072-token sequence with A anchors x block 16; reset the process's peak
RSS (/proc/self/clear_refs), run forward + loss + metrics + backward, and report the peak RSS
above the level before the step. The frozen embedding and lm_head (one tied fp32 tensor here, to
fit this machine) and the parameters are in that baseline, not in the step's peak.

  python benchmarks/training/train_memory.py --json                  # both paths, 32/64/128 anchors, 1 layer
  python benchmarks/training/train_memory.py --anchors 64 --layers 2 --json > l2.json    # per-layer increment
  python benchmarks/training/train_memory.py --project one.json l2.json                   # the flagship projection
  (--project pools the rows of any number of such outputs, e.g. one file per --paths)

  # issue 32: the real query count (512 anchors x 16 = 8,192), measured, then only the layer
  # count and the micro-batch projected (`projection_from_measured`):
  python benchmarks/training/train_memory.py --paths chunked --anchors 512 --json > q8192-l1.json
  python benchmarks/training/train_memory.py --paths chunked --anchors 512 --layers 2 --json > q8192-l2.json
  python benchmarks/training/train_memory.py --project q8192-l1.json q8192-l2.json

Each row also gives the process's own peak (`process_peak_bytes`: VmHWM over the whole process,
the weights' construction included, which the step's reset does not show) and the baseline.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

HIDDEN, VOCAB, TOKENS, BLOCK, TAPS = 5120, 248_320, 3072, 16, 5


def rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def one(path: str, anchors: int, layers: int) -> dict:
    import numpy as np
    import torch

    from pipeline.training.batch import final_hidden, forward_logits, loss_sum, pack, prepare
    from pipeline.training.loss import supervised_loss
    from pipeline.drafter.model import DFlashDrafter, DrafterConfig
    from pipeline.training.metrics import hit_sums, metric_sums

    torch.manual_seed(0)
    config = DrafterConfig(hidden_size=HIDDEN, intermediate_size=17408, num_hidden_layers=layers, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=128, vocab_size=VOCAB, target_layer_ids=[1, 16, 31, 46, 61],
                           num_target_layers=64, mask_token_id=248070, block_size=BLOCK, rope_theta=1e7)
    shared = torch.nn.Embedding(VOCAB, HIDDEN)
    shared.weight.data.normal_(0, 0.02)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False, device="meta")  # no second 5 GB tensor, even for a moment
    head.weight = shared.weight  # tied: one 5 GB tensor instead of two on this machine
    drafter = DFlashDrafter(config, embed=shared, lm_head=head)
    rng = np.random.default_rng(0)
    sample = {"input_ids": rng.integers(0, 248_000, TOKENS), "loss_mask": np.ones(TOKENS, np.uint8),
              "target_argmax": rng.integers(0, 248_000, TOKENS),
              "hidden": rng.standard_normal((TOKENS, TAPS, HIDDEN), dtype=np.float32)}
    seq = prepare(sample, block_size=BLOCK, num_anchors=anchors, max_length=TOKENS, mask_token_id=248070, gamma=7.0,
                  generator=torch.Generator().manual_seed(0))
    packed = pack([seq], BLOCK)
    del sample
    setup_peak = rss_bytes("VmHWM")  # building the weights and the batch, before the reset
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    before = rss_bytes("VmRSS")
    start = time.perf_counter()
    if path == "full":  # what the trainer did before issue 17
        logits = forward_logits(drafter, packed)
        loss = loss_sum(logits, packed, "ce")
        loss.backward()
        metric_sums(logits.detach(), packed.labels, packed.weights, packed.real_blocks)
    else:
        final = final_hidden(drafter, packed)
        loss, hits = supervised_loss(final, drafter.lm_head_weight, packed.labels, packed.weights, with_hits=True)
        loss.backward()
        hit_sums(hits, packed.weights, packed.real_blocks)
    seconds = time.perf_counter() - start
    step_hwm = rss_bytes("VmHWM")
    return {"path": path, "anchors": anchors, "queries": anchors * BLOCK, "layers": layers, "tokens": TOKENS,
            "step_peak_bytes": step_hwm - before, "baseline_bytes": before, "setup_peak_bytes": setup_peak,
            "process_peak_bytes": max(setup_peak, step_hwm), "seconds": round(seconds, 1), "loss": float(loss.detach()),
            "threads": torch.get_num_threads()}


def fit(rows: list[dict]) -> dict:
    """peak = a + b * queries, least squares over the anchor counts (per path, 1 layer)."""
    out = {}
    for path in sorted({r["path"] for r in rows}):
        pts = [(r["queries"], r["step_peak_bytes"]) for r in rows if r["path"] == path and r["layers"] == 1]
        if len(pts) < 2:
            continue
        n = len(pts)
        mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
        b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        out[path] = {"bytes_per_query": b, "intercept_bytes": my - b * mx,
                     "bytes_per_query_over_V": b / VOCAB}
    return out


def parameters(layers: int) -> int:
    """Trainable parameters of the reference-geometry drafter (fc, norms, layers)."""
    per_layer = (HIDDEN * 32 * 128 + 2 * HIDDEN * 8 * 128 + 32 * 128 * HIDDEN + 3 * HIDDEN * 17408
                 + 2 * HIDDEN + 2 * 128)
    return TAPS * HIDDEN * HIDDEN + 2 * HIDDEN + layers * per_layer


def project(rows: list[dict]) -> dict:
    """A projection, not a measurement, for the full preset (5 layers, 512 anchors x 16 = 8,192
    queries, 3,072 tokens) on one GPU rank. From the CPU fp32 measurements: the 1-layer step peak
    fitted linearly in queries, plus 4 x the increment of a second layer (measured at two query
    counts, fitted linearly, never below the larger measured one), gives one sequence's step peak (activations and the gradients the
    step allocates). A micro-batch of m sequences adds m - 1 times that peak less the gradients
    (4 bytes a parameter). Static: frozen embed + lm_head (fp32 before, bf16 now), fp32
    parameters, and AdamW's 8 bytes a parameter (divided by the ranks now: ZeRO). Assumed, not
    measured: bf16 activations would be smaller than these fp32 ones; the CPU path's attention
    keeps fp32 scores of one piece that flex attention on a GPU does not; the full path's dense
    [Q, T+Q] attention grows faster than linearly, so its projection is an underestimate."""
    q = 512 * BLOCK
    params = parameters(5)
    out = {"queries": q, "parameters": params}
    for path, fitted in fit(rows).items():
        one = {r["queries"]: r["step_peak_bytes"] for r in rows if r["path"] == path and r["layers"] == 1}
        two = {r["queries"]: r["step_peak_bytes"] for r in rows if r["path"] == path and r["layers"] == 2}
        if len(two) < 2 or not set(two) <= set(one):
            continue
        (qa, qb) = sorted(two)[:2]
        inc_a, inc_b = two[qa] - one[qa], two[qb] - one[qb]
        inc_slope = (inc_b - inc_a) / (qb - qa)
        # Never below what was measured: a layer's increment includes its gradients, which do not shrink.
        increment = max(inc_a + inc_slope * (q - qa), inc_a, inc_b)
        step = fitted["intercept_bytes"] + fitted["bytes_per_query"] * q + 4 * increment
        frozen = 2 * VOCAB * HIDDEN * (4 if path == "full" else 2)
        per_extra_sequence = max(step - 4 * params, 0)
        rows_out = {}
        for world in (1, 8):
            adam = 8 * params / (world if path == "chunked" else 1)
            static = frozen + 4 * params + adam
            rows_out[f"ranks={world}"] = {f"micro_batch={m}": round((static + step + (m - 1) * per_extra_sequence) / 1e9, 1)
                                          for m in (1, 2, 4)}
        out[path] = {"one_sequence_step_peak_GB": round(step / 1e9, 1),
                     "layer_increment_GB": {str(qa): round(inc_a / 1e9, 2), str(qb): round(inc_b / 1e9, 2),
                                            str(q) + " (fitted)": round(increment / 1e9, 2)},
                     "frozen_GB": round(frozen / 1e9, 2), "projected_peak_GB": rows_out}
    return out


def project_measured(rows: list[dict], queries: int = 512 * BLOCK) -> dict:
    """The full preset's peak from steps measured at its real query count (issue 32): the chunked
    path's 1-layer and 2-layer step peaks at `queries` give the layer increment, projected to 5
    layers; a micro-batch of m sequences adds m - 1 times the step peak less the gradients (4
    bytes a parameter); static memory as in `project`. Only the layer count and the micro-batch
    are projected; the query count is measured."""
    at = {r["layers"]: r for r in rows if r["path"] == "chunked" and r["queries"] == queries}
    if not {1, 2} <= set(at):
        return {}
    increment = at[2]["step_peak_bytes"] - at[1]["step_peak_bytes"]
    params = parameters(5)
    step = at[1]["step_peak_bytes"] + 4 * increment
    frozen = 2 * VOCAB * HIDDEN * 2
    per_extra_sequence = max(step - 4 * params, 0)
    table = {}
    for world in (1, 8):
        static = frozen + 4 * params + 8 * params / world
        table[f"ranks={world}"] = {f"micro_batch={m}": round((static + step + (m - 1) * per_extra_sequence) / 1e9, 1)
                                   for m in (1, 2, 4)}
    return {"queries": queries, "measured_step_peak_GB": {f"layers={n}": round(r["step_peak_bytes"] / 1e9, 2)
                                                          for n, r in sorted(at.items())},
            "measured_process_peak_GB": {f"layers={n}": round(r["process_peak_bytes"] / 1e9, 2)
                                         for n, r in sorted(at.items()) if "process_peak_bytes" in r},
            "layer_increment_GB": round(increment / 1e9, 2), "five_layer_step_peak_GB": round(step / 1e9, 1),
            "projected_peak_GB": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--anchors", type=int, nargs="+", default=[32, 64, 128],
                        help="anchor counts to measure, 16 queries each (default: 32 64 128)")
    parser.add_argument("--layers", type=int, default=1, help="drafter layers (default %(default)s)")
    parser.add_argument("--paths", nargs="+", choices=["full", "chunked"], default=["full", "chunked"],
                        help="loss paths to measure: full logits, chunked loss (default: both)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON, not as a Python dict")
    parser.add_argument("--one", nargs=3, metavar=("PATH", "ANCHORS", "LAYERS"), help=argparse.SUPPRESS)
    parser.add_argument("--project", nargs="+", type=Path, metavar="JSON", help="outputs of --json runs to project from")
    args = parser.parse_args()
    # Bad values end here in one line, not in a traceback (or a row's error) per measurement.
    if min(args.anchors) < 1 or args.layers < 1:
        parser.error(f"--anchors and --layers must be at least 1, got {args.anchors} and {args.layers}")
    missing = [str(p) for p in args.project or [] if not p.is_file()]
    if missing:
        parser.error(f"--project: no such file: {', '.join(missing)}")
    if args.project:
        rows = [r for p in args.project for r in json.loads(p.read_text())["rows"] if "error" not in r]
        print(json.dumps({"fit": fit(rows), "projection": project(rows),
                          "projection_from_measured": project_measured(rows)}, indent=1))
        return
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), int(args.one[2]))))
        return
    rows = []
    for anchors in args.anchors:
        for path in args.paths:  # paths interleaved per anchor count
            done = subprocess.run([sys.executable, __file__, "--one", path, str(anchors), str(args.layers)],
                                  capture_output=True, text=True)
            if done.returncode:
                rows.append({"path": path, "anchors": anchors, "layers": args.layers, "error": done.stderr.strip()[-300:]})
            else:
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), file=sys.stderr)
    result = {"rows": rows, "fit": fit([r for r in rows if "error" not in r])}
    print(json.dumps(result, indent=1) if args.json else result)


if __name__ == "__main__":
    main()
