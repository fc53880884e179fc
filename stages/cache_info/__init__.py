"""`pipeline cache-info`: options.py (its flags), run.py (the recipe), show.py (what it prints)."""

from __future__ import annotations

from pipeline.errors import PipelineError
from pipeline.ui.options import command
from stages.cache_info.options import CacheInfoOptions
from stages.cache_info.show import show_cache_info
from stages.options import config_file


@command(CacheInfoOptions)
def cache_info(options: CacheInfoOptions) -> None:
    """What a cache holds, from its records (manifest and shard commit records; no array is read
    unless --draft-vocab asks to count the labels or --energy to read a pilot's taps): identity, completeness, kernel provenance per
    shard, hosts, environments, counts, bytes per token."""
    from stages.cache_info.run import run_cache_info  # imports zarr: `pipeline --help` stays fast

    if not options.draft_vocab and (options.config is not None or options.max_length is not None):
        raise PipelineError("--config and --max-length only size --draft-vocab: pass --draft-vocab K too")
    train_config = config_file(options.config, "train.toml") if options.draft_vocab else None
    if options.energy_tokens < 1:
        raise PipelineError(f"--energy-tokens {options.energy_tokens}: must be at least 1")
    show_cache_info(run_cache_info(options.cache, options.draft_vocab, train_config=train_config,
                                   max_length=options.max_length, energy=options.energy,
                                   energy_tokens=options.energy_tokens), options.json_out)
