"""`pipeline cache-info`'s options, each declared once: the field is the flag, its default and its help."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.config import int_list, option
from stages.options import JsonOutput


@dataclass(kw_only=True)
class CacheInfoOptions(JsonOutput):
    cache: str = option(argument=True, help="Cache: a directory, file://PATH or s3://BUCKET/PREFIX.")
    draft_vocab: list[int] | None = option(None, parse=int_list, help="Also read the labels and report the coverage of a draft vocabulary of each K, comma-separated (e.g. 32768,65536), as `pipeline train --draft-vocab K` would choose it (at the max_length train would use: see --config, --max-length).")
    # The two places besides the cache's preset that decide train's max_length (pipeline/training/configure.py resolve_config)
    config: Path | None = option(None, help="With --draft-vocab: the TOML config train will read (\\[train] table); default ./train.toml if present, as train's.")
    max_length: int | None = option(None, help="With --draft-vocab: the --max-length train will be given (default: what train resolves from --config, the cache's preset, its own default).")
    energy: list[int] | None = option(None, parse=int_list, help="Also read the taps of a pilot (--energy-tokens) and report the share of their energy the top R components keep, for each R, comma-separated (e.g. 2048,5120,10240): how much of the taps a projection to R values a token would keep.")
    energy_tokens: int = option(65_536, help="With --energy: the pilot, the cache's first N tokens in shard order.")
