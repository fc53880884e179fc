"""Liger Kernel's fused linear cross-entropy (Triton, under the interpreter, fp32) against the
trainer's own chunked loss (pipeline/training/loss.py) where the trainer could use it: the hard
label's cross-entropy over the supervised slots, each slot weighted (the block-position decay),
the frozen lm_head, the gradient w.r.t. the drafter's final hidden states. Liger has no per-row
weights: its reduction="none" gives each row's loss, weighted here as the trainer weighs them
(its backward then recomputes the logits with the upstream per-row gradient).

What liger cannot replace (so the trainer keeps its own loss; BENCHMARKS: Kernels under Triton's
interpreter): the distribution terms over the stored top-k (kl), D-PACE weights from the
drafter's own cross-entropy, and the top-1/4/8 hits read off the same logits."""

import torch

from pipeline.training.loss import supervised_loss


def _batch(vocab=512, hidden=128, anchors=6, block=8, seed=0):
    """The embedded target's widths; slot 0 of each block and a tail unsupervised, as prepare() makes them."""
    g = torch.Generator().manual_seed(seed)
    final = torch.randn(anchors, block, hidden, generator=g)
    weight = torch.randn(vocab, hidden, generator=g) * 0.05
    labels = torch.randint(0, vocab, (anchors, block), generator=g)
    decay = torch.exp(-(torch.arange(block) - 1).clamp_min(0) / 7.0)
    weights = decay.expand(anchors, block).clone()
    weights[:, 0] = 0
    weights[-1, 5:] = 0
    return final, weight, labels, weights


def test_liger_fused_linear_cross_entropy_equals_the_trainers_loss():
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    final, weight, labels, weights = _batch()
    ours_h = final.clone().requires_grad_(True)
    ours, _ = supervised_loss(ours_h, weight, labels, weights)
    ours.backward()

    theirs_h = final.clone().requires_grad_(True)
    rows = weights.reshape(-1) > 0
    per_row = LigerFusedLinearCrossEntropyLoss(reduction="none")(
        weight, theirs_h.reshape(-1, final.shape[-1])[rows], labels.reshape(-1)[rows])
    theirs = (per_row * weights.reshape(-1)[rows]).sum()
    theirs.backward()

    # and both against the plain computation: full logits, cross-entropy per slot, weighted
    plain_h = final.clone().requires_grad_(True)
    plain = (torch.nn.functional.cross_entropy((plain_h @ weight.t()).reshape(-1, weight.shape[0]), labels.reshape(-1),
                                               reduction="none") * weights.reshape(-1)).sum()
    plain.backward()

    for loss, h in ((ours, ours_h), (theirs, theirs_h)):
        torch.testing.assert_close(loss, plain, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h.grad, plain_h.grad, rtol=1e-5, atol=1e-6)
    assert float(ours_h.grad[:, 0].abs().max()) == 0.0    # unsupervised slots get no gradient
    torch.testing.assert_close(theirs_h.grad, ours_h.grad, rtol=1e-5, atol=1e-6)
