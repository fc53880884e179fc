"""The cache's identity: everything that decides its content (target, tokenizer, data, capture).

One `Identity` record with one comparison, `Identity.differences`, used by extract (a conflicting
invocation), train (cache vs drafter, preset and target) and verify (shard vs cache, target vs
cache). Each shard repeats part of it (`shard_identity`), so a shard written by another tokenizer
or tap set shows up. Stored in the manifest (pipeline/cache/manifest.py) under the key "config".
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Mapping

from pipeline.cache.schema import Chunking
from pipeline.records.typed import dump_record, flatten, label, parse_record, type_hints


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
class ProjectionRecord:
    """The basis a projected cache's taps are stored in (pipeline/projection/basis.py), kept in
    the cache as basis.safetensors, whose content's sha256 is `digest`."""
    # R, `projected_rank` elsewhere (CaptureRecord.projected_rank below), under the name every
    # manifest stores it with. Not renamed with stored_as: Identity.get and the difference labels
    # walk the stored paths ("capture.projection.rank") as attribute names.
    rank: int = label("projected width R")
    digest: str = label("tap basis digest")
    energy: float = label("pilot energy kept")
    pilot_tokens: int
    pilot: str          # which tokens the basis was fitted on


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
    # A projected cache: its basis (pipeline/projection); None: the taps are stored whole (and in
    # every cache written before projections existed).
    projection: ProjectionRecord | None = None

    @property
    def projected_rank(self) -> int | None:
        return None if self.projection is None else self.projection.rank

    def dims(self) -> dict[str, int]:
        """The array dimensions the schema derives shapes from."""
        dims = {"n_taps": len(self.target_layer_ids), "hidden_size": self.hidden_size, "top_k": self.top_k}
        if self.projection is not None:
            dims["projected_rank"] = self.projected_rank
        return dims

    def chunking(self) -> Chunking:
        return Chunking.from_options(self.storage["options"])


# Each shard repeats the part of the identity that decides what its arrays mean (so a shard
# written by another target, tokenizer, template, thinking mode or tap set shows up, and readers
# refuse it: pipeline/cache/manifest.py `Manifest.foreign_shards`); on disk under these flat
# names, compared as these identity fields. Shards written before a field was added lack it: a
# field a shard does not record is not compared.
SHARD_IDENTITY_FIELDS = {
    "target_config_sha256": "target.config_sha256",
    "target_weights": "target.weights",
    "tokenizer_files_sha256": "tokenizer.files_sha256",
    "chat_template_sha256": "tokenizer.chat_template_sha256",
    "thinking": "tokenizer.thinking",
    "target_layer_ids": "capture.target_layer_ids",
    "hidden_size": "capture.hidden_size",
    "vocab_size": "capture.vocab_size",
    "top_k": "capture.top_k",
    "hidden_format": "capture.hidden_format",
    "projection_digest": "capture.projection.digest",
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
        return flatten(dump_record(self))

    def get(self, path: str) -> Any:
        value: Any = self
        for part in path.split("."):
            if is_dataclass(value):
                value = getattr(value, part, None)
            elif isinstance(value, dict):
                value = value.get(part)
            else:
                return None
        return dump_record(value)

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
        if i == len(parts) - 1 or not is_dataclass(type_hints(cls)[part]):
            return found[part].metadata.get("label", path)
        cls = type_hints(cls)[part]
    return path


def parse_identity(value: dict, where: str = "config.") -> Identity:
    return parse_record(Identity, value, where)
