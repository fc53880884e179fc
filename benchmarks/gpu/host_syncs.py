"""Host syncs per generated token (eval's decoders) and per training step, counted under the
simulated accelerator (harness/simulated_device.py): every `.item()`, `float()`, `int()`,
`bool()`, `.tolist()`, `.cpu()` of a device tensor and every op whose output size depends on its
values. On a GPU each one makes the host wait for the device's queue to drain; counted, not
timed, so the figures are exact and the same on any machine.

  python benchmarks/gpu/host_syncs.py [--prompts 4] [--max-new 32] [--out syncs.json]

Decoding: the embedded target and a drafter trained briefly here (the tiny preset, 60 steps on 48
conversations: enough that drafts are accepted, so a verify step emits several tokens), the
first held-out prompts, greedy and sampled (temperature 1), block and DDTree (budget 16; tree
and paths verification), one prompt per pass and all of them in one batch. Training: the
difference between runs of 40 and 20 steps, divided by 20 (setup, checkpoints and the export
cancel out; a log line every 10 steps stays in).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from harness.runs import small_cache  # noqa: E402
from harness.simulated_device import simulated_accelerator  # noqa: E402
from pipeline import embedded  # noqa: E402
from pipeline.data.prompts import read_prompts  # noqa: E402
from pipeline.drafter.export import load_drafter  # noqa: E402
from pipeline.eval.batched import decode_rows  # noqa: E402
from pipeline.eval.speculative_decoding import block_decode, greedy, tree_decode  # noqa: E402
from pipeline.eval.speculative_sampling import SpeculativeSampler  # noqa: E402
from pipeline.target_model import end_of_turn_ids, frozen_target_modules, load_target, load_tokenizer  # noqa: E402
from pipeline.target_model.live import LiveTarget  # noqa: E402
from stages.train.run import resolve_config, run_train  # noqa: E402


def train_syncs(root: Path, rows: list[dict], steps: int) -> int:
    with simulated_accelerator() as sim:
        cfg, preset_target = resolve_config(None, {"cache": str(root / "cache"), "out": str(root / f"run{steps}"),
                                                   "max_steps": steps, "log_every": 10})
        run_train(cfg, preset_target=preset_target, warn=lambda *_: None)
        return sim.syncs.total


def decode_syncs(run: Path, prompts: list[list[int]], max_new: int) -> dict:
    tokenizer = load_tokenizer(embedded.TARGET_DIR)
    eos = end_of_turn_ids(tokenizer)
    out = {}
    with simulated_accelerator() as sim:
        embed, head = frozen_target_modules(embedded.TARGET_DIR)
        drafter = load_drafter(run / "drafter", embed=embed, lm_head=head).to(sim.device).eval()
        live = LiveTarget(load_target(embedded.TARGET_DIR, dtype=torch.float32).to(sim.device), drafter.config.target_layer_ids)
        for mode, sampling in (("greedy", None), ("sampled", SpeculativeSampler(temperature=1.0, seed=0))):
            variants = {
                "plain": lambda p, i: greedy(live, p, max_new=max_new, eos=eos, sampling=sampling, row=i),
                "block": lambda p, i: block_decode(live, drafter, p, max_new=max_new, eos=eos, sampling=sampling, row=i),
                "ddtree16 tree": lambda p, i: tree_decode(live, drafter, p, max_new=max_new, eos=eos, budget=16,
                                                          verify="tree", sampling=sampling, row=i),
                "ddtree16 paths": lambda p, i: tree_decode(live, drafter, p, max_new=max_new, eos=eos, budget=16,
                                                           verify="paths", sampling=sampling, row=i),
            }
            for name, decode in variants.items():
                sim.syncs.reset()
                results = [decode(p, i) for i, p in enumerate(prompts)]
                out[f"{mode} {name}"] = _figures(sim.syncs, results)
            for name, budget in (("block", None), ("ddtree16", 16)):
                sim.syncs.reset()
                results = decode_rows(live, drafter, prompts, max_new=max_new, eos=eos, budget=budget, sampling=sampling)
                out[f"{mode} {name} batch {len(prompts)}"] = _figures(sim.syncs, results)
    return out


def _figures(syncs, results) -> dict:
    tokens = sum(len(r.tokens) for r in results)
    steps = sum(r.verify_passes for r in results) or tokens   # plain decoding: a pass a token
    return {"syncs": syncs.total, "tokens": tokens, "steps": steps, "per_token": round(syncs.total / tokens, 3),
            "per_step": round(syncs.total / steps, 3), "by_kind": dict(syncs.counts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts decoded per variant (default 4)")
    parser.add_argument("--max-new", type=int, default=32, help="new tokens per prompt at most (default 32)")
    parser.add_argument("--out", type=Path, help="also write the figures here as JSON (its folder must exist)")
    args = parser.parse_args()
    if args.prompts < 1 or args.max_new < 1:
        parser.error(f"--prompts and --max-new must be at least 1, got {args.prompts} and {args.max_new}")
    if args.out is not None and (args.out.is_dir() or not args.out.parent.is_dir()):
        parser.error(f"--out must be a file in an existing folder, got {args.out}")
    rows = [json.loads(line) for line in Path(embedded.TRAIN_DATA).read_text().splitlines()[:48]]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        small_cache(root, rows, 2)
        with simulated_accelerator():
            cfg, preset_target = resolve_config(None, {"cache": str(root / "cache"), "out": str(root / "run"),
                                                       "max_steps": 60, "log_every": 10})
            run_train(cfg, preset_target=preset_target, warn=lambda *_: None)
        per_step = (train_syncs(root, rows, 40) - train_syncs(root, rows, 20)) / 20
        tokenizer = load_tokenizer(embedded.TARGET_DIR)
        prompts = [p["ids"] for p in read_prompts(embedded.HELDOUT_DATA, tokenizer, args.prompts)]
        summary = {"train_syncs_per_step": per_step, "decode": decode_syncs(root / "run", prompts, args.max_new),
                   "prompts": len(prompts), "max_new": args.max_new}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
