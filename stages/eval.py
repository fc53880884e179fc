"""`pipeline eval`: real speculative decoding against the live target, greedy.

For every prompt: plain greedy decoding (the reference and the speed baseline), block
speculative decoding with the drafter, and DDTree at each node budget. Every speculative output
is compared token for token with greedy (speculative decoding is lossless; a difference is a
bug and is reported). tau (accepted draft tokens + 1 per verify step) is reported as the mean
of per-response means (as the DFlash paper does) and pooled over all steps.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from pipeline.data.conversations import iter_rows
from pipeline.data.loss_mask import render, template_message
from pipeline.drafter.export import load_drafter
from pipeline.devices import resolve_device
from pipeline.errors import PipelineError
from pipeline.speculative.batched import decode_rows
from pipeline.speculative.decode import TREE_VERIFY, Decoded, block_decode, choose_tree_verify, greedy, tree_decode
from pipeline.speculative.live_target import LiveTarget
from pipeline.tracking import parse_report_to, report_eval, tracker_class
from pipeline.target import RecordedTarget, load_model, load_tokenizer, read_target_facts, resolve_target
from pipeline.transformers_internals import takes_mask


def target_mismatch(target_dir: Path, run: Path) -> str | None:
    """How the eval target differs from the one the drafter's training run recorded (its config.json
    digest, and the weights the cache was extracted with), or None when it is the same or the run
    recorded neither. Large checkpoints are compared by their safetensors headers and sizes
    (pipeline.provenance.weight_digests), which tell other shapes apart but not other values."""
    from pipeline.provenance import weight_digests

    try:
        record = json.loads(run.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    differs = []
    if record.get("target_config_sha256") and record["target_config_sha256"] != read_target_facts(target_dir).config_sha256:
        differs.append("config.json")
    recorded = record.get("target_weights") or {}
    if recorded.get("files"):
        found = weight_digests(target_dir)
        if found["method"] != recorded.get("method") or found["files"] != recorded["files"]:
            names = sorted(n for n in set(found["files"]) | set(recorded["files"])
                           if found["files"].get(n) != recorded["files"].get(n)) or ["weight files"]
            differs.append(f"weights ({', '.join(names[:3])}{' ...' if len(names) > 3 else ''})")
    return " and ".join(differs) or None


def resolve_drafter(path: Path) -> tuple[Path, RecordedTarget | None]:
    """(drafter export dir, the target its training run recorded): accepts RUN/ or RUN/drafter/."""
    path = Path(path)
    if (path / "drafter" / "config.json").is_file():
        path = path / "drafter"
    if not (path / "config.json").is_file():
        raise PipelineError(f"{path}: not a drafter export (no config.json); pass the run directory or its drafter/")
    run = path.parent / "run.json"
    recorded = None
    if run.is_file():
        try:
            record = json.loads(run.read_text())
            recorded = RecordedTarget(path=record["target"], config_sha256=record.get("target_config_sha256"),
                                      source=str(run))
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError):
            raise PipelineError(f"{run}: not a training run record (no 'target')") from None
    return path, recorded


def read_prompts(path: Path, tokenizer, limit: int | None) -> list[dict]:
    """Conversations -> prompts: everything before the last assistant turn, rendered with the
    chat template's generation prompt and the row's tools and chat_template_kwargs. Rows are read
    by extract's parser (`messages` or ShareGPT `conversations`, JSONL or Parquet, tool-call
    arguments as objects), so any row extract accepts is a prompt here; one-line errors name the
    file and line."""
    prompts = []
    for row in iter_rows([Path(path)], need_answer=False):
        if row.messages is None:
            raise PipelineError(f"{row.where}: a pre-tokenized row (input_ids) has no conversation to prompt with")
        messages = row.messages[:-1] if row.messages and row.messages[-1]["role"] == "assistant" else row.messages
        if not messages:
            raise PipelineError(f"{row.where}: nothing before the assistant turn to use as a prompt")
        try:
            text = render(tokenizer, messages, generation_prompt=True, tools=row.tools, template_kwargs=row.template_kwargs)
        except Exception as e:  # noqa: BLE001 - templates raise many types
            raise PipelineError(f"{row.where}: the chat template cannot render this prompt ({template_message(e)})") from None
        prompts.append({"id": row.row_id if row.row_id is not None else row.where,
                        "ids": tokenizer(text, add_special_tokens=False)["input_ids"]})
        if limit and len(prompts) >= limit:
            break
    if not prompts:
        raise PipelineError(f"{path}: no prompts")
    return prompts


def summarise(runs: list[Decoded], reference: list[Decoded], seconds: float, greedy_seconds: float, block: int) -> dict:
    per_response = [statistics.mean(a + 1 for a in r.accepted) for r in runs if r.accepted]
    steps = [a + 1 for r in runs for a in r.accepted]
    tokens = sum(len(r.tokens) for r in runs)
    histogram = {str(k): 0 for k in range(1, block + 1)}
    for s in steps:
        histogram[str(s)] = histogram.get(str(s), 0) + 1
    mismatches = [i for i, (r, g) in enumerate(zip(runs, reference)) if r.tokens != g.tokens]
    return {
        "tau_mean_of_means": statistics.mean(per_response) if per_response else 0.0,
        "tau_pooled": statistics.mean(steps) if steps else 0.0,
        "accept_histogram": histogram,
        "verify_passes_per_token": sum(r.verify_passes for r in runs) / max(tokens, 1),
        "target_tokens_per_verify": sum(r.verify_tokens for r in runs) / max(sum(r.verify_passes for r in runs), 1),
        "target_passes_per_token": sum(r.target_passes for r in runs) / max(tokens, 1),
        "tokens": tokens, "wall_s": seconds, "tokens_per_s": tokens / max(seconds, 1e-9),
        "speedup_vs_greedy": greedy_seconds / max(seconds, 1e-9),
        "identical_to_greedy": len(runs) - len(mismatches), "mismatched_prompts": mismatches[:20],
    }


@torch.no_grad()
def teacher_forced(drafter, cache_dir: Path, *, im_start: int, last_turn_only: bool = True) -> dict:
    """The training metrics of `drafter` on a cache, every valid anchor (no sampling), optionally
    only anchors in each sample's last assistant turn (the turn `run_eval` generates)."""
    import numpy as np

    from pipeline.cache.reader import CacheReader
    from pipeline.drafter.batch import anchor_generator, forward_logits, pack, prepare
    from pipeline.drafter.metrics import add_sums, finish_metrics, metric_sums

    c, sums, walk_tokens, walk_steps = drafter.config, None, 0, 0
    reader = CacheReader(cache_dir)
    for name in reader.shards:
        shard = reader.shard(name, chunk_cache_bytes=64 * 2**20)
        for sid in map(int, shard.sample_ids):
            sample = {**shard.sample(sid), "sample_id": sid}
            seq = prepare(sample, block_size=c.block_size, num_anchors=2**31, max_length=2**31,
                          mask_token_id=c.mask_token_id, gamma=4.0, generator=anchor_generator(0, 0, sid))
            if seq is None:
                continue
            batch = pack([seq], c.block_size)
            logits = forward_logits(drafter, batch)
            keep = torch.ones(len(seq.anchors), dtype=torch.bool)
            if last_turn_only:
                starts = np.nonzero(sample["input_ids"] == im_start)[0]
                keep = seq.anchors > int(starts[-1]) if len(starts) else keep
            if keep.any():
                sums = add_sums(sums, metric_sums(logits[keep], batch.labels[keep], batch.weights[keep]))
                walk = _walk(seq.anchors[keep].tolist(), logits[keep], batch.labels[keep], batch.weights[keep])
                walk_tokens, walk_steps = walk_tokens + walk[0], walk_steps + walk[1]
    if sums is None:
        raise PipelineError(f"{cache_dir}: no sample with a valid anchor")
    metrics = finish_metrics(sums)
    return {**metrics, "tau_estimate": metrics["avg_streak"] + 1, "tau_walk": walk_tokens / max(walk_steps, 1),
            "anchors": int(sums["blocks"]), "last_turn_only": last_turn_only}


