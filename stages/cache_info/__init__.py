"""`pipeline cache-info`: options.py (its flags), run.py (the recipe), show.py (what it prints)."""

from __future__ import annotations

from pipeline.ui.options import command
from stages.cache_info.options import CacheInfoOptions
from stages.cache_info.show import show_cache_info


@command(CacheInfoOptions)
def cache_info(options: CacheInfoOptions) -> None:
    """What a cache holds, from its records alone (no array is read): identity, completeness,
    kernel provenance per shard, hosts, environments, counts, bytes per token."""
    from stages.cache_info.run import run_cache_info  # imports zarr: `pipeline --help` stays fast

    show_cache_info(run_cache_info(options.cache, options.draft_vocab), options.json_out)
