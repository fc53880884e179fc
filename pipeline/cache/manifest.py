"""The cache manifest: what the cache is (its identity, provenance, plan) and which shards are committed.

This module owns the manifest: `read_manifest` parses and validates `manifest.json` once into a
typed `Manifest` (unknown schema versions refused); every consumer reads its fields, and
`update_manifest` writes it. The cache's identity (target, tokenizer, data, capture) is one
`Identity` record with one comparison, `Identity.differences`, used by extract (a conflicting
invocation), train (cache vs drafter, preset and target) and verify (shard vs cache, target vs
cache).

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

import functools
import json
import time
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from pipeline.cache.location import Location, open_location
from pipeline.cache.schema import (
    FORMAT_NAME,
    MANIFEST,
    MAX_SHARDS,
    SCHEMA_VERSION,
    Chunking,
    check_dims,
    shard_index,
    shard_name,
)
from pipeline.errors import PipelineError


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def key(name: str) -> Any:
    """A field stored under another JSON key than its attribute name."""
    return field(metadata={"key": name})


def label(text: str, **kwargs) -> Any:
    """A field with a human name for messages (defaults: the dotted field path)."""
    return field(metadata={"label": text}, **kwargs)


# --------------------------------------------------------------------------- the identity


@dataclass(frozen=True, kw_only=True)
class TargetRecord:
    model_type: str
    config_sha256: str = label("target config.json sha256")
    num_hidden_layers: int
    weights: dict = label("target weights")


@dataclass(frozen=True, kw_only=True)
class TokenizerRecord:
    files_sha256: str = label("tokenizer files sha256")
    chat_template_sha256: str = label("chat template sha256")
    chat_template_kwargs: dict | None
    thinking: str
    generation_prompt: str
    reasoning: str
    boundary_tokens: str
    end_of_turn: str


@dataclass(frozen=True, kw_only=True)
class DataRecord:
    num_rows: int
    files: list[dict]
    generated_by: str | None


@dataclass(frozen=True, kw_only=True)
class CaptureRecord:
    target_layer_ids: list[int]
    tap_convention: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    top_k: int
    hidden_format: str
    stored_dtype: str
    compute_dtype: str
    max_length: int
    overlong: str
    on_error: str
    zstd_level: int
    checksum: str
    storage: dict

    def dims(self) -> dict[str, int]:
        """The array dimensions the schema derives shapes from."""
        return {"n_taps": len(self.target_layer_ids), "hidden_size": self.hidden_size, "top_k": self.top_k}

    def chunking(self) -> Chunking:
        return Chunking.from_options(self.storage["options"])


# Each shard repeats part of the identity (so a shard written by another tokenizer or tap set
# shows up); on disk under these flat names, compared as these identity fields.
SHARD_IDENTITY_FIELDS = {
    "target_config_sha256": "target.config_sha256",
    "tokenizer_files_sha256": "tokenizer.files_sha256",
    "chat_template_sha256": "tokenizer.chat_template_sha256",
    "target_layer_ids": "capture.target_layer_ids",
    "hidden_size": "capture.hidden_size",
    "vocab_size": "capture.vocab_size",
    "top_k": "capture.top_k",
    "hidden_format": "capture.hidden_format",
}


@dataclass(frozen=True)
class Difference:
    """One identity field whose recorded value differs from another's (or is absent on one side)."""
    field: str
    label: str
    recorded: Any
    other: Any

    def arrow(self) -> str:
        return f"{self.field}: {self.recorded!r} -> {self.other!r}"

    def versus(self, recorded_name: str, other_name: str) -> str:
        return f"{self.label}: {recorded_name} {_brief(self.recorded)} vs {other_name} {_brief(self.other)}"


def _brief(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:16] + "..."


