"""`pipeline cache-info LOCATION`: what a cache holds, from its records alone (no array is read):
identity, completeness, provenance grouped by shard, counts and bytes (pipeline/cache/info.py).
With `--draft-vocab K[,K...]` it also reads the labels (the stored argmax and loss mask, one pass)
and reports the coverage each K's draft vocabulary would give (pipeline/training/draft_vocab.py):
how to size `pipeline train --draft-vocab` on a first real shard before training. The labels are
counted within the max_length train would use, resolved by train's own resolve_config from the
same places (the cache's preset, the TOML config, --max-length)."""

from __future__ import annotations

from pathlib import Path

from pipeline.cache.info import cache_info
from pipeline.cache.address import open_location
from pipeline.errors import PipelineError
from pipeline.training.configure import max_length_source, resolve_config


def run_cache_info(cache: str, draft_vocab: list[int] | None = None, *, train_config: Path | None = None,
                   max_length: int | None = None, energy: list[int] | None = None,
                   energy_tokens: int = 65_536) -> dict:
    location = open_location(cache)
    location.check_reachable()  # no such directory, a missing bucket, refused credentials: one line
    info = cache_info(location)
    if draft_vocab or energy:
        from pipeline.cache.reader import open_cache
        reader = open_cache(cache)  # one listing of the store for both passes
    if draft_vocab:
        info["draft_vocab"] = draft_vocab_coverage(cache, reader, draft_vocab, train_config=train_config,
                                                   max_length=max_length)
    if energy:
        info["energy"] = tap_energy(reader, energy, energy_tokens)
    return info


def tap_energy(reader, projected_ranks: list[int], tokens: int) -> dict:
    """{pilot_tokens, width, rows: [{rank, energy}]}: the share of the taps' energy (uncentred
    second moment, pipeline/projection/basis.py) the top R components of a pilot keep, as
    `pipeline extract --project-taps R` would fit them on the same first tokens."""
    from pipeline.projection.basis import check_projected_rank
    from pipeline.projection.pilot import pilot_moment

    dims = reader.manifest.identity.capture.dims()
    if reader.manifest.identity.capture.projection is not None:
        raise PipelineError(f"--energy: {reader.dir} stores the taps projected already (to "
                            f"{dims['projected_rank']} values a token); ask it of a cache of whole taps, such as a "
                            "first shard extracted without --project-taps")
    for r in projected_ranks:  # before the pass over the cache
        check_projected_rank(r, dims["n_taps"] * dims["hidden_size"], "--energy")
    moment = pilot_moment(reader, tokens)
    kept = moment.energy_kept(projected_ranks)
    return {"pilot_tokens": moment.tokens, "width": moment.dim,
            "rows": [{"rank": r, "energy": round(kept[r], 6)} for r in projected_ranks]}


def draft_vocab_coverage(cache: str, reader, sizes: list[int], *, train_config: Path | None = None,
                         max_length: int | None = None) -> dict:
    """{max_length, max_length_from, labels, distinct, rows: [{size, coverage, reserved,
    byte_fallbacks}]} for each K, chosen and counted as `pipeline train --cache CACHE [--config
    FILE] [--max-length N] --draft-vocab K` would."""
    from pipeline.target_model import load_tokenizer, read_target_facts, recorded_in_cache, resolve_target
    from pipeline.training.draft_vocab import check_size, count_labels, coverage, vocab_from_counts

    cfg, max_length_from = train_settings(cache, train_config, max_length)
    target = resolve_target(cfg.job.target, recorded_in_cache(reader.manifest))
    vocab_size = read_target_facts(target).vocab_size
    tokenizer = load_tokenizer(target)
    mask = _mask_id(cfg.drafter.mask_token, target)
    for k in sizes:  # before the pass over the cache
        check_size(k, vocab_size)
    counts = count_labels(reader, vocab_size, cfg.data.max_length)
    rows = []
    for k in sizes:
        ids, kept = vocab_from_counts(counts, tokenizer, size=k, vocab_size=vocab_size, mask_id=mask)
        rows.append({"size": k, "coverage": round(coverage(counts, ids), 6), "reserved": len(kept["reserved"]),
                     "byte_fallbacks": len(kept["bytes"])})
    return {"max_length": cfg.data.max_length, "max_length_from": max_length_from, "labels": int(counts.sum()),
            "distinct": int((counts > 0).sum()), "target_vocab": vocab_size, "rows": rows}


def train_settings(cache: str, train_config: Path | None, max_length: int | None):
    """(the TrainConfig `pipeline train --cache CACHE [--config FILE] [--max-length N]` resolves,
    where its max_length came from): train's own resolution, so the two cannot drift apart."""
    cfg, _ = resolve_config(train_config, {"cache": cache, "max_length": max_length})
    return cfg, max_length_source(train_config, max_length, cfg.job.preset)


def _mask_id(mask_token, target) -> int:
    """The mask id train would use, -1 when it cannot be resolved (then the mask token counts as
    reserved: one slot)."""
    from pipeline.errors import PipelineError
    from pipeline.target_model import read_target_facts
    from pipeline.training.mask_token import mask_token_id

    try:
        return mask_token_id(mask_token, target, read_target_facts(target))
    except (PipelineError, OSError):
        return -1
