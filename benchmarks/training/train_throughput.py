"""Drafter training throughput, measured side by side in one run.

    python benchmarks/training/train_throughput.py [--cache DIR] [--steps 12] [--json]

On a cache of the embedded tiny target (extracted here from its training conversations unless
--cache is given), with the `tiny` preset's drafter and batch:

1. Batched anchors vs a per-anchor loop: the trainer's step (all anchors of a micro-batch in one
   padded forward with the block-sparse mask) against the straightforward implementation (one
   forward per anchor over the context before it), on the same samples and anchors, same loss
   normalisation, forward + backward + optimizer step. Their losses are printed to show they
   compute the same thing.
2. Loader vs trainer: the streaming reader alone (decode + anchor/mask preparation on its thread,
   drained as fast as possible) against what the trainer consumes, and the trainer fed from the
   cache stream against the same batches already in memory (goal: >= 0.95, the loader is never
   the bottleneck): read ahead on a thread, read in the training thread (`prefetch` 0, the CPU's
   default), and in one loader process.

Rounds alternate between the variants so machine drift hits both.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.cache.reader import CacheReader
from pipeline.config import ExtractConfig
from pipeline.drafter.model import DFlashDrafter
from pipeline.training.objectives import weighted_ce
from pipeline.training.stream import ACCELERATOR_READ_AHEAD, SampleStream, StreamState
from pipeline.target_model import read_target_facts, recorded_in_cache, resolve_target
from stages.extract.run import run_extract
from pipeline.training.drafter_shape import drafter_config
from pipeline.training.plan import make_plan
from pipeline.training.step import StepRunner
from pipeline.target_model import frozen_target_modules
from stages.train.run import resolve_config


def cache_or_extract(cache: Path | None, tmp: str) -> Path:
    """The given cache, or the embedded target's training conversations extracted into 8 shards under tmp."""
    if cache is not None:
        return cache
    cache = Path(tmp) / "cache"
    run_extract(ExtractConfig(cache=str(cache), num_shards=8), None, progress=False)
    return cache


def setup(cache: Path, device: torch.device | None = None):
    """The tiny preset's config, reader and step runner on `device` (default: the GPU if any, else the CPU)."""
    cfg, _ = resolve_config(None, {"cache": str(cache), "out": str(cache.parent / "run")})
    reader = CacheReader(cache)
    target = resolve_target(cfg.job.target, recorded_in_cache(reader.manifest))
    facts = read_target_facts(target)
    config = drafter_config(cfg.drafter, facts, target, reader.manifest.identity.capture.target_layer_ids)
    embed, head = frozen_target_modules(target)
    torch.manual_seed(0)
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    drafter = DFlashDrafter(config, embed=embed, lm_head=head).to(device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.optimizer.lr)
    plan = make_plan(cfg.schedule, cfg.optimizer, sum(reader.manifest.shards[s].samples for s in reader.shards), 1)
    runner = StepRunner(plan, drafter, optimizer, params, device, 0, 1, objective=cfg.objective, optimization=cfg.optimizer,
                        data=cfg.data, seed=cfg.job.seed, dtype=cfg.job.dtype, gamma=cfg.objective.gamma)
    return cfg, reader, runner


def stream_batches(cfg, reader, runner, steps: int, workers: int = 0, prefetch: int = ACCELERATOR_READ_AHEAD):
    """The first `steps` global batches of epoch 0 as the trainer gets them: read on a thread
    (`prefetch` ahead), in this thread (`prefetch=0`) or in `workers` processes."""
    stream = SampleStream(reader, seed=cfg.job.seed, state=StreamState(), prefetch=prefetch,
                          transform=runner.preparer(0), workers=workers)
    items = stream.epoch()
    try:
        for _ in range(steps):
            yield [next(items)[1] for _ in range(cfg.schedule.batch_sequences)]
    finally:
        items.close()


def per_anchor_step(runner, batch, cfg) -> float:
    """The straightforward loop: one forward per anchor over the context before it."""
    drafter, b = runner.drafter, cfg.drafter.block_size
    seqs = [seq for _, seq in batch if seq is not None]
    total_w = sum(float(s.weights.sum()) for s in seqs)
    runner.optimizer.zero_grad(set_to_none=True)
    loss_value = 0.0
    for seq in seqs:
        block_ids, block_pos = seq.block_ids.view(-1, b), seq.block_pos.view(-1, b)
        parts = []
        for j in range(len(block_ids)):
            a = int(block_pos[j, 0])
            d = runner.device
            logits = drafter(seq.hidden[None, :a].to(d), block_ids[j][None].to(d), block_pos[j][None].to(d),
                             torch.ones(1, b, a + b, dtype=torch.bool, device=d))
            parts.append(weighted_ce(logits.view(1, b, -1), seq.labels[j:j + 1].to(d), seq.weights[j:j + 1].to(d))
                         * seq.weights[j].sum())
        loss = torch.stack(parts).sum() / total_w
        loss.backward()
        loss_value += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(runner.params, cfg.grad_clip)
    runner.optimizer.step()
    return loss_value


