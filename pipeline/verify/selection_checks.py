"""Which shards verify-cache reads (committed ones, optionally those whose commit record does not
match their files), whether every shard the cache plans is committed, and whether the target
given is the one the cache was extracted with."""

from __future__ import annotations

from pathlib import Path

from pipeline.verify.check_report import Check
from pipeline.cache.manifest import describe_missing
from pipeline.cache.reader import CacheReader
from pipeline.cache.schema import shard_index, shard_name
from pipeline.cache.shard_plan import parse_shards
from pipeline.target_model import identity_claims


def select_shards(reader: CacheReader, spec: str | None, *, broken: bool = False) -> list[str]:
    """Committed shards (`broken`: also those whose commit record does not match their files,
    for the structure and digest checks to name what is wrong with them)."""
    names = sorted({*reader.shards, *(reader.manifest.broken if broken else ())}, key=shard_index)
    if spec is None:
        return names
    wanted = {shard_name(i) for i in parse_shards(spec, reader.manifest.identity.num_shards)}
    return [s for s in names if s in wanted]


def check_completeness(reader: CacheReader, spec: str | None) -> Check:
    """Every one of the cache's num_shards (or of --shards) is committed."""
    wanted = None if spec is None else parse_shards(spec, reader.manifest.identity.num_shards)
    found = reader.manifest.missing_shards(wanted)
    if not found["missing"]:
        return Check("completeness", True, f"all {found['checked']} shards committed", found)
    return Check("completeness", False, describe_missing(found) + "; extract the missing shards (same command)", found)


def check_target_identity(reader: CacheReader, target_dir: Path, tokenizer) -> Check:
    """The target is the one the cache was extracted with: config, tokenizer, chat template, sizes."""
    differences = reader.manifest.identity.differences(identity_claims(target_dir, tokenizer=tokenizer))
    problems = [d.versus("cache", "target") for d in differences]
    return Check("target_identity", not problems, f"{target_dir}: " + ("; ".join(problems) if problems else "config, tokenizer and chat template match the manifest"),
                 {"problems": problems, "fields": [d.field for d in differences]})
