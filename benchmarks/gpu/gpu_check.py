"""The first hour on a GPU node: every GPU path of the pipeline in one process on one GPU,
within 10 minutes on one H200, printed as one JSON summary (also written to --out). A section
that cannot run (no CUDA, no fla, no causal-conv1d, a compile failure) is one line in the
summary, and the rest still runs. README: "Before your first GPU day".

  python benchmarks/gpu/gpu_check.py --out gpu_check.json          # on a GPU node (H200 / 80 GB)
  python benchmarks/gpu/gpu_check.py --smoke                        # the same code at toy sizes, CPU

Pipeline sections (benchmarks/gpu/gpu_paths.py), in order, each with its peak memory:
a. extract: `pipeline extract` of the embedded target (tokens/s, bytes/token, the kernel path each
   shard recorded: "fla" where fla and causal-conv1d are installed); the bound linear-attention
   kernels against transformers' torch reference on one forward (taps, logits, argmax) of the
   embedded target and of a random target at Qwen3.6-27B's widths (4 layers, bf16); and fla's
   kernels op by op against the torch functions, fp32 and bf16 (harness/kernel_ops.py: the pairs
   the CPU kernel tier asserts on under Triton's interpreter).
b. train: the checks below (flex attention vs the split and dense paths; the flagship-shape step
   under bf16 autocast for micro-batches 1..8; the chunked loss against fused kernels), then the
   tiny preset's drafter trained on (a)'s cache.
c. eval greedy and sampled on the device (block, DDTree 16: lossless, tau, speed-up vs plain
   decoding), and generate in-process.

Stage two at the flagship shape (issue 17):

1. equality: a small drafter (hidden 1024, a sliding-window layer then a full one, 16 anchors),
   fp32, the same batch and weights: loss and every parameter's gradient of the flex-attention
   path and of the split path against the dense-mask path (max relative difference); then flex
   against split directly over micro-batches of four shapes (sequences, tokens, anchors), as the
   steps of a run change them, and the graphs torch compiled for flex attention over them
   (issue 67: compiled for dynamic shapes, a handful for a whole run, not one a step). On the
   CPU (--smoke) flex runs eager, its backward through harness/flex_cpu_backward.py: no graphs.
2. the reference-geometry drafter (hidden 5120, 32 q / 8 kv heads of 128, intermediate 17408,
   4 sliding-window (2048) layers + 1 full, vocabulary 248,320), random weights: full training
   steps (forward with flex attention, the chunked loss, backward, AdamW) on sequences of 3,072
   tokens x 512 anchors x block 16 under bf16 autocast, for micro-batches 1, 2, 4, 8 until one
   does not fit: peak GPU memory, tokens/s and the flex-attention graphs compiled for each that fits.
3. draft vocabulary (issue 58): the step of (2) at micro-batch 1 with the whole vocabulary and
   with draft vocabularies of 65,536 and 32,768 tokens (labels from the first 32,768 ids, so each
   runs its head on the same rows): seconds per step, peak memory, ratios to the whole one.
4. the loss on the final hidden states of (2): ours (`pipeline/training/loss.py`) against Liger
   Kernel's fused linear cross-entropy and cut-cross-entropy where installed (loss, gradient,
   time, peak memory); "not installed" otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import gpu_paths  # noqa: E402  (beside this file)
from pipeline.timing_machine import describe_machine  # noqa: E402
from pipeline.training.batch import final_hidden, pack, prepare  # noqa: E402
from pipeline.training.loss import LOSS_PATH, supervised_loss  # noqa: E402
from pipeline.drafter.attention_rule import attention_path, block_mask  # noqa: E402
from pipeline.drafter.model import DFlashDrafter, DrafterConfig  # noqa: E402
from pipeline.drafter.vocab import DraftVocab  # noqa: E402
from harness.draft_vocab import with_draft_vocab  # noqa: E402
from harness.flex_cpu_backward import flex_backward_on_cpu  # noqa: E402

TAPS = [1, 16, 31, 46, 61]
FLAGSHIP = dict(hidden=5120, vocab=248_320, layers=5, heads=32, kv=8, head_dim=128, intermediate=17408, window=2048,
                tokens=3072, anchors=512, block=16)
SMOKE = dict(hidden=64, vocab=512, layers=2, heads=4, kv=2, head_dim=16, intermediate=128, window=32,
             tokens=160, anchors=8, block=16)


def make_drafter(s: dict, device, seed=0) -> DFlashDrafter:
    torch.manual_seed(seed)
    kinds = ["sliding_attention"] * (s["layers"] - 1) + ["full_attention"]
    config = DrafterConfig(hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_hidden_layers=s["layers"],
                           num_attention_heads=s["heads"], num_key_value_heads=s["kv"], head_dim=s["head_dim"],
                           vocab_size=s["vocab"], target_layer_ids=TAPS, num_target_layers=64, mask_token_id=s["vocab"] - 2,
                           block_size=s["block"], rope_theta=1e7, layer_types=kinds, sliding_window=s["window"])
    frozen_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):  # made where they run: the fp32 master weights, the frozen modules in bf16
        embed = torch.nn.Embedding(s["vocab"], s["hidden"], dtype=frozen_dtype)
        embed.weight.data.normal_(0, 0.02)
        head = torch.nn.Linear(s["hidden"], s["vocab"], bias=False, dtype=frozen_dtype)
        head.weight.data.normal_(0, 0.02)
        return DFlashDrafter(config, embed=embed, lm_head=head)


def make_batch(s: dict, sequences: int, seed=0, vocab=None, labels_below: int | None = None):
    rng = np.random.default_rng(seed)
    items = []
    for i in range(sequences):
        n = s["tokens"]
        sample = {"input_ids": rng.integers(0, s["vocab"] - 8, n), "loss_mask": np.ones(n, np.uint8),
                  "target_argmax": rng.integers(0, labels_below or s["vocab"] - 8, n),
                  "hidden": rng.standard_normal((n, len(TAPS), s["hidden"]), dtype=np.float32)}
        items.append(prepare(sample, block_size=s["block"], num_anchors=s["anchors"], max_length=n,
                             mask_token_id=s["vocab"] - 2, gamma=7.0, generator=torch.Generator().manual_seed(seed + i),
                             vocab=vocab))
    return pack(items, s["block"])


def loss_and_grads(drafter, packed, path: str):
    drafter.zero_grad(set_to_none=True)
    if path == "dense":
        allowed = block_mask(packed.anchors, packed.hidden.shape[1], packed.labels.shape[1])
        final = drafter(packed.hidden, packed.block_ids, packed.block_pos, allowed, logits=False)
        final = final.view(packed.labels.shape[0], packed.labels.shape[1], -1)
    else:
        drafter.attention = path
        final = final_hidden(drafter, packed)
    loss, _ = supervised_loss(final, drafter.lm_head_weight, packed.labels, packed.weights)
    (loss / packed.weights.sum()).backward()
    return float(loss / packed.weights.sum()), {n: p.grad.detach().clone() for n, p in drafter.named_parameters()}


def rel_grad_diff(grads: dict, ref: dict) -> float:
    """The largest of every parameter's max |difference| / max |reference gradient|."""
    return max(float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)) for n, g in ref.items())