def tokens(batch) -> int:
    return sum(seq.num_tokens for _, seq in batch if seq is not None)


def anchors(batch) -> int:
    return sum(seq.labels.shape[0] for _, seq in batch if seq is not None)


def timed(fn):
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, help="a cache of the embedded target (default: extract one here)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per measurement")
    parser.add_argument("--loop-steps", type=int, default=2, help="steps for the (slow) per-anchor loop")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds alternating the variants; medians are reported (default %(default)s)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON, not as a table")
    args = parser.parse_args()
    # Bad values end here in one line, not in a traceback after the setup.
    if args.cache is not None and not (args.cache / "manifest.json").is_file():
        parser.error(f"--cache: no cache at {args.cache} (no manifest.json)")
    for name in ("steps", "loop_steps", "rounds", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        cfg, reader, runner = setup(cache_or_extract(args.cache, tmp))
        batches = list(stream_batches(cfg, reader, runner, args.steps))
        rows = {"batched_tok_s": [], "loop_tok_s": [], "loader_tok_s": [], "trainer_mem_tok_s": [],
                "trainer_stream_thread_tok_s": [], "trainer_stream_inline_tok_s": [], "trainer_stream_process_tok_s": []}
        losses = {}
        for _ in range(args.rounds):
            # 1. Batched anchors vs per-anchor loop, same first batches.
            few = batches[:args.loop_steps]
            start = copy.deepcopy((runner.drafter.state_dict(), runner.optimizer.state_dict()))
            seconds, loss = timed(lambda: [runner.step(b, 0, with_metrics=False)["local_loss"] for b in few])
            rows["batched_tok_s"].append(sum(map(tokens, few)) / seconds)
            losses["batched"] = [x / sum(float(s.weights.sum()) for _, s in b if s is not None) for x, b in zip(loss, few)]
            runner.drafter.load_state_dict(start[0])
            runner.optimizer.load_state_dict(start[1])  # the same weights for both variants
            seconds, loss = timed(lambda: [per_anchor_step(runner, b, cfg) for b in few])
            rows["loop_tok_s"].append(sum(map(tokens, few)) / seconds)
            losses["loop"] = loss
            # 2. Loader alone, trainer from memory, trainer from the stream.
            seconds, drained = timed(lambda: list(stream_batches(cfg, reader, runner, args.steps)))
            rows["loader_tok_s"].append(sum(map(tokens, drained)) / seconds)
            fresh = list(stream_batches(cfg, reader, runner, args.steps))  # untouched copies (noise-free)
            seconds, _ = timed(lambda: [runner.step(b, i, with_metrics=False) for i, b in enumerate(fresh)])
            rows["trainer_mem_tok_s"].append(sum(map(tokens, fresh)) / seconds)
            for name, workers, prefetch in (("thread", 0, ACCELERATOR_READ_AHEAD), ("inline", 0, 0), ("process", 1, ACCELERATOR_READ_AHEAD)):
                seconds, count = timed(lambda: sum(tokens(b) for b in stream_batches(cfg, reader, runner, args.steps, workers, prefetch)
                                                   if runner.step(b, 0, with_metrics=False)))
                rows[f"trainer_stream_{name}_tok_s"].append(count / seconds)
        med = {k: statistics.median(v) for k, v in rows.items()}
        result = {
            "cache_samples": sum(reader.manifest.shards[s].samples for s in reader.shards),
            "batch_sequences": cfg.schedule.batch_sequences, "micro_batch_sequences": cfg.schedule.micro_batch_sequences,
            "anchors_per_step": statistics.mean(map(anchors, batches)), "tokens_per_step": statistics.mean(map(tokens, batches)),
            "threads": torch.get_num_threads(), "rounds": args.rounds, "steps": args.steps,
            **{k: round(v, 1) for k, v in med.items()},
            "batched_over_loop": round(med["batched_tok_s"] / med["loop_tok_s"], 2),
            "loader_over_trainer": round(med["loader_tok_s"] / med["trainer_mem_tok_s"], 2),
            "stream_thread_over_memory": round(med["trainer_stream_thread_tok_s"] / med["trainer_mem_tok_s"], 3),
            "stream_inline_over_memory": round(med["trainer_stream_inline_tok_s"] / med["trainer_mem_tok_s"], 3),
            "stream_process_over_memory": round(med["trainer_stream_process_tok_s"] / med["trainer_mem_tok_s"], 3),
            "loss_batched_vs_loop": [[round(a, 5), round(b, 5)] for a, b in zip(losses["batched"], losses["loop"])],
        }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    from pipeline.ui import console, key_value_table
    console.print(key_value_table("train throughput", list(result.items())))


if __name__ == "__main__":
    main()
