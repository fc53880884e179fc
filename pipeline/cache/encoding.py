"""How values become the arrays a shard stores, and back.

bf16: the exact 16-bit pattern of the bfloat16 value (lossless w.r.t. a bf16 cast).
fp8:  float8_e4m3fn with one float32 scale per (token, tap): scale = amax / 448, so the
      largest magnitude of each token's tap maps to the top of the e4m3 range. Half the bytes
      of bf16; relative error about 2^-4 per element.

`encode_rows` turns one sample (its ids, loss mask and the target's outputs) into every per-token
array of the schema, each in its stored dtype: the schema (pipeline/cache/schema.py) decides which
arrays there are, so an array added there is encoded here without a change.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from pipeline.cache.schema import FP8_MAX, HIDDEN, HIDDEN_SCALE, INPUT_IDS, LOSS_MASK, token_specs


def encode_bf16(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)


def decode_bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def encode_fp8(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """x [..., H] -> (uint8 bits [..., H], float32 scale [...])."""
    x = x.float()
    scale = x.abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).cpu().numpy(), scale.cpu().numpy().astype(np.float32)


def decode_fp8(bits: np.ndarray, scale: np.ndarray) -> torch.Tensor:
    q = torch.from_numpy(np.ascontiguousarray(bits)).view(torch.float8_e4m3fn).float()
    return q * torch.from_numpy(np.ascontiguousarray(scale)).unsqueeze(-1)


def encode_hidden(hidden_format: str, x: torch.Tensor) -> dict[str, np.ndarray]:
    """The stored hidden-state arrays of tap outputs x [tokens, n_taps, H], by array name."""
    if hidden_format == "bf16":
        return {HIDDEN: encode_bf16(x)}
    bits, scale = encode_fp8(x)
    return {HIDDEN: bits, HIDDEN_SCALE: scale}


def decode_hidden(hidden_format: str, read: Callable[[str], np.ndarray]) -> torch.Tensor:
    """Inverse of encode_hidden; `read(name)` returns that stored array over the wanted tokens
    (and taps). bfloat16 for bf16 caches, float32 for fp8."""
    if hidden_format == "bf16":
        return decode_bf16(read(HIDDEN))
    return decode_fp8(read(HIDDEN), read(HIDDEN_SCALE))


def encode_rows(hidden_format: str, ids: list[int], mask: list[int],
                target_outputs: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """One sample as a shard stores it: {array name: values in the stored dtype} for every
    per-token array of the schema. `target_outputs` holds what the target computed for the
    sample under the arrays' names, the tap outputs under "hidden" (float, before encoding)."""
    values = {INPUT_IDS: ids, LOSS_MASK: mask, **target_outputs}
    values.update(encode_hidden(hidden_format, values.pop(HIDDEN)))
    rows = {}
    for spec in token_specs(hidden_format):
        if spec.name not in values:
            raise ValueError(f"cache array {spec.name!r} has no values: the schema declares it, the capture "
                             f"did not produce it (has {sorted(values)})")
        value = values[spec.name]
        # asarray: a value already in its stored dtype (the encoded hidden states) is not copied.
        rows[spec.name] = np.asarray(value.numpy() if isinstance(value, torch.Tensor) else value, dtype=spec.dtype)
    return rows
