"""verify-cache's recompute on a projected cache, calibrated (issue 77.2): the error of sound caches
against the planted faults, per hidden format and compute dtype, at two widths.

    python benchmarks/verify/projected_calibration.py [--widths embedded,synthetic] [--tokens 256]
        [--rank 2560] [--ulps 2]

Each case runs pipeline.verify.tap_alignment.ProjectedAlignment, the class verify-cache runs, on
one sample: the stored rows (the taps as an extraction computed them, projected and encoded as a
cache stores them) against the hidden states of a fresh forward (the check's compute dtype).

- embedded: the embedded target (3 taps x 128), real forwards on this CPU in float32 and in
  bfloat16; the basis fitted on a pilot of other conversations (R = 96, a quarter of the width).
- synthetic: the rehearsal's width, 5 taps x 5,120, a residual stream with outlier dimensions as
  real LLM hidden states have (4 dimensions of magnitude 30 to 250, growing with depth and nearly
  the same for every token, over token-specific updates of RMS about 1); the basis fitted on a
  synthetic pilot of 4,096 tokens (--rank components). A "forward" in bfloat16 is the float32
  states perturbed by up to --ulps units of bf16 rounding and rounded to bf16, independently for
  the extraction and the check.

Extraction computes in bfloat16 (a GPU's default) or float32; the check in float32 or bfloat16.
Faults, each planted in what the extraction stores: rows a position late; all taps a layer late;
one tap (the middle one) a layer late; two taps swapped (the second and the last); rows projected
with a basis fitted on another pilot. For each: the rounding-scaled error (the figure held against
verify's tolerance) and the verdict of the search. Prints one JSON document, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

FAULTS = ("sound", "shift", "all_taps_late", "one_tap_late", "two_swapped", "other_basis")


def bf16_forward(states: torch.Tensor, ulps: float, gen: torch.Generator) -> torch.Tensor:
    """float32 states as a bf16 forward might give them: perturbed by up to `ulps` bf16 units, rounded."""
    if ulps == 0:
        return states.to(torch.bfloat16).float()
    noise = (torch.rand(states.shape, generator=gen) * 2 - 1) * ulps * 2.0 ** -8
    return (states * (1 + noise)).to(torch.bfloat16).float()


def synthetic_states(layers: int, tokens: int, hidden: int, seed: int) -> torch.Tensor:
    """[layers + 1, tokens, hidden] float32: a residual stream of low-rank token-specific updates
    (a decaying spectrum, as hidden states have) with 4 outlier dimensions."""
    g = torch.Generator().manual_seed(1000)          # the model: the same for every sample and pilot
    mixing = [torch.randn(256, hidden, generator=g) * torch.logspace(0, -1.5, 256)[:, None] / 2 for _ in range(layers + 1)]
    outliers = torch.randperm(hidden, generator=g)[:4]
    t = torch.Generator().manual_seed(seed)          # the tokens
    h = torch.randn(tokens, 256, generator=t) @ mixing[0]
    out = [h]
    for layer in range(1, layers + 1):
        h = h + 0.5 * torch.randn(tokens, 256, generator=t) @ mixing[layer]
        out.append(h.clone())
    states = torch.stack(out)
    for i, o in enumerate(outliers):
        level = torch.linspace(30, 250, layers + 1)[:, None] * (1 + 0.5 * i)
        states[:, :, o] = level * (1 + 0.01 * torch.randn(layers + 1, tokens, generator=t))
    return states


def fitted_basis(pilot_taps: torch.Tensor, projected_rank: int):
    from pipeline.projection.basis import SecondMoment, fit_basis

    moment = SecondMoment(pilot_taps.shape[1])
    moment.add(pilot_taps)
    return fit_basis(moment, projected_rank)


def stored(basis, taps_TNH: torch.Tensor, fmt: str) -> torch.Tensor:
    from pipeline.cache.encoding import decode_hidden, encode_hidden

    arrays = encode_hidden(fmt, basis.project_taps(taps_TNH))
    return decode_hidden(fmt, arrays.__getitem__).float()


def planted(fault: str, extracted: torch.Tensor, taps: list[int], basis, other, fmt: str) -> torch.Tensor:
    """The stored rows [T, 1, R] of an extraction whose hidden states were `extracted`, with `fault`."""
    index = [t + 1 for t in taps]
    if fault == "all_taps_late":
        index = [i + 1 for i in index]
    elif fault == "one_tap_late":
        index[len(index) // 2] += 1
    elif fault == "two_swapped":
        index[1], index[-1] = index[-1], index[1]
    rows = stored(other if fault == "other_basis" else basis, extracted[index].transpose(0, 1), fmt)
    return torch.roll(rows, 1, 0) if fault == "shift" else rows


def judge(basis, taps, fresh: torch.Tensor, rows: torch.Tensor) -> dict:
    from pipeline.verify.tap_alignment import ProjectedAlignment

    check = ProjectedAlignment(basis, taps)
    check.add(fresh, rows)
    aligned, summary, evidence = check.verdict(1)
    return {"error": check.max_rel, "aligned": aligned, "summary": summary}


def embedded_case(args):
    """(taps, basis, other basis, {compute dtype: a function from sample index to hidden states})."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.embedded import TARGET_DIR, TRAIN_DATA
    from presets import load_preset

    tokenizer = AutoTokenizer.from_pretrained(TARGET_DIR)
    models = {dtype: AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=dtype, use_kernels=False).eval()
              for dtype in (torch.float32, torch.bfloat16)}
    rows = [json.loads(x) for x in TRAIN_DATA.read_text().splitlines()[:400]]
    texts = [" ".join(m["content"] for m in r["messages"]) for r in rows]
    taps = load_preset("tiny")["target"]["target_layer_ids"]

    @torch.no_grad()
    def states(text: str, dtype) -> torch.Tensor:
        ids = tokenizer(text, return_tensors="pt").input_ids[:, :args.tokens]
        return torch.stack([h[0].float() for h in models[dtype](input_ids=ids, output_hidden_states=True).hidden_states])

    def pilot(first: int) -> torch.Tensor:
        out, n = [], 0
        for text in texts[first:]:
            s = states(text, torch.float32)
            out.append(s[[t + 1 for t in taps]].transpose(0, 1).reshape(s.shape[1], -1))
            n += s.shape[1]
            if n >= 4000:
                break
        return torch.cat(out)

    width = len(taps) * models[torch.float32].config.hidden_size
    projected_rank = width // 4
    basis, other = fitted_basis(pilot(10), projected_rank), fitted_basis(pilot(200), projected_rank)
    sample = " ".join(texts[:3])
    forward = {"float32": lambda: states(sample, torch.float32), "bfloat16": lambda: states(sample, torch.bfloat16)}
    return taps, basis, other, forward


