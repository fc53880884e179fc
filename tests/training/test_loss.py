"""The training loss without full logits (pipeline/training/loss.py) against the full-logits
reference (the drafter's plain forward to [A, B, V] logits, then `weighted_ce` / `weighted_soft_kl`,
which test_drafter checks against the formula): same loss, same gradients, same metrics, and no
tensor of the full [supervised slots, V] size kept for backward."""

from __future__ import annotations

import pytest
import torch

from harness.loss_batches import B, H, V, batch, drafter
from harness.ranked_logits import EXPECTED as RANKED_EXPECTED
from harness.ranked_logits import ranked_case
from pipeline.training.batch import final_hidden, forward_logits, loss_sum
from pipeline.training.loss import supervised_loss
from pipeline.training.metrics import finish_metrics, hit_sums, metric_sums

def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["ce", "kl"])
@pytest.mark.parametrize("chunk_rows, lengths", [(1, (57, 90, 33)), (7, (57, 90, 8)), (None, (57, 90, 8))])
def test_same_loss_gradients_and_metrics_as_full_logits(kind, chunk_rows, lengths):
    """Training's path (split attention, chunked loss) against the reference (dense mask, full logits)."""
    packed = batch(kind == "kl", lengths)
    reference = drafter()
    logits = forward_logits(reference, packed)
    want = loss_sum(logits, packed, kind)
    want.backward()
    want_sums = metric_sums(logits.detach(), packed.labels, packed.weights, packed.real_blocks)

    model = drafter()
    got, hits = supervised_loss(final_hidden(model, packed), model.lm_head_weight, packed.labels, packed.weights,
                                soft_ids=packed.soft_ids if kind == "kl" else None,
                                soft_probs=packed.soft_probs if kind == "kl" else None,
                                chunk_rows=chunk_rows, with_hits=True)
    got.backward()
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    a, b = grads(reference), grads(model)
    for name in a:
        scale = a[name].abs().max()
        assert scale > 0, name  # every parameter gets a gradient: the comparison is not vacuous
        assert float((a[name] - b[name]).abs().max() / scale) < 1e-5, name
    got_sums = hit_sums(hits, packed.weights, packed.real_blocks)
    for name, value in want_sums.items():
        assert torch.equal(value, got_sums[name]), name
    assert float(want_sums["top1"]) < float(want_sums["supervised"])  # not all trivially right


@pytest.mark.parametrize("path", ["ce", "kl", "tv", "ce-dpace"])
@pytest.mark.parametrize("chunk_rows", [1, 4, None])
def test_the_chunked_hits_give_the_hand_worked_metrics(path, chunk_rows):
    """The comparison above checks the chunked hits against `metric_sums`, which shares `hit_sums`
    with them: here both halves meet values worked out by hand (harness/ranked_logits.py). The
    logits reach the loss as hidden states through an identity lm_head, on both of the loss's
    paths (the first recipe, ce and kl; the general one, with the tv term and with D-PACE
    weights), whole or in chunks."""
    logits, labels, weights = ranked_case()
    a, b, v = logits.shape
    soft = {}
    if path in ("kl", "tv"):   # soft targets: the label first (as a consistent cache has it), two others
        others = (labels[..., None] + torch.tensor([1, 2])) % v
        soft = {"soft_ids": torch.cat([labels[..., None], others], -1),
                "soft_probs": torch.tensor([0.6, 0.3, 0.1]).expand(a, b, 3)}
    options = {"tv": {"terms": {"tv": 1.0}}, "ce-dpace": {"dpace_alpha": 0.5}}.get(path, {})
    mask = (weights > 0).float() if path == "ce-dpace" else weights   # D-PACE takes 0/1 weights
    _, hits = supervised_loss(logits.clone(), torch.eye(v), labels, mask, chunk_rows=chunk_rows, with_hits=True,
                              **soft, **options)
    got = finish_metrics(hit_sums(hits, mask))
    for name, want in RANKED_EXPECTED.items():
        assert got[name] == pytest.approx(want), (name, got[name])


def test_no_vocabulary_sized_tensor_is_kept_for_backward():
    """Only the (frozen, shared) lm_head weight has a vocabulary axis among the tensors autograd
    keeps; the reference keeps the logits of every slot."""
    packed = batch(False)
    saved = []

    def keep(t):
        saved.append(tuple(t.shape))
        return t

    model = drafter()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss_sum(forward_logits(model, packed), packed, "ce")
    assert any(shape[-1:] == (V,) and shape != (V, H) for shape in saved)  # the check can fail
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        supervised_loss(final_hidden(model, packed), model.lm_head_weight, packed.labels, packed.weights, chunk_rows=16)
    assert saved and [s for s in saved if V in s and s != (V, H)] == []


def test_split_block_attention_equals_the_dense_mask_including_padding_blocks():
    """Every query's output (padding blocks too) from the anchors alone equals SDPA with the dense
    [Q, T+Q] mask, in fp32."""
    from pipeline.drafter.attention_rule import block_mask

    packed = batch(False, lengths=(57, 90, 8))
    assert bool((~packed.real_blocks).any())  # the pack has padding blocks (anchor 0)
    model = drafter().eval()
    with torch.no_grad():
        allowed = block_mask(packed.anchors, packed.hidden.shape[1], B)
        dense = model(packed.hidden, packed.block_ids, packed.block_pos, allowed, logits=False)
        split = model(packed.hidden, packed.block_ids, packed.block_pos, anchors_BA=packed.anchors, logits=False)
    torch.testing.assert_close(split, dense, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="exactly one"):
        model(packed.hidden, packed.block_ids, packed.block_pos, allowed, anchors_BA=packed.anchors)


@pytest.mark.parametrize("piece_anchors", [1, 2, 4, 100])
def test_split_attention_in_pieces_equals_sdpa_with_the_mask(piece_anchors):
    """Anchors in pieces of 1, 2, 4 or all: outputs and input gradients equal SDPA's with
    the dense mask, padding blocks included."""
    import torch.nn.functional as F

    from pipeline.drafter.attention_rule import block_mask, split_block_attention

    torch.manual_seed(0)
    s, h, t, d, a = 2, 3, 20, 8, 5
    anchors = torch.tensor([[1, 4, 9, 15, 19], [2, 3, 7, 0, 0]])  # the second sequence has 2 padding blocks
    q = torch.randn(s, h, a * B, d, requires_grad=True)
    k = torch.randn(s, h, t + a * B, d, requires_grad=True)
    v = torch.randn(s, h, t + a * B, d, requires_grad=True)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=block_mask(anchors, t, B)[:, None])
    got = split_block_attention(q, k, v, t, anchors, piece_anchors=piece_anchors)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    upstream = torch.randn_like(want)
    expected = torch.autograd.grad(want, (q, k, v), upstream)
    for g, e in zip(torch.autograd.grad(got, (q, k, v), upstream), expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
