"""The cache manifest: what the cache is (its identity, provenance, plan) and which shards are committed.

This module owns the manifest: `read_manifest` parses and validates `manifest.json` once into a
typed `Manifest` (unknown schema versions refused); every consumer reads its fields, and
`create_manifest` writes it. The cache's identity is one `Identity` record
(pipeline/cache/identity.py); the JSON is read and written by pipeline/records/typed.py.

Which shards are committed is derived from their commit records (pipeline/cache/commit.py):
manifest.json itself is written once, when the cache is created, with a create-if-absent write,
so any number of writers on any number of nodes share it without a lock and never overwrite one
another (DESIGN 11). `read_manifest` returns the manifest with its committed shards filled in
from the records. Caches written before that list their shards in manifest.json; those entries
are still read.

On disk (schema 2) the identity is stored under the key "config"; the key is kept so that
schema-2 caches stay readable.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipeline.cache.identity import Difference, Identity, shard_claims, shard_field_name
from pipeline.cache.address import open_location
from pipeline.cache.location import Location
from pipeline.cache.schema import FORMAT_NAME, MANIFEST, MAX_SHARDS, SCHEMA_VERSION, check_dims, shard_index, shard_name
from pipeline.errors import PipelineError
from pipeline.records.typed import RecordFieldError, dump_record, parse_record, stored_as


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass(frozen=True, kw_only=True)
class PlanRecord:
    assignment: str
    num_rows: int
    num_shards: int
    storage: dict


@dataclass(frozen=True, kw_only=True)
class SourcesRecord:
    """Where the inputs were read from (paths on the extracting machine; not part of the identity)."""
    target: str | None = None
    data: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class ShardRecord:
    samples: int
    tokens: int
    sample_id_min: int
    sample_id_max: int
    bytes: int
    files: int
    digest: str
    schema_version: int | None = None
    row_range: list[int] | None = None
    # What the writer records besides the counts (None where a record lacks it).
    identity: dict | None = None
    kernels: dict | None = None
    environment: dict | None = None
    layout: dict | None = None
    counts: dict | None = None
    host: str | None = None
    extra: dict = field(default_factory=dict)  # keys this version does not know, kept as written

    @property
    def kernel_path(self) -> str:
        """The linear-attention implementation that produced the shard; 'unknown' if not recorded."""
        return (self.kernels or {}).get("path") or "unknown"


@dataclass(frozen=True, kw_only=True)
class Manifest:
    format: str
    schema_version: int
    created: str
    updated: str | None = None
    identity: Identity = stored_as("config")
    provenance: dict
    plan: PlanRecord
    shards: dict[str, ShardRecord]
    sources: SourcesRecord = field(default_factory=SourcesRecord)
    resolved_config: dict | None = None
    commit_protocol: str | None = None   # absent in caches that list their shards in this file
    shard_records: str | None = None     # where each shard's record is (absent in caches written before it was stated)
    extra: dict = field(default_factory=dict)
    # Not stored: shards whose commit record is there but does not match their files (why, by name).
    broken: dict = field(default_factory=dict, metadata={"stored": False})

    def with_shard(self, name: str, record: ShardRecord | dict) -> Manifest:
        if isinstance(record, dict):
            record = parse_record(ShardRecord, record, f"shards.{name}.")
        return replace(self, shards={**self.shards, name: record})

    def committed(self) -> list[str]:
        """Committed shard names in index order."""
        return sorted(self.shards, key=shard_index)

    def foreign_shards(self) -> dict[str, list[Difference]]:
        """{committed shard: how its recorded identity differs from this manifest's}, for every
        shard extracted with other taps, another target, tokenizer, template, thinking mode, top-k,
        hidden format or schema (`cp -r` or `aws s3 sync` of two runs into one place, or two
        extracts racing on a store that ignores create-if-absent). Readers for training and
        evaluation refuse such a cache (pipeline/cache/reader.py); verify-cache reports it."""
        found = {}
        for name in self.committed():
            record = self.shards[name]
            differences = self.identity.differences(shard_claims(record.identity or {}))
            if record.schema_version is not None and record.schema_version != self.schema_version:
                differences.append(Difference("schema_version", "schema version", self.schema_version,
                                              record.schema_version))
            if differences:
                found[name] = differences
        return found

    def missing_shards(self, wanted: list[int] | None = None) -> dict:
        """Completeness (DESIGN 5): which of the cache's `num_shards` (or of `wanted`) are not
        committed, and how many dataset rows they hold by the shard plan."""
        from pipeline.cache.shard_plan import shard_rows

        num_shards, num_rows = self.identity.num_shards, self.plan.num_rows
        indices = range(num_shards) if wanted is None else wanted
        missing = [i for i in indices if shard_name(i) not in self.shards]
        return {"num_shards": num_shards, "checked": len(indices), "missing": [shard_name(i) for i in missing],
                "broken": {shard_name(i): self.broken[shard_name(i)] for i in missing if shard_name(i) in self.broken},
                "missing_rows": sum(len(shard_rows(i, num_rows, num_shards)) for i in missing),
                "num_rows": num_rows}

    def to_json(self) -> dict:
        return dump_record(self)


def new_manifest(*, identity: Identity, provenance: dict, plan: dict, sources: SourcesRecord,
                 resolved_config: dict | None = None) -> Manifest:
    from pipeline.cache.commit import PROTOCOL, SHARD_RECORDS
    return Manifest(format=FORMAT_NAME, schema_version=SCHEMA_VERSION, created=_now(), identity=identity,
                    provenance=provenance, plan=parse_record(PlanRecord, plan, "plan."), shards={}, sources=sources,
                    resolved_config=resolved_config, commit_protocol=PROTOCOL, shard_records=SHARD_RECORDS)


def describe_foreign(where: str, foreign: dict[str, list[Difference]], num_committed: int) -> str:
    """One line for a cache holding shards of another identity: the first such shard, its first
    differing field with both values, and what to do (DESIGN 6: no flag trains on a mixed cache)."""
    name, differences = next(iter(sorted(foreign.items())))
    first = differences[0]
    field = shard_field_name(first.field)
    more = f" and {len(differences) - 1} more fields" if len(differences) > 1 else ""
    others = f"; {len(foreign)} of {num_committed} committed shards differ" if len(foreign) > 1 else ""
    return (f"{where}: {name} was extracted with another identity than the cache's manifest.json ({field}: shard "
            f"{_brief(first.other)} vs manifest {_brief(first.recorded)}{more}){others}; training or evaluating on it "
            f"would mix features of two extractions. `pipeline verify-cache {where}` lists every such shard; "
            f"re-extract it: remove {name}/ and run `pipeline extract --shards {shard_index(name)}` with this cache's "
            "settings")


def _brief(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= 60 else text[:24] + "..." + text[-12:]


def describe_missing(found: dict) -> str:
    names = found["missing"]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    broken = found.get("broken") or {}
    why = f"; {next(iter(broken.values()))}" if broken else ""
    return (f"{len(names)} of {found['checked']} shards not committed ({shown}): "
            f"{found['missing_rows']} of {found['num_rows']} dataset rows are not in the cache{why}")


# --------------------------------------------------------------------------- read, validate, write


def read_manifest(cache: Location | str | Path, listing: dict[str, int] | None = None) -> Manifest | None:
    """The manifest with its committed shards (None when the cache has no manifest.json yet).
    `listing`: the whole cache's {key: size}, when the caller has it (else it is listed here)."""
    location = cache if isinstance(cache, Location) else open_location(cache)
    raw_bytes = location.read(MANIFEST)
    if raw_bytes is None:
        return None
    where = location.where(MANIFEST)
    try:
        raw = json.loads(raw_bytes.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PipelineError(f"{where}: not valid JSON ({e})") from None
    manifest = parse_manifest(raw, where)
    from pipeline.cache.commit import committed_shards
    records, broken = committed_shards(location, location.listing() if listing is None else listing)
    shards = dict(manifest.shards)
    for name, record in records.items():
        try:
            shard_index(name)
            shards[name] = parse_record(ShardRecord, record, f"{name}/digests.json: shard.")
        except RecordFieldError as e:
            broken[name] = f"{location.where(name)}: {e}"
    return replace(manifest, shards=shards, broken=broken)


def parse_manifest(raw: Any, path: Path | str) -> Manifest:
    """Validate a manifest's JSON once: format, schema version, every field's type, shard names,
    declared sizes; errors name the file and the field."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise PipelineError(f"{path}: not a {FORMAT_NAME} manifest")
    version = raw.get("schema_version")
    if version == 1:
        # Schema 1 (one file per chunk, nested key directories) is refused rather than read: its
        # millions of files are what schema 2 exists to avoid, and both readers would have to be kept.
        raise PipelineError(f"{path}: schema_version 1 (one file per chunk) is not read by this version, which "
                            f"reads and writes schema {SCHEMA_VERSION} (few files, Zarr sharding): re-run "
                            "`pipeline extract` into a new --cache directory")
    if version != SCHEMA_VERSION:
        raise PipelineError(f"{path}: schema_version {version!r} is not supported (this tool reads {SCHEMA_VERSION})")
    shards = raw.get("shards")
    if not isinstance(shards, dict) or len(shards) > MAX_SHARDS:
        raise PipelineError(f"{path}: field 'shards' must be a mapping of at most {MAX_SHARDS} entries")
    for name in shards:
        try:
            shard_index(name)  # refuses '../x', absolute paths and anything not shard-NNNNN
        except ValueError:
            raise PipelineError(f"{path}: invalid shard name {name!r} in 'shards'") from None
    try:
        manifest = parse_record(Manifest, raw, "")
    except RecordFieldError as e:
        raise PipelineError(f"{path}: {e}") from None
    capture = manifest.identity.capture
    try:
        # Declared sizes are bounded before any reader allocates from them (caches are untrusted).
        check_dims({**capture.dims(), "vocab_size": capture.vocab_size})
        capture.chunking()
    except (KeyError, TypeError, ValueError) as e:
        raise PipelineError(f"{path}: bad capture record ({type(e).__name__}: {e})") from None
    return manifest


def create_manifest(location: Location, manifest: Manifest) -> tuple[Manifest, bool]:
    """(the cache's manifest, whether this call created it): `manifest` is written only where
    none exists (a create-if-absent write: of concurrent creators exactly one wins); otherwise
    the existing one is returned for the caller to compare."""
    data = (json.dumps(manifest.to_json(), indent=2, sort_keys=True) + "\n").encode()
    created = location.put_if_absent(MANIFEST, data)
    # Read back either way: a store that let a concurrent creator overwrite ours shows it here,
    # before any shard is written (the caller compares identities).
    existing = read_manifest(location)
    if existing is None:
        raise PipelineError(f"{location.where(MANIFEST)}: {'written' if created else 'exists'} but cannot be read back")
    return existing, created


def identity_conflicts(location: Location, identity: Identity) -> list[Difference]:
    """How the identity in the stored manifest.json differs from `identity` (every field both
    ways): one read of manifest.json, no listing. Extract calls it before each shard's commit
    record, so a writer whose manifest was replaced never commits a shard under another identity."""
    raw = location.read(MANIFEST)
    if raw is None:
        raise PipelineError(f"{location.where(MANIFEST)}: disappeared while this extract was writing the cache")
    try:
        stored = parse_manifest(json.loads(raw.decode("utf-8")), location.where(MANIFEST))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PipelineError(f"{location.where(MANIFEST)}: not valid JSON ({e})") from None
    return stored.identity.differences(identity.flat(), complete=True)
