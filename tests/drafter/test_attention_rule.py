"""The drafter's attention rule (DESIGN 2) for full and sliding-window layers, every path against
an oracle written from the rule, one query at a time:

- full layer: the query of the block at anchor a sees context t < a and its own block's B slots;
- sliding layer (what the serving engines run): the query at p = a + k sees context t with
  p - W < t < a and its own block's slots j with k - W < j <= k.

Paths checked: `split_block_attention` (training on CPU; outputs and gradients, in pieces),
the dense mask + `window_mask` (eval's single block, and the packed reference), flex attention
(forward only: torch runs flex on the CPU without backward; its backward, in a whole training step
against split, is tests/training/test_flex_step.py's), and the whole drafter's dense vs split
forward with mixed layer kinds."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pipeline.drafter.attention_rule import block_mask, dense_attention, flex_attention, split_block_attention
from pipeline.drafter.model import DFlashDrafter, DrafterConfig

B = 4
WINDOWS = [None, 3, 6, 11, 40]


def visible_keys(anchor: int, slot: int, query_block: int, context_len: int, window: int | None) -> list[int]:
    """Key indices ([context ; blocks] layout) the query at slot `slot` of block `query_block` sees."""
    p = anchor + slot
    keys = [t for t in range(context_len) if t < anchor and (window is None or t > p - window)]
    keys += [context_len + query_block * B + j for j in range(B) if window is None or (slot - window < j <= slot)]
    return keys


def oracle(q, k, v, anchors, context_len, window):
    """softmax(q.k / sqrt(d)) over each query's visible keys, query by query; GQA by head groups."""
    s, h, n, d = q.shape
    group = h // k.shape[1]
    rows = []
    for b in range(s):
        heads = []
        for head in range(h):
            out = []
            for i in range(n):
                keys = visible_keys(int(anchors[b, i // B]), i % B, i // B, context_len, window)
                kk, vv = k[b, head // group, keys], v[b, head // group, keys]
                out.append(torch.softmax(kk @ q[b, head, i] / math.sqrt(d), dim=0) @ vv)
            heads.append(torch.stack(out))
        rows.append(torch.stack(heads))
    return torch.stack(rows)


def inputs(seed=0, s=2, h=4, kv=2, t=20, d=8):
    torch.manual_seed(seed)
    anchors = torch.tensor([[1, 4, 9, 15, 19], [2, 3, 7, 0, 0]])  # the second sequence has 2 padding blocks
    a = anchors.shape[1]
    q = torch.randn(s, h, a * B, d, requires_grad=True)
    k = torch.randn(s, kv, t + a * B, d, requires_grad=True)
    v = torch.randn(s, kv, t + a * B, d, requires_grad=True)
    return q, k, v, anchors, t


def test_the_oracle_reads_the_rule():
    """The oracle's key sets on hand-checked cases, so the other tests compare against the rule."""
    assert visible_keys(6, 0, 1, 10, None) == [0, 1, 2, 3, 4, 5, 14, 15, 16, 17]
    # sliding W=3, anchor 6, slot 2: p = 8 sees positions 6..8 -> no context (t < 6 and t > 5 is empty), slots 0..2
    assert visible_keys(6, 2, 1, 10, 3) == [14, 15, 16]
    # slot 0 of the same block: context 4, 5 and itself
    assert visible_keys(6, 0, 1, 10, 3) == [4, 5, 14]
    # a window wider than everything: the context before the anchor, then causal in the block
    assert visible_keys(6, 1, 0, 10, 100) == [0, 1, 2, 3, 4, 5, 10, 11]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("piece_anchors", [1, 2, None])
def test_split_attention_follows_the_rule(window, piece_anchors):
    """Outputs and q/k/v gradients of split_block_attention (anchors in pieces) equal the oracle's."""
    q, k, v, anchors, t = inputs()
    want = oracle(q, k, v, anchors, t, window)
    got = split_block_attention(q, k, v, t, anchors, window, piece_anchors=piece_anchors)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    upstream = torch.randn_like(want)
    expected = torch.autograd.grad(want, (q, k, v), upstream)
    for g, e in zip(torch.autograd.grad(got, (q, k, v), upstream), expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", WINDOWS)
def test_dense_mask_with_the_window_follows_the_rule(window):
    """The packed dense mask (block_mask) narrowed by positions (window_mask), as the reference
    path and eval run it."""
    q, k, v, anchors, t = inputs(seed=1)
    slot = torch.arange(q.shape[2]) % B
    block_pos = anchors.repeat_interleave(B, dim=1) + slot
    context_pos = torch.arange(t).expand(q.shape[0], t)
    attend = dense_attention(block_mask(anchors, t, B), block_pos, context_pos)
    with torch.no_grad():
        got = attend(q, k, v, window)
        want = oracle(q, k, v, anchors, t, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", WINDOWS)
def test_flex_attention_follows_the_rule(window):
    """Flex attention with the anchors' BlockMask (forward: torch has no flex backward on the CPU)."""
    q, k, v, anchors, t = inputs(seed=2)
    q, k, v = q.detach(), k.detach(), v.detach()
    with torch.no_grad():
        want = oracle(q, k, v, anchors, t, window)
        got = flex_attention(anchors, t, q.shape[2], {window}, compiled=False)(q, k, v, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_block_longer_than_a_piece_is_split_one_anchor_a_piece():
    """A block of more than PIECE_QUERIES queries still splits (one anchor a piece, never zero)
    and equals the packed dense mask."""
    from pipeline.drafter.attention_rule import PIECE_QUERIES
    block, t = PIECE_QUERIES + 2, 12
    torch.manual_seed(3)
    anchors = torch.tensor([[3, 9]])
    q = torch.randn(1, 2, 2 * block, 4)
    k, v = torch.randn(2, 1, 1, t + 2 * block, 4)
    block_pos = anchors.repeat_interleave(block, dim=1) + torch.arange(2 * block) % block
    want = dense_attention(block_mask(anchors, t, block), block_pos, torch.arange(t)[None])(q, k, v, None)
    torch.testing.assert_close(split_block_attention(q, k, v, t, anchors), want, rtol=1e-5, atol=1e-6)


def drafter(layer_types, window):
    torch.manual_seed(0)
    h, v = 32, 60
    config = DrafterConfig(hidden_size=h, intermediate_size=64, num_hidden_layers=len(layer_types), num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, vocab_size=v, target_layer_ids=[1, 3], num_target_layers=6,
                           mask_token_id=v - 1, block_size=B, layer_types=layer_types, sliding_window=window)
    return DFlashDrafter(config, embed=torch.nn.Embedding(v, h), lm_head=torch.nn.Linear(h, v, bias=False)).eval()


@pytest.mark.parametrize("window", [2, 5, 9])
def test_drafter_paths_agree_with_mixed_layer_kinds(window):
    """Sliding then full layers: the dense-mask forward, the split forward and flex (forward) agree
    on every real block; a sliding layer changes the result (the window is applied at all)."""
    model = drafter(["sliding_attention", "sliding_attention", "full_attention"], window)
    torch.manual_seed(3)
    anchors = torch.tensor([[3, 8, 14]])
    t = 18
    hidden = torch.randn(1, t, 2, 32)
    ids = torch.randint(0, 59, (1, 3 * B))
    pos = anchors.repeat_interleave(B, dim=1) + torch.arange(3 * B) % B
    with torch.no_grad():
        dense = model(hidden, ids, pos, block_mask(anchors, t, B), logits=False)
        split = model(hidden, ids, pos, anchors_BA=anchors, logits=False)
        model.attention = "flex"
        flex = model(hidden, ids, pos, anchors_BA=anchors, logits=False)
        full = drafter(["full_attention"] * 3, None)
        full.load_state_dict(model.state_dict())
        unwindowed = full(hidden, ids, pos, anchors_BA=anchors, logits=False)
    torch.testing.assert_close(split, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
    assert (split - unwindowed).abs().max() > 1e-3


def test_layer_kinds_are_validated():
    base = dict(hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                head_dim=4, vocab_size=10, target_layer_ids=[1], num_target_layers=4, mask_token_id=9)
    assert DrafterConfig(**base).layer_types == ["full_attention", "full_attention"]
    with pytest.raises(ValueError, match="sliding_window"):
        DrafterConfig(**base, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="2 layers"):
        DrafterConfig(**base, layer_types=["full_attention"])
    with pytest.raises(ValueError, match="unknown kind 'local'"):
        DrafterConfig(**base, layer_types=["local", "full_attention"], sliding_window=4)


def test_sdpa_without_a_mask_is_not_the_sliding_rule():
    """Why the window is applied explicitly: the bare SDPA call (what a class with no mask runs)
    ignores it, and the result differs once the window binds."""
    q, k, v, anchors, t = inputs(seed=4)
    with torch.no_grad():
        want = oracle(q[:1, :, :B], k[:1, :, :t + B], v[:1, :, :t + B], torch.tensor([[t]]), t, 3)
        bare = F.scaled_dot_product_attention(q[:1, :, :B], k[:1, :, :t + B], v[:1, :, :t + B], enable_gqa=True)
    assert (bare - want).abs().max() > 1e-3
