"""The drafter's KV cache (pipeline/drafter/incremental.py) against the plain model forward over the
whole context: the same logits at every step, with full-attention layers, sliding-window layers
(windows shorter than the block, shorter than the context, longer than it) and a mix of both."""

import pytest
import torch

from pipeline.drafter.incremental import DraftContext
from pipeline.drafter.model import FULL, SLIDING, DFlashDrafter, DrafterConfig

H, V, B, TAPS = 32, 50, 4, 3     # 6 heads: not the block size, so a key layout that mixed the two shows

# (layer kinds, sliding window)
LAYOUTS = [
    ([FULL, FULL], None),
    ([SLIDING, SLIDING], 3),    # narrower than the block
    ([SLIDING, SLIDING], 6),
    ([SLIDING, FULL], 5),       # each layer keeps its own bound
    ([FULL, SLIDING], 200),     # wider than every context here
]

# Committed positions per step: uneven, and past the cache's first 64 rows and a doubling.
CHUNKS = [5, 1, 30, 40, 3, 70]


def drafter_with(layer_types, window, seed=0):
    torch.manual_seed(seed)
    config = DrafterConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=len(layer_types),
                           num_attention_heads=6, num_key_value_heads=2, head_dim=8, vocab_size=V,
                           target_layer_ids=[1, 3, 5], num_target_layers=8, mask_token_id=V - 1, block_size=B,
                           layer_types=layer_types, sliding_window=window)
    return DFlashDrafter(config, embed=torch.nn.Embedding(V, H), lm_head=torch.nn.Linear(H, V, bias=False)).eval()


def forward_logits(drafter, context_TNH, anchor, anchor_pos):
    """The reference: the model's forward over the whole context, one block after it that sees
    all of it (the dense mask; sliding layers narrow it by position themselves)."""
    ids = torch.full((1, B), drafter.config.mask_token_id, dtype=torch.long)
    ids[0, 0] = anchor
    pos = torch.arange(anchor_pos, anchor_pos + B)[None]
    allowed = torch.ones(1, B, context_TNH.shape[0] + B, dtype=torch.bool)
    with torch.no_grad():
        return drafter(context_TNH[None], ids, pos, allowed)[0, 1:]


@pytest.mark.parametrize("layer_types,window", LAYOUTS)
def test_cached_logits_equal_the_forward_over_the_whole_context(layer_types, window):
    drafter = drafter_with(layer_types, window)
    cache = DraftContext(drafter)
    g = torch.Generator().manual_seed(1)
    context = torch.empty(0, TAPS, H)
    for chunk in CHUNKS:
        new = torch.randn(chunk, TAPS, H, generator=g)
        cache.extend(new)
        context = torch.cat([context, new])
        anchor = int(torch.randint(0, V - 1, (1,), generator=g))
        got = cache.logits(anchor, context.shape[0])
        assert got.shape == (B - 1, V)
        torch.testing.assert_close(got, forward_logits(drafter, context, anchor, context.shape[0]), atol=1e-5, rtol=1e-5)
    assert cache.length == sum(CHUNKS)


def test_the_window_changes_the_logits_once_the_context_is_longer():
    """Guards the test above: a sliding layer's cache really drops the positions before its window."""
    full, sliding = drafter_with([FULL, FULL], None), drafter_with([SLIDING, SLIDING], 6)
    context = torch.randn(20, TAPS, H, generator=torch.Generator().manual_seed(2))
    logits = []
    for drafter in (full, sliding):
        cache = DraftContext(drafter)
        cache.extend(context)
        logits.append(cache.logits(7, 20))
    assert not torch.allclose(*logits)


def test_an_anchor_must_follow_the_committed_context():
    cache = DraftContext(drafter_with([FULL, FULL], None))
    cache.extend(torch.randn(6, TAPS, H))
    with pytest.raises(ValueError, match="must follow the committed context of 6 positions"):
        cache.logits(3, 5)
