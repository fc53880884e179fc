"""`pipeline cache-info`'s options, each declared once: the field is the flag, its default and its help."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config import option
from pipeline.errors import PipelineError
from stages.options import JsonOutput


def sizes(text: str, flag: str) -> list[int]:
    """'32768,65536' -> [32768, 65536]."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PipelineError(f"{flag}: expected sizes like 32768,65536, got {text!r}") from None


@dataclass(kw_only=True)
class CacheInfoOptions(JsonOutput):
    cache: str = option(argument=True, help="Cache: a directory, file://PATH or s3://BUCKET/PREFIX.")
    draft_vocab: list[int] | None = option(None, parse=sizes, help="Also read the labels and report the coverage of a draft vocabulary of each K, comma-separated (e.g. 32768,65536), as `pipeline train --draft-vocab K` would choose it.")
