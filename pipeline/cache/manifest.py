"""The cache manifest: what the cache is (config, provenance) and which shards are committed.

It is the commit marker: a shard exists for readers only once its entry is here. Updates are
read-modify-write under `manifest.lock`, then an atomic replace, so concurrent extractors on
one node (or on nodes sharing a filesystem with working flock) never lose each other's shards.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from pipeline.cache.files import FileLock, write_json_atomic
from pipeline.cache.schema import FORMAT_NAME, MANIFEST, MANIFEST_LOCK, MAX_SHARDS, SCHEMA_VERSION, shard_index, shard_name
from pipeline.errors import PipelineError


def read_manifest(cache_dir: Path) -> dict | None:
    path = cache_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PipelineError(f"{path}: not valid JSON ({e})") from None
    validate_manifest(manifest, path)
    return manifest


def validate_manifest(manifest, path: Path) -> None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise PipelineError(f"{path}: not a {FORMAT_NAME} manifest")
    version = manifest.get("schema_version")
    if version == 1:
        # Schema 1 (one file per chunk, nested key directories) is refused rather than read: its
        # millions of files are what schema 2 exists to avoid, and both readers would have to be kept.
        raise PipelineError(f"{path}: schema_version 1 (one file per chunk) is not read by this version, which "
                            f"reads and writes schema {SCHEMA_VERSION} (few files, Zarr sharding): re-run "
                            "`pipeline extract` into a new --cache directory")
    if version != SCHEMA_VERSION:
        raise PipelineError(f"{path}: schema_version {version!r} is not supported (this tool reads {SCHEMA_VERSION})")
    shards = manifest.get("shards")
    if not isinstance(shards, dict) or len(shards) > MAX_SHARDS:
        raise PipelineError(f"{path}: field 'shards' must be a mapping of at most {MAX_SHARDS} entries")
    for name in shards:
        try:
            shard_index(name)  # refuses '../x', absolute paths and anything not shard-NNNNN
        except ValueError:
            raise PipelineError(f"{path}: invalid shard name {name!r} in 'shards'") from None


def update_manifest(cache_dir: Path, change: Callable[[dict | None], dict]) -> dict:
    """Apply `change` to the current manifest (None if absent) under the lock; write the result."""
    with FileLock(cache_dir / MANIFEST_LOCK):
        # Only a holder of this lock writes a temporary manifest: any found now is from a
        # process killed mid-update, and the manifest it meant to replace is still whole.
        for stale in cache_dir.glob(f".{MANIFEST}.tmp-*"):
            stale.unlink(missing_ok=True)
        manifest = change(read_manifest(cache_dir))
        manifest["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        write_json_atomic(cache_dir / MANIFEST, manifest)
    return manifest


def new_manifest(*, config: dict, provenance: dict, plan: dict) -> dict:
    return {
        "format": FORMAT_NAME,
        "schema_version": SCHEMA_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": config,
        "provenance": provenance,
        "plan": plan,
        "shards": {},
    }


def config_conflicts(recorded: dict, requested: dict, prefix: str = "") -> list[str]:
    """Fields whose values differ, as 'path: recorded -> requested'."""
    out = []
    for key in sorted(set(recorded) | set(requested)):
        a, b = recorded.get(key), requested.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_conflicts(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


def shard_identity(identity: dict) -> dict:
    """What every shard repeats of the cache identity, so shards of one cache can be compared
    with each other and with the manifest (a shard written by another tokenizer shows up)."""
    cap = identity["capture"]
    return {"target_config_sha256": identity["target"]["config_sha256"],
            "tokenizer_files_sha256": identity["tokenizer"]["files_sha256"],
            "chat_template_sha256": identity["tokenizer"]["chat_template_sha256"],
            "target_layer_ids": cap["target_layer_ids"], "hidden_size": cap["hidden_size"],
            "vocab_size": cap["vocab_size"], "top_k": cap["top_k"], "hidden_format": cap["hidden_format"]}


def missing_shards(manifest: dict, wanted: list[int] | None = None) -> dict:
    """Completeness (DESIGN 5): which of the cache's `num_shards` (or of `wanted`) are not committed,
    and how many dataset rows they hold by the shard plan."""
    from pipeline.data.shard_plan import shard_rows

    num_shards = manifest["config"]["num_shards"]
    num_rows = manifest.get("plan", {}).get("num_rows") or manifest["config"]["data"]["num_rows"]
    indices = range(num_shards) if wanted is None else wanted
    missing = [i for i in indices if shard_name(i) not in manifest["shards"]]
    return {"num_shards": num_shards, "checked": len(indices), "missing": [shard_name(i) for i in missing],
            "missing_rows": sum(len(shard_rows(i, num_rows, num_shards)) for i in missing),
            "num_rows": num_rows}


def describe_missing(found: dict) -> str:
    names = found["missing"]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (f"{len(names)} of {found['checked']} shards not committed ({shown}): "
            f"{found['missing_rows']} of {found['num_rows']} dataset rows are not in the cache")