def synthetic_case(args):
    taps, layers, hidden = [1, 3, 5, 7, 9], 11, 5120
    pilot = lambda seed: synthetic_states(layers, 4096, hidden, seed)[[t + 1 for t in taps]].transpose(0, 1).reshape(4096, -1)  # noqa: E731
    basis, other = fitted_basis(pilot(1), args.rank), fitted_basis(pilot(2), args.rank)
    exact = synthetic_states(layers, args.tokens, hidden, seed=7)
    gen = torch.Generator().manual_seed(11)
    forward = {"float32": lambda: exact, "bfloat16": lambda: bf16_forward(exact, args.ulps, gen)}
    return taps, basis, other, forward


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", default="embedded,synthetic", help="embedded, synthetic or both (default both).")
    p.add_argument("--tokens", type=int, default=256, help="Tokens of the checked sample (default 256).")
    p.add_argument("--rank", type=int, default=2560, help="R of the synthetic basis (default 2560: a tenth of 25,600).")
    p.add_argument("--ulps", type=float, default=2.0, help="bf16 units a synthetic bf16 forward may differ by (default 2).")
    args = p.parse_args()
    widths = args.widths.split(",")
    if set(widths) - {"embedded", "synthetic"}:
        p.error(f"--widths takes embedded and synthetic, got {args.widths!r}")
    torch.set_grad_enabled(False)
    rows, started = [], time.perf_counter()
    for width in widths:
        taps, basis, other, forward = (embedded_case if width == "embedded" else synthetic_case)(args)
        for extract_dtype in ("bfloat16", "float32"):
            extracted = forward[extract_dtype]()
            for check_dtype in ("float32", "bfloat16"):
                fresh = forward[check_dtype]()
                for fmt in ("bf16", "fp8"):
                    for fault in FAULTS:
                        rows.append({"width": width, "taps_x_hidden": f"{len(taps)} x {basis.width // len(taps)}",
                                     "rank": basis.projected_rank, "extract": extract_dtype, "check": check_dtype, "format": fmt,
                                     "fault": fault, **judge(basis, taps, fresh, planted(fault, extracted, taps, basis,
                                                                                          other, fmt))})
                        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "projected_calibration", "tokens": args.tokens, "ulps": args.ulps, "rows": rows,
                      "seconds": round(time.perf_counter() - started, 1)}, indent=2))
    print()
    print("| width | format | extract / check | sound | " + " | ".join(FAULTS[1:]) + " |")
    print("|---|---|---|---|" + "---|" * (len(FAULTS) - 1))
    groups = {}
    for r in rows:
        groups.setdefault((r["width"], r["format"], r["extract"], r["check"]), {})[r["fault"]] = r
    for (width, fmt, ex, ch), faults in groups.items():
        cells = [f"{faults['sound']['error']:.3g}" + ("" if faults["sound"]["aligned"] else " (misaligned!)")]
        cells += [f"{faults[f]['error']:.3g}" + (" found" if not faults[f]["aligned"] else "") for f in FAULTS[1:]]
        print(f"| {width} | {fmt} | {ex} / {ch} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
