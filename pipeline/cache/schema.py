"""The cache format, owned in one place (DESIGN 5).

Layout of a cache directory:

    manifest.json            written last, atomically; lists committed shards (the commit marker)
    manifest.lock            advisory lock for manifest read-modify-write
    shard-00000/             one Zarr v3 group per shard, visible only once complete
    .shard-00000.tmp/        a shard being written (never read; removed on resume)
    .shard-00000.lock        held while a process writes that shard

A shard is ragged and token-major: per-token arrays indexed by a global token position inside
the shard, per-sample `offsets` [samples + 1] into them and stable `sample_id`s. Chunks are
token ranges, so reading sample s positions i..j decodes only the chunks that overlap.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SCHEMA_VERSION = 1
FORMAT_NAME = "dflash-hidden-state-cache"

MANIFEST = "manifest.json"
MANIFEST_LOCK = "manifest.lock"
_SHARD_RE = re.compile(r"^shard-(\d{5})$")

# Hard bounds checked before anything is allocated from what a manifest or shard declares.
MAX_SHARDS = 100_000
MAX_TAPS = 64
MAX_HIDDEN = 65_536
MAX_TOP_K = 1_024
MAX_VOCAB = 2**24

HIDDEN_FORMATS = ("bf16", "fp8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn

# Target chunk size in raw bytes for the hidden array: large enough to compress well,
# small enough that fetching one sample's positions decodes little extra.
HIDDEN_CHUNK_BYTES = 4 * 2**20
SMALL_CHUNK_TOKENS = 65_536


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def shard_index(name: str) -> int:
    """Inverse of shard_name; refuses anything else (manifest names are untrusted input)."""
    m = _SHARD_RE.match(name)
    if not m:
        raise ValueError(f"not a shard name: {name!r}")
    return int(m.group(1))


def temp_shard_name(index: int) -> str:
    return f".{shard_name(index)}.tmp"


def shard_lock_name(index: int) -> str:
    return f".{shard_name(index)}.lock"


@dataclass(frozen=True, kw_only=True)
class ArraySpec:
    name: str
    dtype: str                 # stored numpy dtype
    inner: tuple[str, ...]     # symbolic inner dims after the leading token/sample dim
    per: str                   # "token" or "sample"
    logical: str               # what the stored values mean


def array_specs(hidden_format: str) -> list[ArraySpec]:
    """Every array a shard holds, for the given hidden-state format."""
    if hidden_format not in HIDDEN_FORMATS:
        raise ValueError(f"hidden_format must be one of {HIDDEN_FORMATS}, got {hidden_format!r}")
    specs = [
        ArraySpec(name="input_ids", dtype="int32", inner=(), per="token", logical="token id"),
        ArraySpec(name="loss_mask", dtype="uint8", inner=(), per="token", logical="1 = supervised (DESIGN 3.5)"),
        ArraySpec(name="target_argmax", dtype="int32", inner=(), per="token",
                  logical="target's argmax prediction of the NEXT token, from its output logits at this position"),
        ArraySpec(name="target_topk_ids", dtype="int32", inner=("top_k",), per="token", logical="top-k ids, logits descending"),
        ArraySpec(name="target_topk_logits", dtype="float32", inner=("top_k",), per="token", logical="top-k logits, descending"),
        ArraySpec(name="target_logsumexp", dtype="float32", inner=(), per="token", logical="full-vocabulary logsumexp of the logits"),
        ArraySpec(name="offsets", dtype="int64", inner=(), per="sample", logical="sample s = tokens offsets[s]:offsets[s+1]"),
        ArraySpec(name="sample_id", dtype="int64", inner=(), per="sample", logical="row index of the sample in the dataset"),
    ]
    if hidden_format == "bf16":
        specs.append(ArraySpec(name="hidden", dtype="uint16", inner=("n_taps", "hidden_size"), per="token",
                               logical="bfloat16 bit pattern of tap outputs"))
    else:
        specs.append(ArraySpec(name="hidden", dtype="uint8", inner=("n_taps", "hidden_size"), per="token",
                               logical="float8_e4m3fn bit pattern; value = fp8 * hidden_scale"))
        specs.append(ArraySpec(name="hidden_scale", dtype="float32", inner=("n_taps",), per="token",
                               logical="per-token, per-tap scale of the fp8 hidden states"))
    return specs


def inner_shape(spec: ArraySpec, dims: dict[str, int]) -> tuple[int, ...]:
    return tuple(dims[d] for d in spec.inner)


def chunk_tokens(spec: ArraySpec, dims: dict[str, int]) -> int:
    """Chunk length along the token axis; the hidden array targets HIDDEN_CHUNK_BYTES per chunk."""
    if spec.name != "hidden":
        return SMALL_CHUNK_TOKENS
    import numpy as np
    per_token = int(np.prod(inner_shape(spec, dims))) * np.dtype(spec.dtype).itemsize
    tokens = max(16, HIDDEN_CHUNK_BYTES // max(per_token, 1))
    return 1 << (tokens.bit_length() - 1)  # a power of two


def check_dims(dims: dict[str, int]) -> None:
    """Bounds on declared sizes, checked before any allocation (caches are untrusted input)."""
    limits = {"n_taps": MAX_TAPS, "hidden_size": MAX_HIDDEN, "top_k": MAX_TOP_K, "vocab_size": MAX_VOCAB}
    for key, limit in limits.items():
        value = dims.get(key)
        if not isinstance(value, int) or not 0 < value <= limit:
            raise ValueError(f"{key}={value!r} is outside 1..{limit}")
