"""`pipeline extract`'s own options; the extraction's settings are ExtractConfig's option fields
(pipeline/config/extract.py), which a TOML file may also hold."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.config import option
from stages.options import JsonOutput, ShardSelection


@dataclass(kw_only=True)
class ExtractOptions(ShardSelection, JsonOutput):
    # The shared --shards, as extract means it.
    OWN_HELP = {"shards": "Shards this invocation writes, e.g. '0-63' or '3,5,8-11' (default: all)."}

    config: Path | None = option(None, help="TOML config (\\[extract] table); default ./extract.toml if present, else the embedded default.")
    thinking: bool | None = option(None, help="Render with the template's thinking mode on or off (chat_template_kwargs.enable_thinking; default: the template's own default).")
    dry_run: bool = option(False, help="Print the bill instead: rows, tokens, samples per shard, bytes and files, from the data, the target's config and tokenizer (no weights loaded, nothing written).")
    assume_tokens_per_s: float | None = option(None, help="With --dry-run: extraction rate to turn tokens into time (measure it on a pilot shard).")
    assume_compression: float = option(1.0, help="With --dry-run: stored / raw bytes (default 1.0, an upper bound); `pipeline cache-info` of a pilot shard prints it as stored_vs_raw.")
