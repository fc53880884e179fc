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
all; the export is meant for the engines, so training, eval and the export follow them.

The token embedding and lm_head are the target's, frozen, and live outside this module.
Cost per sequence: layers x (A*B queries) x (T + A*B keys).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

# Re-exported: benchmarks and tests import the config from this module (the library imports
# pipeline.drafter.config).
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


def block_mask(anchors_SA: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """allowed [S, A*B, T + A*B]: block j of sequence s sees context positions < anchors[s, j]
    (strictly: at inference the anchor has no target hidden state yet) and its own B slots,
    never another block. Built where the anchors live (on the GPU in training), so the mask is
    never shipped. A padding block (anchor 0) sees only itself: no all-False row, no NaN."""
    s, a = anchors_SA.shape
    owner = torch.arange(a * block_size, device=anchors_SA.device) // block_size
    sees_context = torch.arange(context_len, device=anchors_SA.device)[None, None, :] < anchors_SA[:, owner][..., None]
    sees_block = (owner[:, None] == owner[None, :]).expand(s, -1, -1)
    return torch.cat([sees_context, sees_block], dim=-1)


def window_mask(query_pos_BQ: torch.Tensor, key_pos_BK: torch.Tensor, window: int) -> torch.Tensor:
    """[B, Q, K]: key visible to a sliding layer's query iff query_pos - window < key_pos <= query_pos."""
    q, k = query_pos_BQ[..., :, None], key_pos_BK[..., None, :]
    return (k <= q) & (k > q - window)


def window_start(first_query_pos: int, window: int | None) -> int:
    """The first context position that queries from `first_query_pos` on can see: 0 in a
    full-attention layer; in a sliding one, keys before it are outside every such query's window."""
    return 0 if window is None else max(0, first_query_pos - window + 1)


def dense_attention(allowed_BQK, block_pos_BQ, context_pos_BT):
    """Attention under an explicit mask [B, Q, T + Q] (eval's one block, and the reference);
    a sliding layer further restricts it by position (`window_mask`)."""
    key_pos = torch.cat([context_pos_BT, block_pos_BQ], dim=1)

    def attend(q, k, v, window):
        allowed = allowed_BQK if window is None else allowed_BQK & window_mask(block_pos_BQ, key_pos, window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], enable_gqa=True)
    return attend


def suffix_attention(block_pos_BQ):
    """One block attending to the context positions right before it (a suffix of the context,
    as the decoding cache hands them over: from the layer's `window_start`), then to itself. A
    full layer needs no mask: the block sees all of it. A sliding layer masks by position
    (`window_mask`), the key positions following from that layout."""
    def attend(q, k, v, window):
        if window is None:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        first_key = block_pos_BQ[:, :1] - (k.shape[2] - q.shape[2])
        key_pos = first_key + torch.arange(k.shape[2], device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(block_pos_BQ, key_pos, window)[:, None],
                                              enable_gqa=True)
    return attend


# Queries per piece of `split_block_attention` (8 anchors of 16, 16 of 8): the fastest or tied
# on 2 CPU cores at each shape of benchmarks/training/attention_pieces.py (the demo's drafter at 250 and
# 2,048 tokens, hidden 1024 at 2,048 tokens x 512 anchors; BENCHMARKS "The newcomer's hour").
PIECE_QUERIES = 128


class _PieceRows(torch.autograd.Function):
    """Each piece's keys (or values) as one tensor: the context rows [low, high) it can see, then its
    own blocks' rows. Backward adds every piece's gradient into one buffer. (Slicing the full tensor
    once per piece instead makes autograd allocate, zero and sum one full-size gradient per piece:
    at hidden 512 that, not the attention, was most of the step; issue 32.)"""

    @staticmethod
    def forward(ctx, rows, context_len: int, spans: list[tuple[int, int, int, int]]):
        ctx.shape, ctx.context_len, ctx.spans = rows.shape, context_len, spans
        return tuple(torch.cat([rows[:, :, low:high], rows[:, :, context_len + q0:context_len + q1]], dim=2)
                     for low, high, q0, q1 in spans)

    @staticmethod
    def backward(ctx, *grads):
        given = [g for g in grads if g is not None]
        if not given:  # no piece reached the loss
            return None, None, None
        grad = given[0].new_zeros(ctx.shape)
        c = ctx.context_len
        for g, (low, high, q0, q1) in zip(grads, ctx.spans):
            if g is not None:
                grad[:, :, low:high] += g[:, :, :high - low]
                grad[:, :, c + q0:c + q1] += g[:, :, high - low:]
        return grad, None, None