def flex_graphs() -> dict[str, int]:
    """Graphs torch holds compiled for flex attention's two compiled functions (dynamo's cache
    entries of their code: one per shape class it compiled); {} where this torch cannot say."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list as entries
        from torch.nn.attention import flex_attention as fa
        return {"create_block_mask": len(entries(fa.create_block_mask.__code__)),
                "flex_attention": len(entries(fa.flex_attention.__code__))}
    except Exception:  # noqa: BLE001 - a private API: its absence is not a failure of the check
        return {}


def graphs_since(before: dict[str, int]) -> dict[str, int]:
    return {name: n - before.get(name, 0) for name, n in flex_graphs().items()}


def equality(device, smoke: bool) -> dict:
    s = dict(SMOKE) if smoke else dict(hidden=1024, vocab=32_000, layers=2, heads=8, kv=2, head_dim=128,
                                       intermediate=2048, window=96, tokens=512, anchors=16, block=16)
    before = flex_graphs()
    drafter = make_drafter(s, device)
    drafter.float()
    packed = make_batch(s, 2).to(device)
    ref_loss, ref = loss_and_grads(drafter, packed, "dense")
    out = {}
    # On the CPU torch refuses flex attention's backward: the scaffold lets its eager one run.
    with flex_backward_on_cpu() if device.type == "cpu" else contextlib.nullcontext():
        for path in ("flex", "split"):
            loss, grads = loss_and_grads(drafter, packed, path)
            out[path] = {"loss": loss, "dense_loss": ref_loss, "loss_rel_diff": abs(loss - ref_loss) / abs(ref_loss),
                         "max_rel_grad_diff": rel_grad_diff(grads, ref)}
        rows = []
        # (sequences, tokens, anchors) of four micro-batches: a new shape each, as a run's steps.
        for i, (n, tokens, anchors) in enumerate(((2, 160, 8), (1, 128, 6), (3, 192, 10), (2, 144, 7)) if smoke else
                                                  ((2, 512, 16), (1, 384, 12), (3, 640, 20), (2, 448, 24))):
            batch = make_batch(dict(s, tokens=tokens, anchors=anchors), n, seed=1 + i).to(device)
            flex_loss, flex = loss_and_grads(drafter, batch, "flex")
            split_loss, split = loss_and_grads(drafter, batch, "split")
            rows.append({"sequences": n, "tokens": tokens, "anchors": anchors,
                         "loss_rel_diff": abs(flex_loss - split_loss) / abs(split_loss),
                         "max_rel_grad_diff": rel_grad_diff(flex, split)})
    out["flex_vs_split"] = {"shapes": rows, "flex": "compiled" if device.type == "cuda" else "eager (CPU)",
                            "flex_graphs_compiled": graphs_since(before)}
    return {"shape": s, "fp32": True, **out}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def steps(device, s: dict, micro: int, repeats: int, draft_vocab: int | None = None, labels_below: int | None = None) -> dict:
    drafter = make_drafter(s, device)
    if draft_vocab is not None:  # the first K ids: labels_below <= K keeps every label inside
        drafter = with_draft_vocab(drafter, DraftVocab(torch.arange(draft_vocab), s["vocab"]))
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    packed = make_batch(s, micro, vocab=drafter.draft_vocab, labels_below=labels_below).to(device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    times = []
    before = flex_graphs()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(repeats + 1):  # the first compiles flex attention: not timed
        sync(device)
        start = time.perf_counter()
        with autocast:
            final = final_hidden(drafter, packed)
        loss, _ = supervised_loss(final, drafter.lm_head_weight, packed.labels, packed.weights)
        (loss / packed.weights.sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        if i:
            times.append(time.perf_counter() - start)
    tokens = micro * s["tokens"]
    out = {"micro_batch": micro, "fits": True, "seconds_per_step": round(float(np.median(times)), 4),
           "tokens_per_s": round(tokens / float(np.median(times)), 1), "loss": float(loss / packed.weights.sum()),
           "attention_path": attention_path(drafter.attention, device), "flex_graphs_compiled": graphs_since(before)}
    if device.type == "cuda":
        out["peak_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


def flagship(device, smoke: bool, repeats: int) -> list[dict]:
    s = SMOKE if smoke else FLAGSHIP
    rows = []
    for micro in (1, 2, 4, 8):
        try:
            rows.append(steps(device, s, micro, repeats))
        except torch.OutOfMemoryError as e:
            rows.append({"micro_batch": micro, "fits": False, "error": str(e).splitlines()[0][:200]})
            break
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if smoke and micro == 2:
            break
    return rows


def draft_vocab_steps(device, smoke: bool, repeats: int) -> list[dict]:
    s = SMOKE if smoke else FLAGSHIP
    sizes = (64, 128) if smoke else (32_768, 65_536)
    rows = []
    for k in (None, sizes[1], sizes[0]):
        try:
            rows.append({"draft_vocab": k or s["vocab"], **steps(device, s, 1, repeats, k, labels_below=sizes[0])})
        except torch.OutOfMemoryError as e:
            rows.append({"draft_vocab": k or s["vocab"], "fits": False, "error": str(e).splitlines()[0][:200]})
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
    full = rows[0]
    for r in rows:
        if r.get("fits") and full.get("fits"):
            r["time_vs_full"] = round(r["seconds_per_step"] / full["seconds_per_step"], 3)
            if "peak_GiB" in r:
                r["peak_vs_full"] = round(r["peak_GiB"] / full["peak_GiB"], 3)
    return rows


def fused_losses(device, smoke: bool) -> dict:
    """Ours vs the fused kernels on the same final hidden states [N, H] (bf16) and lm_head."""
    s = SMOKE if smoke else FLAGSHIP
    n = s["anchors"] * (s["block"] - 1)  # supervised slots of one sequence
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    weight = (torch.randn(s["vocab"], s["hidden"], device=device) * 0.02).to(dtype)
    hidden = torch.randn(n, s["hidden"], device=device).to(dtype)
    labels = torch.randint(0, s["vocab"], (n,), device=device)

    def ours(h):
        loss, _ = supervised_loss(h[:, None], weight, labels[:, None], torch.ones(n, 1, device=device))
        return loss / n

    candidates = {"ours": ours}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss()
        candidates["liger_fused_linear_cross_entropy"] = lambda h: liger(weight, h, labels)
    except ImportError as e:
        candidates["liger_fused_linear_cross_entropy"] = f"not installed ({e})"
    try:
        from cut_cross_entropy import linear_cross_entropy
        candidates["cut_cross_entropy"] = lambda h: linear_cross_entropy(h, weight, labels)
    except ImportError as e:
        candidates["cut_cross_entropy"] = f"not installed ({e})"
    out, ref = {}, None
    for name, fn in candidates.items():
        if isinstance(fn, str) or device.type != "cuda" and name != "ours":
            out[name] = fn if isinstance(fn, str) else "needs a GPU"
            continue
        try:
            h = hidden.clone().requires_grad_(True)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            sync(device)
            start = time.perf_counter()
            loss = fn(h)
            loss.backward()
            sync(device)
            row = {"loss": float(loss), "seconds": round(time.perf_counter() - start, 4)}
            if device.type == "cuda":
                row["peak_above_inputs_GiB"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)
            if ref is None:
                ref = (float(loss), h.grad.float())
            else:
                row["loss_rel_diff_vs_ours"] = abs(float(loss) - ref[0]) / abs(ref[0])
                row["max_abs_grad_diff_vs_ours"] = float((h.grad.float() - ref[1]).abs().max())
            out[name] = row
        except Exception as e:  # a kernel that fails here is reported, not fatal to the other checks
            out[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return {"rows": n, "hidden": s["hidden"], "vocab": s["vocab"], "ours_path": LOSS_PATH, **out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="toy sizes (runs on a CPU)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per micro-batch size (after one untimed)")
    parser.add_argument("--out", type=Path, help="also write the result here as JSON (its folder must exist)")
    args = parser.parse_args()
    # Bad values end here in one line, not in a traceback after minutes on the GPU.
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.out is not None and (args.out.is_dir() or not args.out.parent.is_dir()):
        parser.error(f"--out must be a file in an existing folder, got {args.out}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("no GPU: run with --smoke for the toy sizes")
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "machine": describe_machine(), "packages": packages()}
    size = "smoke" if args.smoke else "gpu"
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        sections = (("extract", lambda: gpu_paths.extract_embedded(device, size, work)),
                    ("kernels", lambda: gpu_paths.kernels(device, size)),
                    ("equality", lambda: equality(device, args.smoke)),
                    ("flagship_steps", lambda: flagship(device, args.smoke, args.repeats)),
                    ("draft_vocab_steps", lambda: draft_vocab_steps(device, args.smoke, args.repeats)),
                    ("loss_kernels", lambda: fused_losses(device, args.smoke)),
                    ("train_and_eval", lambda: gpu_paths.train_and_eval(device, size, work)),
                    ("generate", lambda: gpu_paths.generate(device, size, work)))
        for name, check in sections:
            gpu_paths.reset_peak(device)
            start = time.perf_counter()
            try:
                result[name] = check()
                if isinstance(result[name], dict):
                    result[name].update(gpu_paths.peak(device))
            except Exception as e:  # one line in the summary; the other sections still run
                result[name] = f"failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
            result[f"{name}_wall_s"] = round(time.perf_counter() - start, 1)
            print(json.dumps({name: result[name]}), flush=True)
    result["failed"] = [name for name, _ in sections if isinstance(result[name], str) and result[name].startswith("failed")]
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


def packages() -> dict:
    """The versions a GPU node's offline wheels must match (README: Before your first GPU day);
    "not installed" where absent, the import error's first line where one fails."""
    import importlib
    import importlib.metadata as metadata

    out = {"cuda": torch.version.cuda}
    for name, module in (("flash-linear-attention", "fla"), ("causal-conv1d", "causal_conv1d"), ("triton", "triton"),
                         ("transformers", "transformers"), ("zarr", "zarr"), ("numcodecs", "numcodecs"),
                         ("obstore", "obstore")):
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
            continue
        try:
            importlib.import_module(module)
            out[name] = version
        except Exception as e:  # noqa: BLE001 - a wheel built for another CUDA fails in many ways
            out[name] = f"{version}, import failed: {(str(e).splitlines() or [''])[0][:160]}"
    return out


if __name__ == "__main__":
    main()
