"""The DFlash block-diffusion drafter (DESIGN 2), written from the design, not copied.

A few Qwen3-style decoder layers. Context features: the target's tapped hidden states (`hidden`), concatenated per
position, go through `fc` (n*H -> H, no bias) and `hidden_norm` once; every layer projects that
shared context with its own k_proj/v_proj (k_norm on both), so keys and values are
[context ; block] while queries come from the block only. The context never enters q_proj,
the MLP or the residual stream. RoPE uses absolute positions: context 0..T-1, block a..a+B-1.

All anchors of a sequence go through one forward: the block tokens of every anchor are laid
side by side as queries, and a boolean mask lets block j see context positions < a_j (strictly:
at inference the anchor has no target hidden state yet) and its own B slots (bidirectional),
never another block.

The token embedding and lm_head are the target's, frozen, and live outside this module.
Cost per sequence: layers x (A*B queries) x (T + A*B keys).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn


@dataclass(kw_only=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: list[int]
    num_target_layers: int
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [B, heads, N, D] rotated by absolute positions [B, N]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = positions.float()[..., None] * inv                      # [B, N, D/2]
    emb = torch.cat((angles, angles), dim=-1)[:, None]                # [B, 1, N, D]
    return (x.float() * emb.cos() + rotate_half(x.float()) * emb.sin()).to(x.dtype)


class DraftAttention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(c.head_dim, eps=c.rms_norm_eps)
        self.k_norm = nn.RMSNorm(c.head_dim, eps=c.rms_norm_eps)

    def forward(self, block_BQH, context_BTH, block_pos, context_pos, allowed_BQK, anchors_BA):
        c = self.c
        b, q_len, _ = block_BQH.shape
        kv_in = torch.cat([context_BTH, block_BQH], dim=1)
        q = self.q_norm(self.q_proj(block_BQH).view(b, q_len, -1, c.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(b, kv_in.shape[1], -1, c.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, kv_in.shape[1], -1, c.head_dim).transpose(1, 2)
        q = rope(q, block_pos, c.rope_theta)
        k = rope(k, torch.cat([context_pos, block_pos], dim=1), c.rope_theta)
        repeat = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        if anchors_BA is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_BQK[:, None])
        else:
            out = split_block_attention(q, k, v, context_BTH.shape[1], anchors_BA)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


# Queries per piece of `split_block_attention`: one piece's fp32 scores [heads, queries, T + B]
# stay near this size; a piece's scores are recomputed in backward instead of kept.
ATTENTION_PIECE_BYTES = 64 * 2**20


def split_block_attention(q, k, v, context_len: int, anchors_BA: torch.Tensor, piece_anchors: int | None = None):
    """The attention of all anchors' blocks without the [Q, T+Q] mask: the context part [Q, T]
    (key t visible to a query of the block at anchor a iff t < a) and the in-block part
    [A, B, B] (bidirectional), normalised by one softmax over both. The Q x Q region of the dense
    mask, where every block but the query's own is masked, is never formed (at the flagship
    67 M of the 92 M mask entries per sequence). Anchors are taken a piece at a time under
    activation checkpointing, so the scores of one piece exist at once, in forward and again in
    backward. Same result as SDPA with `block_mask`."""
    b, h, q_len, d = q.shape
    a = anchors_BA.shape[1]
    block = q_len // a
    if piece_anchors is None:
        piece_anchors = max(1, ATTENTION_PIECE_BYTES // (4 * b * h * block * (context_len + block)))
    kc, vc = k[:, :, :context_len], v[:, :, :context_len]
    pieces = []
    for i in range(0, a, piece_anchors):
        j = min(i + piece_anchors, a)
        args = (q[:, :, i * block:j * block], kc, vc, k[:, :, context_len + i * block:context_len + j * block],
                v[:, :, context_len + i * block:context_len + j * block], anchors_BA[:, i:j])
        if torch.is_grad_enabled() and j - i < a:
            pieces.append(torch.utils.checkpoint.checkpoint(_attention_piece, *args, use_reentrant=False))
        else:
            pieces.append(_attention_piece(*args))
    return torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]


def _attention_piece(q, kc, vc, kb, vb, anchors_BA):
    b, h, q_len, d = q.shape
    a = anchors_BA.shape[1]
    block, context_len = q_len // a, kc.shape[2]
    limit = anchors_BA.repeat_interleave(block, dim=1)                                   # [b, Q]: each query's anchor
    hidden_keys = torch.arange(context_len, device=q.device)[None, :] >= limit[..., None]  # [b, Q, T]
    q = q * d ** -0.5  # on [Q, d], not on the [Q, T] scores
    # In place on the matmul's output (its backward needs q and k, not it): one [h, Q, T] buffer.
    context = (q @ kc.transpose(-1, -2)).float().masked_fill_(hidden_keys[:, None], float("-inf"))
    inner = (q.view(b, h, a, block, d) @ kb.view(b, h, a, block, d).transpose(-1, -2)).float()
    p = torch.softmax(torch.cat([context, inner.view(b, h, q_len, block)], dim=-1), dim=-1).to(vc.dtype)
    del context
    out = p[..., :context_len] @ vc
    return out + (p[..., context_len:].reshape(b, h, a, block, block) @ vb.view(b, h, a, block, d)).view(b, h, q_len, d)


class DraftLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = DraftAttention(c)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = nn.ModuleDict({
            "gate_proj": nn.Linear(c.hidden_size, c.intermediate_size, bias=False),
            "up_proj": nn.Linear(c.hidden_size, c.intermediate_size, bias=False),
            "down_proj": nn.Linear(c.intermediate_size, c.hidden_size, bias=False),
        })

    def forward(self, x, context, block_pos, context_pos, allowed, anchors):
        x = x + self.self_attn(self.input_layernorm(x), context, block_pos, context_pos, allowed, anchors)
        h = self.post_attention_layernorm(x)
        return x + self.mlp["down_proj"](F.silu(self.mlp["gate_proj"](h)) * self.mlp["up_proj"](h))


class DFlashDrafter(nn.Module):
    """Trainable part of the drafter. `embed` and `lm_head` are the target's frozen modules."""

    def __init__(self, c: DrafterConfig, *, embed: nn.Embedding, lm_head: nn.Linear):
        super().__init__()
        self.config = c
        n = len(c.target_layer_ids)
        self.fc = nn.Linear(n * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        # Frozen and shared with the target: kept out of this module's parameters and state.
        self._frozen = {"embed": embed.requires_grad_(False), "lm_head": lm_head.requires_grad_(False)}
        self.reset_parameters()

    def _apply(self, fn, recurse=True):
        # .to(device) / .float() must move the frozen shared modules too.
        super()._apply(fn, recurse)
        for module in self._frozen.values():
            module._apply(fn, recurse)
        return self

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=1.0 / math.sqrt(module.in_features))

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self._frozen["lm_head"].weight

    def forward(self, hidden_BTNH: torch.Tensor, block_ids_BQ: torch.Tensor, block_pos_BQ: torch.Tensor,
                allowed_BQK: torch.Tensor | None = None, *, anchors_BA: torch.Tensor | None = None,
                logits: bool = True) -> torch.Tensor:
        """Logits [B, Q, V] for block tokens, given the tapped hidden states [B, T, n, H]; with
        `logits=False` the final normed states [B, Q, H] the lm_head would take (training computes
        its loss from those a chunk at a time: pipeline/drafter/loss.py). Attention follows the
        dense mask `allowed_BQK`, or, given the anchors of equal-size blocks instead, the same rule
        without the mask (`split_block_attention`, what training uses)."""
        if (allowed_BQK is None) == (anchors_BA is None):
            raise ValueError("pass exactly one of allowed_BQK and anchors_BA")
        b, t = hidden_BTNH.shape[:2]
        context = self.hidden_norm(self.fc(hidden_BTNH.reshape(b, t, -1)))
        context_pos = torch.arange(t, device=context.device).expand(b, t)
        x = self._frozen["embed"](block_ids_BQ).to(context.dtype)
        for layer in self.layers:
            x = layer(x, context, block_pos_BQ, context_pos, allowed_BQK, anchors_BA)
        x = self.norm(x)
        return self._frozen["lm_head"](x) if logits else x
