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

Layer kinds (`layer_types`, as transformers' Qwen3 config names them). A `full_attention` layer
follows the rule above. A `sliding_attention` layer is what the serving engines run for it (vLLM
resolves a sliding DFlash layer as causal with the window `sliding_window`; SGLang and the
SpecForge trainer agree): the query at position p = a + k sees keys at positions in
(p - W, p], so context t with p - W < t < a and block slots j <= k (causal inside the block).
Transformers' own flash path would apply the same window non-causally and its SDPA path not at
all; the export is meant for the engines, so training, eval and the export follow them. The rule's
masks and the ways to compute it (dense, split, flex, decoding's suffix) are attention_rule.py.

The token embedding and lm_head are the target's, frozen, and live outside this module.
Cost per sequence: layers x (A*B queries) x (T + A*B keys).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# Re-exported: benchmarks and tests import the config from this module (the library imports
# pipeline.drafter.config).
from pipeline.drafter.attention_rule import attention_path, dense_attention, flex_attention, split_attention
from pipeline.drafter.config import FULL, SLIDING, DrafterConfig  # noqa: F401
from pipeline.drafter.vocab import DraftHead, DraftVocab


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
    def __init__(self, c: DrafterConfig, layer: int):
        super().__init__()
        self.c = c
        self.layer = layer  # which layer's cached keys and values are this module's (incremental.py)
        self.window = c.window(layer)
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(c.head_dim, eps=c.rms_norm_eps)
        self.k_norm = nn.RMSNorm(c.head_dim, eps=c.rms_norm_eps)

    def query(self, x_BNH, pos_BN):
        """[B, heads, N, D]: normed, rotated queries."""
        b, n, _ = x_BNH.shape
        return rope(self.q_norm(self.q_proj(x_BNH).view(b, n, -1, self.c.head_dim)).transpose(1, 2), pos_BN, self.c.rope_theta)

    def key_value(self, x_BNH, pos_BN):
        """([B, kv heads, N, D] keys normed and rotated, values) of context features or block states:
        a position's pair depends on that position alone, so decoding caches the context's
        (pipeline/drafter/incremental.py) and hands them in through `context_kv`."""
        b, n, _ = x_BNH.shape
        k = self.k_norm(self.k_proj(x_BNH).view(b, n, -1, self.c.head_dim)).transpose(1, 2)
        return rope(k, pos_BN, self.c.rope_theta), self.v_proj(x_BNH).view(b, n, -1, self.c.head_dim).transpose(1, 2)

    def forward(self, block_BQH, context_kv, block_pos, attend):
        """`context_kv(self)`: the context's keys and values this layer attends to, projected from
        the features here (`DFlashDrafter.forward`) or read from the decoding cache."""
        b, q_len, _ = block_BQH.shape
        q = self.query(block_BQH, block_pos)
        kc, vc = context_kv(self)
        kb, vb = self.key_value(block_BQH, block_pos)
        out = attend(q, torch.cat([kc, kb], dim=2), torch.cat([vc, vb], dim=2), self.window)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DraftLayer(nn.Module):
    def __init__(self, c: DrafterConfig, layer: int):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = DraftAttention(c, layer)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = nn.ModuleDict({
            "gate_proj": nn.Linear(c.hidden_size, c.intermediate_size, bias=False),
            "up_proj": nn.Linear(c.hidden_size, c.intermediate_size, bias=False),
            "down_proj": nn.Linear(c.intermediate_size, c.hidden_size, bias=False),
        })

    def forward(self, x, context_kv, block_pos, attend):
        x = x + self.self_attn(self.input_layernorm(x), context_kv, block_pos, attend)
        return self.feed_forward(x)

    def feed_forward(self, x):
        h = self.post_attention_layernorm(x)
        return x + self.mlp["down_proj"](F.silu(self.mlp["gate_proj"](h)) * self.mlp["up_proj"](h))


class DFlashDrafter(nn.Module):
    """Trainable part of the drafter. `embed` and `lm_head` are the target's frozen modules; with a
    draft vocabulary (`config.draft_vocab_size`, the ids in `draft_vocab`: pipeline/drafter/vocab.py)
    the head is a frozen copy of those K rows of `lm_head`, which the caller may then drop."""

    def __init__(self, c: DrafterConfig, *, embed: nn.Embedding, lm_head: nn.Linear, draft_vocab: DraftVocab | None = None):
        super().__init__()
        if c.draft_vocab_size != (None if draft_vocab is None else draft_vocab.size):
            raise ValueError(f"draft_vocab_size {c.draft_vocab_size} but "
                             f"{'no draft vocabulary' if draft_vocab is None else f'{draft_vocab.size} draft ids'} given")
        self.config = c
        n = len(c.target_layer_ids)
        self.fc = nn.Linear(c.projected_rank or n * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(c, i) for i in range(c.num_hidden_layers))
        self.attention = "auto"  # how anchors-based attention runs: ATTENTION_PATHS
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        # Frozen and shared with the target: kept out of this module's parameters and state.
        head = lm_head if draft_vocab is None else DraftHead(lm_head, draft_vocab)
        self._frozen = {"embed": embed.requires_grad_(False), "lm_head": head.requires_grad_(False)}
        # A projected cache's component scales s (`use_basis`): fc' reads z * s where
        # config.projected_energy. Not a parameter and not saved: the cache's basis holds them.
        self.register_buffer("tap_scales", None, persistent=False)
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
        if self.config.projected_energy:
            # The whole-tap fc's init W ~ N(0, 1/(n*H)) restricted to the basis, W P^T, is N(0, 1/(n*H))
            # too (P's rows are orthonormal): the same draws, rescaled, so every other init is unchanged.
            width = len(self.config.target_layer_ids) * self.config.hidden_size
            with torch.no_grad():
                self.fc.weight.mul_(math.sqrt(self.fc.in_features / width))

    def use_basis(self, basis) -> None:
        """Give a projected drafter its cache's basis (pipeline/projection/basis.py): fc' then reads
        z * s where config.projected_energy (a no-op otherwise)."""
        if self.config.projected_rank != basis.projected_rank:
            raise ValueError(f"the basis has {basis.projected_rank} components, this drafter's fc reads {self.config.projected_rank}")
        if self.config.projected_energy:
            self.tap_scales = basis.scales.detach().to(self.fc.weight.device, torch.float32).clone()

    def context_features(self, hidden_BTNH: torch.Tensor) -> torch.Tensor:
        """fc + hidden_norm of the concatenated taps, [B, T, H] (of the projected taps [B, T, 1, R]
        where `config.projected_rank` is R)."""
        b, t = hidden_BTNH.shape[:2]
        x = hidden_BTNH.reshape(b, t, -1)
        if self.config.projected_energy:
            if self.tap_scales is None:
                raise RuntimeError("a drafter of projected taps read at their energy needs its cache's basis: use_basis(basis)")
            x = x * self.tap_scales.to(x.dtype)
        return self.hidden_norm(self.fc(x))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._frozen["embed"](ids)

    def target_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary [..., V] of final states [..., H]; with a draft
        vocabulary the head's K logits, -inf elsewhere (as vLLM's DFlash model scatters them)."""
        head = self._frozen["lm_head"]
        return head(x) if self.draft_vocab is None else head.to_target(head(x))

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The head's weight: the target's lm_head, or its K draft-vocabulary rows (training's loss
        reads it, with labels in the head's ids)."""
        return self._frozen["lm_head"].weight

    @property
    def draft_vocab(self) -> DraftVocab | None:
        return getattr(self._frozen["lm_head"], "vocab", None)

    def block_states(self, block_ids_BQ: torch.Tensor, block_pos_BQ: torch.Tensor, context_kv, attend,
                     dtype: torch.dtype) -> torch.Tensor:
        """The final normed states [B, Q, H] of the block tokens: embedding (cast to `dtype`), every
        layer, norm. Each layer attends to the context keys and values `context_kv(self_attn)`
        gives it (forward: projected from the features; decoding: its cache) as `attend` rules."""
        x = self._frozen["embed"](block_ids_BQ).to(dtype)
        for layer in self.layers:
            x = layer(x, context_kv, block_pos_BQ, attend)
        return self.norm(x)

    def forward(self, hidden_BTNH: torch.Tensor, block_ids_BQ: torch.Tensor, block_pos_BQ: torch.Tensor,
                allowed_BQK: torch.Tensor | None = None, *, anchors_BA: torch.Tensor | None = None,
                logits: bool = True) -> torch.Tensor:
        """Logits [B, Q, V] (the target's vocabulary) for block tokens, given the tapped hidden states [B, T, n, H]; with
        `logits=False` the final normed states [B, Q, H] the lm_head would take (training computes
        its loss from those a chunk at a time: pipeline/training/loss.py). Attention follows the
        dense mask `allowed_BQK`, or, given the anchors of equal-size blocks instead, the same rule
        without a dense mask (`self.attention`: flex attention or `split_block_attention`, what
        training uses). Sliding-window layers narrow either by position (module docstring)."""
        if (allowed_BQK is None) == (anchors_BA is None):
            raise ValueError("pass exactly one of allowed_BQK and anchors_BA")
        b, t = hidden_BTNH.shape[:2]
        context = self.context_features(hidden_BTNH)
        context_pos = torch.arange(t, device=context.device).expand(b, t)
        if allowed_BQK is not None:
            attend = dense_attention(allowed_BQK, block_pos_BQ, context_pos)
        elif attention_path(self.attention, context.device) == "flex":
            windows = {self.config.window(i) for i in range(len(self.layers))}
            attend = flex_attention(anchors_BA, t, block_ids_BQ.shape[1], windows, compiled=context.is_cuda)
        else:
            attend = split_attention(anchors_BA, t)

        def context_kv(attn: DraftAttention):  # every layer projects the shared context with its own k/v
            return attn.key_value(context, context_pos)
        x = self.block_states(block_ids_BQ, block_pos_BQ, context_kv, attend, context.dtype)
        return self.target_logits(x) if logits else x
