"""fla (and Liger Kernel) against the torch path under Triton's interpreter on the CPU, fp32: the
table of BENCHMARKS.md "Kernels under Triton's interpreter (issue 67)". Per op, the max abs
difference of each output from transformers' torch function (harness/kernel_ops.py, the pairs
tests/kernels/test_ops.py asserts on); then the embedded target's forward with fla bound against
the same forward on the torch functions (logits and taps; argmax agreement), a prefill and decode
steps through the cache; then liger's fused linear cross-entropy against the trainer's loss.
Seconds are the interpreter's, not the kernels' (it runs each program in Python): no speed claim.

  TRITON_INTERPRET=1 python benchmarks/kernels/interpreter_table.py     # in the kernels venv (README)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness import triton_interpreter  # noqa: E402

triton_interpreter.install()   # before anything imports fla (transformers' qwen3_5 module does)

import torch  # noqa: E402

from harness.kernel_binding import torch_bound  # noqa: E402
from harness.kernel_ops import all_pairs  # noqa: E402


def ops() -> list[dict]:
    rows = []
    start = time.perf_counter()
    for pair in all_pairs("cpu"):
        rows.append({"op": pair.op, "max_abs_diff": pair.max_abs_diff(),
                     "reference_max_abs": {k: float(v.abs().max()) for k, v in pair.reference.items()}})
    rows.append({"seconds": round(time.perf_counter() - start, 1)})
    return rows


def forward(tokens: int, decode: int) -> dict:
    """The embedded target: one prefill of `tokens` random ids through a cache, then `decode` greedy
    one-token steps, fla bound against torch bound (the same weights, inputs and steps)."""
    from pipeline import embedded
    from pipeline.target_model import load_target
    from pipeline.target_model.internals import bound_kernels, modeling_module_of
    from pipeline.target_model.live import LiveTarget

    model = load_target(embedded.TARGET_DIR, dtype=torch.float32).eval()
    live = LiveTarget(model, list(range(model.config.num_hidden_layers - 1)))   # every layer's output tapped
    ids = torch.randint(0, model.config.vocab_size - 8, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()

    def run():
        step = live.run(ids, None, 0)
        logits, hidden, steps = [step.logits], [step.hidden], [int(step.logits[-1].argmax())]
        for i in range(decode):
            step = live.run([steps[-1]], step.state, tokens + i)
            logits.append(step.logits)
            hidden.append(step.hidden)
            steps.append(int(step.logits[-1].argmax()))
        return torch.cat(logits), torch.cat(hidden), steps

    start = time.perf_counter()
    fla_logits, fla_hidden, fla_steps = run()
    fla_seconds = time.perf_counter() - start
    with torch_bound():
        start = time.perf_counter()
        ref_logits, ref_hidden, ref_steps = run()
        torch_seconds = time.perf_counter() - start
    return {"bound": {op: info["kind"] for op, info in bound_kernels(modeling_module_of(model)).items()},
            "tokens": tokens, "decode_steps": decode,
            "logits_max_abs_diff": float((fla_logits - ref_logits).abs().max()),
            "logits_max_abs": float(ref_logits.abs().max()),
            "taps_max_abs_diff": float((fla_hidden - ref_hidden).abs().max()), "taps_max_abs": float(ref_hidden.abs().max()),
            "argmax_agreement": float((fla_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
            "greedy_steps_equal": fla_steps == ref_steps,
            "seconds_fla_interpreted": round(fla_seconds, 1), "seconds_torch": round(torch_seconds, 2)}


def liger() -> dict:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    from pipeline.training.loss import supervised_loss

    g = torch.Generator().manual_seed(0)
    n, hidden, vocab = 64, 128, 512
    h, weight = torch.randn(n, hidden, generator=g), torch.randn(vocab, hidden, generator=g) * 0.05
    labels, w = torch.randint(0, vocab, (n,), generator=g), torch.rand(n, generator=g)
    ours_h, theirs_h = h.clone().requires_grad_(True), h.clone().requires_grad_(True)
    ours, _ = supervised_loss(ours_h[:, None], weight, labels[:, None], w[:, None])
    ours.backward()
    theirs = (LigerFusedLinearCrossEntropyLoss(reduction="none")(weight, theirs_h, labels) * w).sum()
    theirs.backward()
    ours, theirs = float(ours.detach()), float(theirs.detach())
    return {"rows": n, "vocab": vocab, "loss_abs_diff": abs(ours - theirs), "loss": ours,
            "grad_max_abs_diff": float((ours_h.grad - theirs_h.grad).abs().max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64, help="prefill length of the forward comparison")
    parser.add_argument("--decode", type=int, default=4, help="greedy one-token steps after it")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import triton
    import fla
    import liger_kernel  # noqa: F401
    from importlib.metadata import version
    result = {"torch": torch.__version__, "triton": triton.__version__, "fla": fla.__version__,
              "liger_kernel": version("liger-kernel"), "dtype": "float32", "ops": ops(),
              "forward": forward(args.tokens, args.decode), "liger_fused_linear_cross_entropy": liger()}
    print("| op | output | max abs diff vs torch | max abs of the torch output |")
    print("| --- | --- | --- | --- |")
    for row in result["ops"][:-1]:
        for name, diff in row["max_abs_diff"].items():
            print(f"| {row['op']} | {name} | {diff:.2g} | {row['reference_max_abs'][name]:.3g} |")
    f = result["forward"]
    print(f"| embedded target forward ({f['tokens']} tokens + {f['decode_steps']} decode steps) | logits | "
          f"{f['logits_max_abs_diff']:.2g} | {f['logits_max_abs']:.3g} |")
    print(f"| embedded target forward | every layer's output | {f['taps_max_abs_diff']:.2g} | {f['taps_max_abs']:.3g} |")
    lg = result["liger_fused_linear_cross_entropy"]
    print(f"| liger fused linear CE vs pipeline/training/loss.py | loss / grad | {lg['loss_abs_diff']:.2g} / "
          f"{lg['grad_max_abs_diff']:.2g} | {abs(lg['loss']):.3g} |")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
