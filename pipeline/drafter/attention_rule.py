"""The drafter's attention rule as masks, and the ways to compute it (the rule itself, for full and
sliding layers: pipeline/drafter/model.py's docstring).

Masks: `block_mask` (every anchor's block at once), `window_mask` (a sliding layer's window by
position) and `window_start` (the first context position a sliding layer can still see). Ways to
attend, each a function `attend(q, k, v, window)` that a layer calls with its queries, its keys and
values ([context ; block]) and its window: `dense_attention` (an explicit mask: eval's one block,
and the reference), `suffix_attention` (one block after the suffix of the context the decoding
cache hands over: pipeline/drafter/incremental.py), and for training, where all anchors' blocks
go through one forward, `split_attention` (`split_block_attention`: anchors a piece at a time,
anywhere) or `flex_attention` (a BlockMask; CUDA), chosen by `attention_path`. All give what SDPA
gives under `block_mask` (and `window_mask`): tests/drafter/test_attention_rule.py.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


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
