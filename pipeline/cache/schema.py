"""The cache format, owned in one place (DESIGN 5).

Layout of a cache (a directory, or a prefix of an object store: the same keys and bytes):

    manifest.json            what the cache is (identity, provenance, plan); written once, if absent
    basis.safetensors        a projected cache only: the tap basis (pipeline/projection), written
                             once, if absent, before the manifest; the manifest names its digest
    shard-00000/             one Zarr v3 group per shard
      hidden/zarr.json       array metadata
      hidden/c.0.0.0         one file per FILE of tokens (Zarr v3 sharding; flat '.' chunk keys)
      digests.json           the commit record, written last: size and sha256 of every other file
                             of the shard, and the shard's record; the shard is committed iff it
                             exists and matches (pipeline/cache/commit.py)
    .shard-00000.lock        in a directory: held (flock, where it works) while a process writes it

A shard is ragged and token-major: per-token arrays indexed by a global token position inside
the shard, per-sample `offsets` [samples + 1] into them and stable `sample_id`s.

Schema 2 (this one) stores each per-token array with Zarr v3's sharding codec: a file holds
`file_tokens` tokens as `file_tokens / chunk_tokens` independently compressed inner chunks
(zstd, then CRC32C of each) plus an index (CRC32C-checked) at its end, so reading sample s
positions i..j decodes only the inner chunks that overlap, while a billion tokens at the
flagship width are about 7e4 files instead of 1.6e7 (schema 1: one file per chunk, nested
`c/<i>/0/0` directories). Per-sample arrays are one plain chunk each.

Each array is declared once, below (`ArraySpec`: name, stored dtype, shape, role): the writer,
the reader, row encoding, the checks and the training stream all take their arrays from here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SCHEMA_VERSION = 2
FORMAT_NAME = "dflash-hidden-state-cache"

MANIFEST = "manifest.json"
BASIS = "basis.safetensors"
_SHARD_RE = re.compile(r"^shard-(\d{5})$")

# Hard bounds checked before anything is allocated from what a manifest or shard declares.
MAX_SHARDS = 100_000
MAX_TAPS = 64
MAX_HIDDEN = 65_536
MAX_TOP_K = 1_024
MAX_VOCAB = 2**24

FP8_MAX = 448.0  # largest finite float8_e4m3fn

DIGESTS = "digests.json"
FILE_KEY_SEPARATOR = "."  # flat chunk keys: hidden/c.3.0.0, never a directory per chunk index


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def shard_index(name: str) -> int:
    """Inverse of shard_name; refuses anything else (manifest names are untrusted input)."""
    m = _SHARD_RE.match(name)
    if not m:
        raise ValueError(f"not a shard name: {name!r}")
    return int(m.group(1))


def shard_lock_name(index: int) -> str:
    return f".{shard_name(index)}.lock"


# What each array is for. Code that wants every array of a kind (what a training step reads,
# the predictions a check compares) asks for its role, so an array added below reaches it.
SAMPLE_TOKENS = "sample_tokens"   # the conversation itself: token ids and the loss mask
HARD_LABEL = "hard_label"         # the target's argmax: the label of the cross-entropy loss
SOFT_LABEL = "soft_label"         # the rest of the target's prediction, for the KL loss
HIDDEN_STATE = "hidden_state"     # the tap outputs, stored in the cache's hidden format
SAMPLE_INDEX = "sample_index"     # per sample: where its tokens are, and which dataset row it is

# Each array's name: its directory in a shard, and its key in a sample as the reader returns it.
# Code names an array by these constants, never by a string of its own (tests/cache/
# test_array_names.py keeps it so); the specs below give each one its dtype, shape and role.
INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"
TARGET_ARGMAX = "target_argmax"
TARGET_TOPK_IDS = "target_topk_ids"
TARGET_TOPK_LOGITS = "target_topk_logits"
TARGET_LOGSUMEXP = "target_logsumexp"
OFFSETS = "offsets"
SAMPLE_ID = "sample_id"           # a sample's stable id; a sample read with its id carries it under this key too
# The tap outputs' stored array; a decoded sample carries the float tap outputs under this key too.
HIDDEN = "hidden"
HIDDEN_SCALE = "hidden_scale"     # fp8 only: the per-token, per-tap scale of HIDDEN


@dataclass(frozen=True, kw_only=True)
class ArraySpec:
    name: str
    dtype: str                 # stored numpy dtype
    inner: tuple[str, ...]     # symbolic inner dims after the leading token/sample dim
    per: str                   # "token" or "sample"
    logical: str               # what the stored values mean
    role: str                  # one of the roles above
    fencepost: bool = False    # one entry more than there are samples (offsets: a start and an end)

    @property
    def full_width(self) -> bool:
        """The tap outputs (hidden_size values a tap, or the R of a projected cache): the array
        whose chunks are sized in bytes, the bulk of the cache."""
        return "tap_width" in self.inner

    def length(self, *, samples: int, tokens: int) -> int:
        """Entries along the leading dimension in a shard of this many samples and tokens."""
        return tokens if self.per == "token" else samples + self.fencepost

    def shape(self, dims: dict[str, int], *, samples: int, tokens: int) -> tuple[int, ...]:
        return (self.length(samples=samples, tokens=tokens), *inner_shape(self, dims))


# The arrays every cache has, whatever its hidden format (in the order a shard creates them).
_SHARED_SPECS = (
    ArraySpec(name=INPUT_IDS, dtype="int32", inner=(), per="token", logical="token id", role=SAMPLE_TOKENS),
    ArraySpec(name=LOSS_MASK, dtype="uint8", inner=(), per="token", logical="1 = supervised (DESIGN 3.5)",
              role=SAMPLE_TOKENS),
    ArraySpec(name=TARGET_ARGMAX, dtype="int32", inner=(), per="token",
              logical="target's argmax prediction of the NEXT token, from its output logits at this position",
              role=HARD_LABEL),
    ArraySpec(name=TARGET_TOPK_IDS, dtype="int32", inner=("top_k",), per="token", logical="top-k ids, logits descending",
              role=SOFT_LABEL),
    ArraySpec(name=TARGET_TOPK_LOGITS, dtype="float32", inner=("top_k",), per="token",
              logical="top-k logits, descending", role=SOFT_LABEL),
    ArraySpec(name=TARGET_LOGSUMEXP, dtype="float32", inner=(), per="token",
              logical="full-vocabulary logsumexp of the logits", role=SOFT_LABEL),
    ArraySpec(name=OFFSETS, dtype="int64", inner=(), per="sample", logical="sample s = tokens offsets[s]:offsets[s+1]",
              role=SAMPLE_INDEX, fencepost=True),
    ArraySpec(name=SAMPLE_ID, dtype="int64", inner=(), per="sample", logical="row index of the sample in the dataset",
              role=SAMPLE_INDEX),
)

# The arrays that hold the tap outputs, by hidden format (pipeline/cache/encoding.py writes them).
# Their rows: the n_taps taps of hidden_size values each, or, in a projected cache, one row of
# the R projected values (`tap_rows`, below). A row is what one fp8 scale covers.
_HIDDEN_SPECS = {
    "bf16": (
        ArraySpec(name=HIDDEN, dtype="uint16", inner=("tap_rows", "tap_width"), per="token",
                  logical="bfloat16 bit pattern of tap outputs (of their projection in a projected cache)",
                  role=HIDDEN_STATE),
    ),
    "fp8": (
        ArraySpec(name=HIDDEN, dtype="uint8", inner=("tap_rows", "tap_width"), per="token",
                  logical="float8_e4m3fn bit pattern; value = fp8 * hidden_scale", role=HIDDEN_STATE),
        ArraySpec(name=HIDDEN_SCALE, dtype="float32", inner=("tap_rows",), per="token",
                  logical="per-token, per-tap (per-token, projected) scale of the fp8 hidden states",
                  role=HIDDEN_STATE),
    ),
}


def tap_rows(dims: dict[str, int]) -> tuple[int, int]:
    """(rows, values a row) of the stored tap outputs of one token: (n_taps, hidden_size), or
    (1, R) in a cache projected to R values a token (dims["projected_rank"])."""
    projected_rank = dims.get("projected_rank")
    return (1, projected_rank) if projected_rank else (dims["n_taps"], dims["hidden_size"])
HIDDEN_FORMATS = tuple(_HIDDEN_SPECS)


def array_specs(hidden_format: str) -> list[ArraySpec]:
    """Every array a shard holds, for the given hidden-state format."""
    if hidden_format not in HIDDEN_FORMATS:
        raise ValueError(f"hidden_format must be one of {HIDDEN_FORMATS}, got {hidden_format!r}")
    return [*_SHARED_SPECS, *_HIDDEN_SPECS[hidden_format]]


def token_specs(hidden_format: str) -> list[ArraySpec]:
    """The per-token arrays: one row per token of every sample (what the writer appends)."""
    return [spec for spec in array_specs(hidden_format) if spec.per == "token"]


def role_names(*roles: str) -> tuple[str, ...]:
    """Names of the arrays with these roles, in schema order. The hidden-state arrays depend on
    the format, so they are not asked for here (see array_specs and encoding.decode_hidden)."""
    if HIDDEN_STATE in roles:
        raise ValueError("the hidden-state arrays depend on the hidden format: use array_specs(hidden_format)")
    return tuple(spec.name for spec in _SHARED_SPECS if spec.role in roles)


def inner_shape(spec: ArraySpec, dims: dict[str, int]) -> tuple[int, ...]:
    rows, width = tap_rows(dims)
    return tuple({"tap_rows": rows, "tap_width": width}.get(d) or dims[d] for d in spec.inner)


@dataclass(frozen=True, kw_only=True)
class Chunking:
    """How token arrays are cut into inner chunks (the unit of decoding) and files (the unit the
    filesystem sees). The defaults fit the flagship width (5 taps x 5120, 51,200 bytes a token):
    64-token hidden chunks (3.2 MiB raw; reading a sample decodes at most one extra chunk at each
    end) and 256 of them per file (16,384 tokens, 0.84 GB raw): 61,035 hidden files per 1e9
    tokens. Small arrays: 65,536-token chunks, 16 per file. The writer holds one file of each
    token array in memory before writing it (see writer_buffer_bytes)."""

    hidden_chunk_bytes: int = 4 * 2**20   # target raw bytes of one hidden-state inner chunk
    hidden_chunks_per_file: int = 256
    small_chunk_tokens: int = 65_536      # inner chunk of every other per-token array
    small_chunks_per_file: int = 16

    def __post_init__(self):
        for name in ("hidden_chunk_bytes", "hidden_chunks_per_file", "small_chunk_tokens", "small_chunks_per_file"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= 2**32:
                raise ValueError(f"chunking.{name} must be an integer in 1..2^32, got {value!r}")

    @classmethod
    def from_options(cls, options: dict | None) -> "Chunking":
        unknown = set(options or {}) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown chunking option(s) {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**(options or {}))

    def chunk_tokens(self, spec: ArraySpec, dims: dict[str, int]) -> int:
        """Inner chunk length along the token axis (a power of two)."""
        if not spec.full_width:
            return self.small_chunk_tokens
        tokens = max(16, self.hidden_chunk_bytes // max(token_bytes(spec, dims), 1))
        return 1 << (tokens.bit_length() - 1)

    def file_tokens(self, spec: ArraySpec, dims: dict[str, int]) -> int:
        per_file = self.hidden_chunks_per_file if spec.full_width else self.small_chunks_per_file
        return self.chunk_tokens(spec, dims) * per_file

    def record(self) -> dict:
        """What decides the layout (part of the cache's identity in the manifest)."""
        return {"format": "zarr v3 sharding_indexed (inner: bytes, zstd, crc32c; index: crc32c, at the end)",
                "chunk_key": f"default, separator {FILE_KEY_SEPARATOR!r}", "options": dict(self.__dict__)}

    def geometry(self, hidden_format: str, dims: dict[str, int]) -> dict:
        """What the options give at these dimensions, per token array, and the writer's memory."""
        arrays = {spec.name: {"chunk_tokens": self.chunk_tokens(spec, dims), "file_tokens": self.file_tokens(spec, dims)}
                  for spec in token_specs(hidden_format)}
        return {"arrays": arrays, "writer_buffer_bytes": self.writer_buffer_bytes(hidden_format, dims)}

    def writer_buffer_bytes(self, hidden_format: str, dims: dict[str, int]) -> int:
        """Raw bytes a shard writer holds at most: one file of every token array."""
        return sum(self.file_tokens(s, dims) * token_bytes(s, dims) for s in token_specs(hidden_format))

    def files(self, hidden_format: str, dims: dict[str, int], tokens: int) -> int:
        """Data files of one shard of `tokens` tokens (add PER_SHARD_FILES for metadata)."""
        return sum(-(-tokens // self.file_tokens(s, dims)) for s in token_specs(hidden_format)) \
            + sum(1 for s in array_specs(hidden_format) if s.per == "sample")


def raw_shard_bytes(hidden_format: str, dims: dict[str, int], *, samples: int, tokens: int) -> int:
    """Every array of a shard of this many samples and tokens, uncompressed (shape x itemsize):
    what `extract --dry-run` estimates and `cache-info` compares stored bytes with."""
    return sum(token_bytes(s, dims) * s.length(samples=samples, tokens=tokens) for s in array_specs(hidden_format))


# Besides data files a shard holds: the group's and each array's zarr.json, and digests.json.
def per_shard_files(hidden_format: str) -> int:
    return 1 + len(array_specs(hidden_format)) + 1


def token_bytes(spec: ArraySpec, dims: dict[str, int]) -> int:
    import numpy as np
    return int(np.prod(inner_shape(spec, dims))) * np.dtype(spec.dtype).itemsize


def file_key(name: str, index: int, ndim: int) -> str:
    """Relative path of file `index` (along the token axis) of an array with `ndim` dimensions."""
    return FILE_KEY_SEPARATOR.join([f"{name}/c", str(index), *["0"] * (ndim - 1)])


def check_dims(dims: dict[str, int]) -> None:
    """Bounds on declared sizes, checked before any allocation (caches are untrusted input)."""
    limits = {"n_taps": MAX_TAPS, "hidden_size": MAX_HIDDEN, "top_k": MAX_TOP_K, "vocab_size": MAX_VOCAB}
    for key, limit in limits.items():
        value = dims.get(key)
        if not isinstance(value, int) or not 0 < value <= limit:
            raise ValueError(f"{key}={value!r} is outside 1..{limit}")
    projected_rank = dims.get("projected_rank")
    if projected_rank is not None and (not isinstance(projected_rank, int)
                                       or not 0 < projected_rank < dims["n_taps"] * dims["hidden_size"]):
        raise ValueError(f"projected_rank={projected_rank!r} is outside 1..n_taps x hidden_size - 1")
