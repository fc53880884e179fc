"""`pipeline cache-info LOCATION`: what a cache holds, from its records alone (never its arrays):
identity, completeness, provenance grouped by shard, counts and bytes (pipeline/cache/info.py).
With `--draft-vocab K[,K...]` it also reads the labels (the stored argmax and loss mask, one pass)
and reports the coverage each K's draft vocabulary would give (pipeline/training/draft_vocab.py):
how to size `pipeline train --draft-vocab` on a first real shard before training."""

from __future__ import annotations

from pipeline.cache.info import cache_info
from pipeline.cache.address import open_location


def run_cache_info(cache: str, draft_vocab: list[int] | None = None) -> dict:
    location = open_location(cache)
    location.check_reachable()  # no such directory, a missing bucket, refused credentials: one line
    info = cache_info(location)
    if draft_vocab:
        info["draft_vocab"] = draft_vocab_coverage(cache, draft_vocab)
    return info


def draft_vocab_coverage(cache: str, sizes: list[int]) -> dict:
    """{max_length, labels, distinct, rows: [{size, coverage, reserved, byte_fallbacks}]} for each
    K, chosen and counted as `pipeline train --draft-vocab K` would (at train's default max_length)."""
    from pipeline.cache.reader import open_cache
    from pipeline.config import TrainConfig
    from pipeline.target_model import load_tokenizer, read_target_facts, recorded_in_cache, resolve_target
    from pipeline.training.draft_vocab import check_size, count_labels, coverage, vocab_from_counts

    reader = open_cache(cache)
    target = resolve_target(None, recorded_in_cache(reader.manifest))
    vocab_size = read_target_facts(target).vocab_size
    tokenizer = load_tokenizer(target)
    mask = _mask_id(cache, target)
    max_length = TrainConfig.max_length
    for k in sizes:  # before the pass over the cache
        check_size(k, vocab_size)
    counts = count_labels(reader, vocab_size, max_length)
    rows = []
    for k in sizes:
        ids, kept = vocab_from_counts(counts, tokenizer, size=k, vocab_size=vocab_size, mask_id=mask)
        rows.append({"size": k, "coverage": round(coverage(counts, ids), 6), "reserved": len(kept["reserved"]),
                     "byte_fallbacks": len(kept["bytes"])})
    return {"max_length": max_length, "labels": int(counts.sum()), "distinct": int((counts > 0).sum()),
            "target_vocab": vocab_size, "rows": rows}


def _mask_id(cache: str, target) -> int:
    """The mask id train would use by default (the matching preset's, else its default token), -1
    when it cannot be resolved (then the mask token counts as reserved: one slot)."""
    from presets import load_preset
    from pipeline.config import TrainConfig
    from pipeline.training.compat import match_preset
    from pipeline.errors import PipelineError
    from pipeline.target_model import read_target_facts
    from pipeline.training.geometry import mask_token_id

    try:
        name = match_preset(cache)
        token = load_preset(name).get("target", {}).get("mask_token", TrainConfig.mask_token) if name else TrainConfig.mask_token
        return mask_token_id(token, target, read_target_facts(target))
    except (PipelineError, OSError):
        return -1