def _walk(anchors: list[int], logits, labels, weights) -> tuple[int, int]:
    """Replay decoding on teacher-forced streaks: start at the first anchor, accept its streak plus
    the bonus token, continue at the next position, stop where no block can start (the end of the
    response). Returns (tokens, steps). Uniform anchors weight easy stretches by their length;
    decoding crosses them in few steps, so this walk, not avg_streak + 1, is what tau should equal."""
    ok = (logits.argmax(-1) == labels) & (weights > 0)
    streak = dict(zip(anchors, ok[:, 1:].int().cumprod(dim=1).sum(dim=1).tolist()))
    tokens = steps = 0
    a = anchors[0]
    while a in streak:
        tokens += streak[a] + 1
        steps += 1
        a += streak[a] + 1
    return tokens, steps


def run_eval(drafter_path: Path, *, target: Path | None, prompts: Path | None, max_new_tokens: int,
             block_size: int | None, tree_budgets: list[int], tree_top_k: int, limit: int | None,
             cache: Path | None = None, progress=None, device: str = "auto", dtype: str = "auto",
             tree_verify: str = "auto", batch_size: int = 1, warn=None, report_to: list[str] | None = None) -> dict:
    from pipeline.embedded import HELDOUT_DATA
    from stages.train import frozen_target_modules

    device_, dtype_ = resolve_device(device, dtype)
    if tree_verify not in (*TREE_VERIFY, "auto"):
        raise PipelineError(f"--tree-verify: must be one of {', '.join(TREE_VERIFY)}, auto; got {tree_verify!r}")
    if batch_size < 1:
        raise PipelineError(f"--batch-size must be >= 1, got {batch_size}")
    if batch_size > 1 and tree_verify == "paths":
        raise PipelineError("--batch-size > 1 verifies each prompt's tree in one pass over its nodes: use --tree-verify tree")

    drafter_dir, recorded = resolve_drafter(drafter_path)
    report_to = parse_report_to(report_to)
    for name in report_to:  # a missing extra or a drafter without its run: one line before any decoding
        tracker_class(name).check_installed()
    if report_to and not (drafter_dir.parent / "train_log.jsonl").is_file():
        raise PipelineError(f"{drafter_dir}: --report-to needs the drafter's training run (RUN/train_log.jsonl beside it)")
    target_dir = resolve_target(target, recorded)
    facts = read_target_facts(target_dir)
    mismatch = target_mismatch(target_dir, Path(recorded.source)) if recorded else None
    if mismatch and warn:
        warn(f"the target {target_dir} is not the one this drafter was trained against ({recorded.source} recorded "
             f"{recorded.path}): its {mismatch} differ; decoding stays lossless, but the drafts were learned for another model")
    embed, head = frozen_target_modules(target_dir, dtype_)
    drafter = load_drafter(drafter_dir, embed=embed, lm_head=head).to(device_, dtype_).eval()
    c = drafter.config
    if (c.hidden_size, c.vocab_size) != (facts.hidden_size, facts.vocab_size) or max(c.target_layer_ids) >= facts.num_hidden_layers - 1:
        raise PipelineError(f"{drafter_dir}: drafter (hidden {c.hidden_size}, vocab {c.vocab_size}, taps "
                            f"{c.target_layer_ids}) does not fit target {target_dir} (hidden {facts.hidden_size}, "
                            f"vocab {facts.vocab_size}, {facts.num_hidden_layers} layers)")
    block = block_size or c.block_size
    if not 2 <= block <= c.block_size:
        raise PipelineError(f"--block-size must be in 2..{c.block_size} (the block this drafter was trained on), got {block}")
    if any(b < 1 for b in tree_budgets):
        raise PipelineError(f"--tree-budget values must be >= 1, got {tree_budgets}")
    c.block_size = block
    tokenizer = load_tokenizer(target_dir)
    model = load_model(target_dir, dtype=dtype_).to(device_)
    live = LiveTarget(model, c.target_layer_ids)
    tree_verify_reason = "asked for"
    if tree_verify == "auto":
        embeddings = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
                      for p in m.parameters()}
        body = sum(p.numel() for p in model.parameters() if id(p) not in embeddings)
        tree_verify, tree_verify_reason = choose_tree_verify(body, batch_size=batch_size, takes_mask=takes_mask(model))
    if (tree_budgets or batch_size > 1) and tree_verify == "tree" and not takes_mask(model):
        raise PipelineError("the target's attention implementation takes no tree mask (sdpa and eager do): "
                            "use --tree-verify paths and --batch-size 1")
    eos = {i for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")) if isinstance(i, int)}
    items = read_prompts(Path(prompts) if prompts else HELDOUT_DATA, tokenizer, limit)

    reference, blocks, trees = [], [], {b: [] for b in tree_budgets}
    seconds = {"greedy": 0.0, "block": 0.0, **{f"tree{b}": 0.0 for b in tree_budgets}}
    for first in range(0, len(items), batch_size):
        # Variants alternate per prompt (per batch of prompts), so machine drift hits them all alike.
        chunk = [item["ids"] for item in items[first:first + batch_size]]
        t0 = time.perf_counter()
        reference += [greedy(live, ids, max_new=max_new_tokens, eos=eos) for ids in chunk]
        seconds["greedy"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        if batch_size > 1:
            blocks += decode_rows(live, drafter, chunk, max_new=max_new_tokens, eos=eos)
        else:
            blocks.append(block_decode(live, drafter, chunk[0], max_new=max_new_tokens, eos=eos))
        seconds["block"] += time.perf_counter() - t0
        for b in tree_budgets:
            t0 = time.perf_counter()
            if batch_size > 1:
                trees[b] += decode_rows(live, drafter, chunk, max_new=max_new_tokens, eos=eos, budget=b, top_k=tree_top_k)
            else:
                trees[b].append(tree_decode(live, drafter, chunk[0], max_new=max_new_tokens, eos=eos, budget=b,
                                            top_k=tree_top_k, verify=tree_verify))
            seconds[f"tree{b}"] += time.perf_counter() - t0
        if progress:
            new_tokens = sum(len(r.tokens) for r in blocks[-len(chunk):])
            steps = [a + 1 for r in blocks for a in r.accepted]
            progress(len(chunk), tokens=new_tokens, note=f"block tau {sum(steps) / max(len(steps), 1):.2f}")
    greedy_tokens = sum(len(r.tokens) for r in reference)
    extra = {}
    if cache is not None:
        extra["teacher_forced"] = teacher_forced(drafter, cache, im_start=tokenizer.convert_tokens_to_ids("<|im_start|>"))
    result = {**extra,
        "drafter": str(drafter_dir), "target": str(target_dir),
        "target_differs_from_training": mismatch,     # None: the same config and weights as the run recorded
        "prompts": len(items), "block_size": block,
        "max_new_tokens": max_new_tokens,
        "device": f"{device_} ({str(dtype_).removeprefix('torch.')})", "cpu_threads": torch.get_num_threads(),
        "drafter_kv_cache": True,
        "tree_verify": tree_verify, "tree_verify_reason": tree_verify_reason, "batch_size": batch_size,
        "greedy": {"tokens": greedy_tokens, "wall_s": seconds["greedy"], "tokens_per_s": greedy_tokens / max(seconds["greedy"], 1e-9),
                   "target_passes_per_token": sum(r.target_passes for r in reference) / max(greedy_tokens, 1)},
        "block": summarise(blocks, reference, seconds["block"], seconds["greedy"], block),
        "tree": {str(b): {**summarise(trees[b], reference, seconds[f"tree{b}"], seconds["greedy"], block), "top_k": tree_top_k}
                 for b in tree_budgets},
        "lossless": all(r.tokens == g.tokens for runs in [blocks, *trees.values()] for r, g in zip(runs, reference)),
    }
    if report_to:
        result["reported_to"] = {"trackers": report_to,
                                 "at_step": report_eval(report_to, run_dir=drafter_dir.parent, result=result, warn=warn)}
    return result