def split_block_attention(q, k, v, context_len: int, anchors_BA: torch.Tensor, window: int | None = None,
                          piece_anchors: int | None = None):
    """The attention of all anchors' blocks without the [Q, T+Q] mask. Anchors are taken a piece
    at a time; a piece's queries attend, in one SDPA call (one softmax), to the context keys its
    anchors can see ([lo, max anchor): t < a, and t > a + k - W in a sliding layer) and to the
    piece's own blocks (bidirectional; causal with the window in a sliding layer). The Q x Q
    region of the dense mask is never formed (at the flagship 67 M of the 92 M mask entries per
    sequence), nor the context after a piece's last anchor (anchors are sorted: about half of
    [Q, T]); SDPA keeps no scores for backward. Queries are split in one autograd node and keys and
    values gathered per piece by `_PieceRows`, so backward writes each gradient once. Same result
    as SDPA with `block_mask` (and `window_mask`): tests/drafter/test_attention_rule.py checks both
    against the rule."""
    b, h, q_len, d = q.shape
    a = anchors_BA.shape[1]
    block = q_len // a
    piece_anchors = piece_anchors or max(1, PIECE_QUERIES // block)
    starts = list(range(0, a, piece_anchors))
    bounds = torch.stack([torch.stack([anchors_BA[:, i:i + piece_anchors].min(), anchors_BA[:, i:i + piece_anchors].max()])
                          for i in starts]).tolist()  # one device sync for all pieces
    spans = []
    for i, (low_anchor, high) in zip(starts, bounds):
        low = window_start(low_anchor, window)
        spans.append((low, max(high, low), i * block, min(i + piece_anchors, a) * block))
    # Every piece copies its rows: no piece's keys are the whole of k, since its context ends at its
    # highest anchor, which is below context_len.
    piece_keys, piece_values = _PieceRows.apply(k, context_len, spans), _PieceRows.apply(v, context_len, spans)
    piece_queries = q.split(piece_anchors * block, dim=2)
    # The block part of a piece's mask depends only on the piece's size: built once per size.
    block_masks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    pieces = []
    for (low, high, q0, q1), i, queries, keys, values in zip(spans, starts, piece_queries, piece_keys, piece_values):
        n = q1 - q0
        if n not in block_masks:  # (slot of each query, block part of the mask) per piece size
            own, k_slot = torch.arange(n, device=q.device) // block, torch.arange(n, device=q.device) % block
            sees_block = own[:, None] == own[None, :]
            if window is not None:
                sees_block = sees_block & (k_slot[None, :] <= k_slot[:, None]) & (k_slot[None, :] > k_slot[:, None] - window)
            block_masks[n] = (k_slot, sees_block)
        k_slot, sees_block = block_masks[n]
        allowed = torch.empty(b, n, high - low + n, dtype=torch.bool, device=q.device)
        anchor = anchors_BA[:, i:i + n // block].repeat_interleave(block, dim=1)[..., None]          # [b, n, 1]
        t = torch.arange(low, high, device=q.device)
        sees_context = allowed[:, :, :high - low]
        torch.lt(t, anchor, out=sees_context)
        if window is not None:
            sees_context &= t > anchor + k_slot[:, None] - window
        allowed[:, :, high - low:] = sees_block
        pieces.append(F.scaled_dot_product_attention(queries, keys, values, attn_mask=allowed[:, None], enable_gqa=True))
    return torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]


def split_attention(anchors_BA, context_len: int):
    def attend(q, k, v, window):
        return split_block_attention(q, k, v, context_len, anchors_BA, window)
    return attend


def flex_attention(anchors_BA, context_len: int, query_len: int, windows: set, *, compiled: bool,
                   backend: str | object = "inductor"):
    """torch's flex attention with a `BlockMask` from the anchors (one per window kind): tiles
    of queries x keys that the rule masks entirely are skipped, so the cost follows the visible
    keys (about a + B per query), not T + Q. CUDA in training (compiled: the mask's creation and
    the kernel, by `backend`); on the CPU torch runs it eager and forward only (eval, the equality
    tests; tests/training/test_flex_step.py runs its backward through
    harness/flex_cpu_backward.py). The
    rule is `split_block_attention`'s."""
    from torch.nn.attention import flex_attention as fa

    b, a = anchors_BA.shape
    block, kv_len = query_len // a, context_len + query_len

    def rule(window):
        def mask_mod(batch, head, q_idx, kv_idx):
            anchor, slot = anchors_BA[batch, q_idx // block], q_idx % block
            j = kv_idx - context_len
            context_ok = (kv_idx < context_len) & (kv_idx < anchor)
            block_ok = (kv_idx >= context_len) & (j // block == q_idx // block)
            if window is not None:
                context_ok = context_ok & (kv_idx > anchor + slot - window)
                block_ok = block_ok & (j % block <= slot) & (j % block > slot - window)
            return context_ok | block_ok
        return mask_mod

    create = _compiled_flex(backend)[0] if compiled else fa.create_block_mask
    masks = {w: create(rule(w), b, None, query_len, kv_len, device=anchors_BA.device) for w in windows}
    kernel = _compiled_flex(backend)[1] if compiled else fa.flex_attention

    def attend(q, k, v, window):
        if compiled:
            # Heads and head size are the model's, static. Marked before the call: flex attention
            # marks them inside, which is too late for dynamo's duck sizing, which gave the micro-batch
            # size the heads' symbol wherever they were equal and so a graph for each (issue 67).
            for x in (q, k, v):
                torch._dynamo.mark_static(x, 1)
                torch._dynamo.mark_static(x, 3)
        return kernel(q, k, v, block_mask=masks[window], enable_gqa=True)
    return attend


@functools.cache
def _compiled_flex(backend: str | object = "inductor"):
    """(create_block_mask, flex_attention), each compiled for every shape at once (issue 67). Each
    training step packs its own micro-batch: sequences, context length and query count change from
    step to step. Before issue 67 the kernel was compiled for static shapes (`dynamic=False`; the
    mask, by `_compile=True`, with dynamo's default): a graph for every new shape, and once a
    function held 8 (dynamo's recompile limit) it ran uncompiled for every new shape after, flex
    attention unfused, every [Q, T + Q] score materialised. Compiled for dynamic shapes, each holds
    one graph per layer kind (the sliding rule is another mask function) and one more per kind for
    a micro-batch of one sequence or of one 128-key tile (dynamo specialises sizes 0 and 1),
    however many shapes follow: BENCHMARKS.md "Flex attention on the CPU (issue 67)". Padding to
    size buckets would keep static kernels, but compile once a bucket, pad every layer's q, k and v,
    and with three sizes varying still pass the limit."""
    from torch.nn.attention import flex_attention as fa
    return (torch.compile(fa.create_block_mask, dynamic=True, backend=backend),
            torch.compile(fa.flex_attention, dynamic=True, backend=backend))


# How training attends: "flex" (a BlockMask; CUDA), "split" (split_block_attention; anywhere), or
# "auto" (flex on CUDA, split elsewhere). Recorded in run.json as attention_path.
ATTENTION_PATHS = ("auto", "flex", "split")


def attention_path(requested: str, device: torch.device) -> str:
    if requested not in ATTENTION_PATHS:
        raise ValueError(f"attention path must be one of {ATTENTION_PATHS}, got {requested!r}")
    if requested == "auto":
        return "flex" if device.type == "cuda" else "split"
    return requested


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
        self.fc = nn.Linear(c.tap_projection or n * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(c, i) for i in range(c.num_hidden_layers))
        self.attention = "auto"  # how anchors-based attention runs: ATTENTION_PATHS
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        # Frozen and shared with the target: kept out of this module's parameters and state.
        head = lm_head if draft_vocab is None else DraftHead(lm_head, draft_vocab)
        self._frozen = {"embed": embed.requires_grad_(False), "lm_head": head.requires_grad_(False)}
        # A projected cache's component scales s (`use_basis`): fc' reads z * s where
        # config.tap_projection_energy. Not a parameter and not saved: the cache's basis holds them.
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
        if self.config.tap_projection_energy:
            # The whole-tap fc's init W ~ N(0, 1/(n*H)) restricted to the basis, W P^T, is N(0, 1/(n*H))
            # too (P's rows are orthonormal): the same draws, rescaled, so every other init is unchanged.
            width = len(self.config.target_layer_ids) * self.config.hidden_size
            with torch.no_grad():
                self.fc.weight.mul_(math.sqrt(self.fc.in_features / width))

    def use_basis(self, basis) -> None:
        """Give a projected drafter its cache's basis (pipeline/projection/basis.py): fc' then reads
        z * s where config.tap_projection_energy (a no-op otherwise)."""
        if self.config.tap_projection != basis.rank:
            raise ValueError(f"the basis has {basis.rank} components, this drafter's fc reads {self.config.tap_projection}")
        if self.config.tap_projection_energy:
            self.tap_scales = basis.scales.detach().to(self.fc.weight.device, torch.float32).clone()

    def context_features(self, hidden_BTNH: torch.Tensor) -> torch.Tensor:
        """fc + hidden_norm of the concatenated taps, [B, T, H] (of the projected taps [B, T, 1, R]
        where `config.tap_projection` is R)."""
        b, t = hidden_BTNH.shape[:2]
        x = hidden_BTNH.reshape(b, t, -1)
        if self.config.tap_projection_energy:
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