@dataclass(frozen=True, kw_only=True)
class Identity:
    """Everything that decides a cache's content; a later extract invocation must match it exactly."""
    num_shards: int
    target: TargetRecord
    tokenizer: TokenizerRecord
    data: DataRecord
    capture: CaptureRecord

    def flat(self) -> dict[str, Any]:
        """{dotted field path: value}, nested mappings flattened too."""
        return _flatten(_dump(self))

    def get(self, path: str) -> Any:
        value: Any = self
        for part in path.split("."):
            if is_dataclass(value):
                value = getattr(value, part, None)
            elif isinstance(value, dict):
                value = value.get(part)
            else:
                return None
        return _dump(value)

    def differences(self, claims: Mapping[str, Any], *, complete: bool = False) -> list[Difference]:
        """The claimed fields (dotted paths) whose values differ from this identity's; with
        `complete`, also the fields of this identity that `claims` lacks (claims = another identity's
        `flat()`). The one comparison of identities in the tool."""
        if complete:
            # Flattened on both sides: mapping keys may contain dots (weight file names).
            mine = self.flat()
            pairs = [(p, mine.get(p), claims.get(p)) for p in sorted(set(mine) | set(claims))]
        else:
            pairs = [(p, self.get(p), claims[p]) for p in sorted(claims)]
        return [Difference(path, _label_of(path), a, b) for path, a, b in pairs if a != b]

    def shard_identity(self) -> dict:
        """What each shard repeats of this identity, under the shard record's names."""
        return {name: self.get(path) for name, path in SHARD_IDENTITY_FIELDS.items()}


def shard_claims(shard_identity: Mapping[str, Any]) -> dict[str, Any]:
    """A shard's repeated identity as identity-field claims (an unknown name is kept, and differs)."""
    return {SHARD_IDENTITY_FIELDS.get(name, f"shard.{name}"): value for name, value in shard_identity.items()}


_SHARD_NAMES = {path: name for name, path in SHARD_IDENTITY_FIELDS.items()}


def shard_field_name(path: str) -> str:
    """The shard record's name for an identity field path (inverse of `shard_claims`)."""
    return _SHARD_NAMES.get(path, path.removeprefix("shard."))


def _label_of(path: str) -> str:
    cls: Any = Identity
    parts = path.split(".")
    for i, part in enumerate(parts):
        found = {f.name: f for f in fields(cls)} if is_dataclass(cls) else {}
        if part not in found:
            break
        if i == len(parts) - 1 or not is_dataclass(_hints(cls)[part]):
            return found[part].metadata.get("label", path)
        cls = _hints(cls)[part]
    return path


# --------------------------------------------------------------------------- the manifest


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
    identity: Identity = key("config")
    provenance: dict
    plan: PlanRecord
    shards: dict[str, ShardRecord]
    sources: SourcesRecord = field(default_factory=SourcesRecord)
    resolved_config: dict | None = None
    commit_protocol: str | None = None   # absent in caches that list their shards in this file
    extra: dict = field(default_factory=dict)
    # Not stored: shards whose commit record is there but does not match their files (why, by name).
    broken: dict = field(default_factory=dict, metadata={"stored": False})

    def with_shard(self, name: str, record: ShardRecord | dict) -> Manifest:
        if isinstance(record, dict):
            record = _parse(ShardRecord, record, f"shards.{name}.")
        return replace(self, shards={**self.shards, name: record})

    def committed(self) -> list[str]:
        """Committed shard names in index order."""
        return sorted(self.shards, key=shard_index)

    def recorded_target(self):
        from pipeline.target import RecordedTarget
        return RecordedTarget(path=self.sources.target, config_sha256=self.identity.target.config_sha256,
                              source="the cache manifest")

    def missing_shards(self, wanted: list[int] | None = None) -> dict:
        """Completeness (DESIGN 5): which of the cache's `num_shards` (or of `wanted`) are not
        committed, and how many dataset rows they hold by the shard plan."""
        from pipeline.data.shard_plan import shard_rows

        num_shards, num_rows = self.identity.num_shards, self.plan.num_rows
        indices = range(num_shards) if wanted is None else wanted
        missing = [i for i in indices if shard_name(i) not in self.shards]
        return {"num_shards": num_shards, "checked": len(indices), "missing": [shard_name(i) for i in missing],
                "broken": {shard_name(i): self.broken[shard_name(i)] for i in missing if shard_name(i) in self.broken},
                "missing_rows": sum(len(shard_rows(i, num_rows, num_shards)) for i in missing),
                "num_rows": num_rows}

    def to_json(self) -> dict:
        return _dump(self)


