"""Hidden-state encodings shared by writer and reader.

bf16: the exact 16-bit pattern of the bfloat16 value (lossless w.r.t. a bf16 cast).
fp8:  float8_e4m3fn with one float32 scale per (token, tap): scale = amax / 448, so the
      largest magnitude of each token's tap maps to the top of the e4m3 range. Half the bytes
      of bf16; relative error about 2^-4 per element.
"""

from __future__ import annotations

import numpy as np
import torch

from pipeline.cache.schema import FP8_MAX


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


def encode_rows(hidden_format: str, ids: list[int], mask: list[int], out: dict) -> dict[str, np.ndarray]:
    rows = {
        "input_ids": np.asarray(ids, dtype=np.int32),
        "loss_mask": np.asarray(mask, dtype=np.uint8),
        "target_argmax": out["target_argmax"].numpy().astype(np.int32),
        "target_topk_ids": out["target_topk_ids"].numpy().astype(np.int32),
        "target_topk_logits": out["target_topk_logits"].numpy().astype(np.float32),
        "target_logsumexp": out["target_logsumexp"].numpy().astype(np.float32),
    }
    if hidden_format == "bf16":
        rows["hidden"] = encode_bf16(out["hidden"])
    else:
        rows["hidden"], rows["hidden_scale"] = encode_fp8(out["hidden"])
    return rows
