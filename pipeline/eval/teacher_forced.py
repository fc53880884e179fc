"""A trained drafter's training metrics on a cache, at every valid anchor (no sampling), and the
tau that replaying decoding over those teacher-forced streaks gives (`pipeline eval --cache`)."""

from __future__ import annotations


import numpy as np
import torch

from pipeline.cache.reader import CacheReader
from pipeline.cache.schema import HIDDEN, INPUT_IDS, SAMPLE_ID
from pipeline.projection.basis_file import cache_basis
from pipeline.training.batch import anchor_generator, forward_logits, pack, prepare
from pipeline.errors import PipelineError
from pipeline.training.metrics import add_sums, finish_metrics, metric_sums


@torch.no_grad()
def teacher_forced(drafter, reader: CacheReader, *, im_start: int, last_turn_only: bool = True) -> dict:
    """The training metrics of `drafter` on a cache (opened by the caller, so that a cache it
    cannot use is refused before any decoding), every valid anchor (no sampling), optionally only
    anchors in each sample's last assistant turn (the turn `run_eval` generates)."""
    c, sums, walk_tokens, walk_steps = drafter.config, None, 0, 0
    context = context_of(drafter, reader)
    for name in reader.shards:
        shard = reader.shard(name, chunk_cache_bytes=64 * 2**20)
        for sid in map(int, shard.sample_ids):
            sample = {**shard.sample(sid), SAMPLE_ID: sid}
            sample[HIDDEN] = context(sample[HIDDEN])
            seq = prepare(sample, block_size=c.block_size, num_anchors=2**31, max_length=2**31,
                          mask_token_id=c.mask_token_id, gamma=4.0, generator=anchor_generator(0, 0, sid))
            if seq is None:
                continue
            batch = pack([seq], c.block_size)
            logits = forward_logits(drafter, batch)
            keep = torch.ones(len(seq.anchors), dtype=torch.bool)
            if last_turn_only:
                starts = np.nonzero(sample[INPUT_IDS] == im_start)[0]
                keep = seq.anchors > int(starts[-1]) if len(starts) else keep
            if keep.any():
                sums = add_sums(sums, metric_sums(logits[keep], batch.labels[keep], batch.weights[keep]))
                walk = _walk(seq.anchors[keep].tolist(), logits[keep], batch.labels[keep], batch.weights[keep])
                walk_tokens, walk_steps = walk_tokens + walk[0], walk_steps + walk[1]
    if sums is None:
        raise PipelineError(f"{reader.dir}: no sample with a valid anchor")
    metrics = finish_metrics(sums)
    return {**metrics, "tau_estimate": metrics["avg_streak"] + 1, "tau_walk": walk_tokens / max(walk_steps, 1),
            "anchors": int(sums["blocks"]), "last_turn_only": last_turn_only}


def context_of(drafter, reader: CacheReader):
    """What the drafter's fc takes, from what the cache stores: the taps as stored; on a projected
    cache, the taps the projection stands for (an exported drafter's fc is folded: it reads full
    taps), or the projection itself for a drafter not folded yet (a checkpoint's, of that basis)."""
    basis, c = cache_basis(reader), drafter.config
    if basis is None:
        if c.projected_rank is not None:
            raise PipelineError(f"{reader.dir}: stores the taps whole, and this drafter was written before its "
                                f"fc was folded (it reads {c.projected_rank} projected values a token): use its run's "
                                "final export (RUN/drafter)")
        return lambda hidden: hidden
    if c.projected_rank is None:
        n_taps = len(reader.manifest.identity.capture.target_layer_ids)
        return lambda hidden: basis.reconstruct(hidden, n_taps)
    if c.projected_rank != basis.projected_rank:
        raise PipelineError(f"{reader.dir}: stores {basis.projected_rank} projected values a token, this drafter's fc reads "
                            f"{c.projected_rank}")
    drafter.use_basis(basis)
    return lambda hidden: hidden


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