def new_manifest(*, identity: Identity, provenance: dict, plan: dict, sources: SourcesRecord,
                 resolved_config: dict | None = None) -> Manifest:
    from pipeline.cache.commit import PROTOCOL
    return Manifest(format=FORMAT_NAME, schema_version=SCHEMA_VERSION, created=_now(), identity=identity,
                    provenance=provenance, plan=_parse(PlanRecord, plan, "plan."), shards={}, sources=sources,
                    resolved_config=resolved_config, commit_protocol=PROTOCOL)


def parse_identity(value: dict, where: str = "config.") -> Identity:
    return _parse(Identity, value, where)


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
            shards[name] = _parse(ShardRecord, record, f"{name}/digests.json: shard.")
        except _FieldError as e:
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
        manifest = _parse(Manifest, raw, "")
    except _FieldError as e:
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
    if location.put_if_absent(MANIFEST, data):
        return manifest, True
    existing = read_manifest(location)
    if existing is None:
        raise PipelineError(f"{location.where(MANIFEST)}: exists but cannot be read back")
    return existing, False


# Resolved once per record class: a manifest has a record per shard, and resolving the
# (string) annotations is the costly part of parsing one.
_hints = functools.cache(typing.get_type_hints)


class _FieldError(Exception):
    pass


def _kind(tp: Any) -> str:
    return {int: "an integer", str: "a string", float: "a number", bool: "true or false", dict: "a mapping",
            list: "a list"}.get(typing.get_origin(tp) or tp, str(tp))


def _parse(tp: Any, value: Any, where: str) -> Any:
    """`value` (parsed JSON) checked against type `tp`; dataclasses built field by field. `where`
    is the dotted path so far, ending with '.'."""
    name = where.rstrip(".") or "manifest"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _parse(inner, value, where)
    if tp is Any:
        return value
    if is_dataclass(tp):
        if not isinstance(value, dict):
            raise _FieldError(f"field '{name}' must be a mapping, got {type(value).__name__}")
        hints, kwargs, known = _hints(tp), {}, set()
        for f in fields(tp):
            if f.name == "extra" or f.metadata.get("stored") is False:
                continue
            json_key = f.metadata.get("key", f.name)
            known.add(json_key)
            if json_key not in value:
                if f.default is MISSING and f.default_factory is MISSING:
                    raise _FieldError(f"field '{where}{json_key}' is missing")
                continue
            kwargs[f.name] = _parse(hints[f.name], value[json_key], f"{where}{json_key}.")
        unknown = {k: v for k, v in value.items() if k not in known}
        if "extra" in hints:
            kwargs["extra"] = unknown
        elif unknown:
            raise _FieldError(f"field '{where}{sorted(unknown)[0]}' is not known to this version")
        return tp(**kwargs)
    if origin is list or tp is list:
        if not isinstance(value, list):
            raise _FieldError(f"field '{name}' must be a list, got {type(value).__name__}")
        return [_parse(args[0], v, f"{where}{i}.") for i, v in enumerate(value)] if args else value
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise _FieldError(f"field '{name}' must be a mapping, got {type(value).__name__}")
        return {k: _parse(args[1], v, f"{where}{k}.") for k, v in value.items()} if args else value
    ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str), bool: lambda v: isinstance(v, bool)}[tp]
    if not ok(value):
        raise _FieldError(f"field '{name}' must be {_kind(tp)}, got {type(value).__name__}")
    return value


def _dump(value: Any) -> Any:
    """The JSON form of a record (inverse of `_parse`)."""
    if is_dataclass(value):
        out = {}
        for f in fields(value):
            if f.name == "extra" or f.metadata.get("stored") is False:
                continue
            out[f.metadata.get("key", f.name)] = _dump(getattr(value, f.name))
        return {**out, **getattr(value, "extra", {})}
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_dump(v) for v in value]
    return value


def _flatten(value: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in value.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
