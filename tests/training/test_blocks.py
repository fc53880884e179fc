"""Training's blocks (anchors, block inputs and mask, labels and weights), its decayed CE and its
metrics, on hand-made tensors (DESIGN 3.3, 3.4, 4)."""

import math

import pytest
import torch

from pipeline.training.blocks import (block_inputs, block_targets, decay_weights, default_gamma, sample_anchors,
                                      valid_anchors)
from pipeline.training.metrics import block_metrics
from pipeline.training.objectives import weighted_ce

V, B = 50, 4


def test_anchors_need_two_supervised_positions_and_are_sorted():
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0, 1])
    assert valid_anchors(mask).tolist() == [1, 2, 5]
    g = torch.Generator().manual_seed(0)
    picked = sample_anchors(mask, 2, g)
    assert len(picked) == 2 and picked.tolist() == sorted(picked.tolist()) and set(picked.tolist()) <= {1, 2, 5}
    assert sample_anchors(mask, 10, g).tolist() == [1, 2, 5]


def test_block_inputs_and_mask():
    ids = torch.arange(10, 20)
    anchors = torch.tensor([2, 6])
    block_ids, pos, allowed = block_inputs(ids, anchors, B, mask_token_id=99)
    assert block_ids.tolist() == [12, 99, 99, 99, 16, 99, 99, 99]
    assert pos.tolist() == [2, 3, 4, 5, 6, 7, 8, 9]
    ctx, blk = allowed[:, :10], allowed[:, 10:]
    assert ctx[0].tolist() == [True, True] + [False] * 8        # strictly before anchor 2
    assert ctx[4].tolist() == [True] * 6 + [False] * 4          # strictly before anchor 6
    assert blk[0].tolist() == [True] * 4 + [False] * 4          # own block only, bidirectional
    assert blk[5].tolist() == [False] * 4 + [True] * 4


def test_targets_and_weights():
    argmax = torch.arange(100, 110)
    mask = torch.tensor([0, 1, 1, 1, 1, 0, 1, 1, 1, 1])
    labels, weights = block_targets(argmax, mask, torch.tensor([1, 8]), B, gamma=2.0)
    # anchor 1: slot k predicts position 1+k with label argmax[k]
    assert labels[0].tolist() == [0, 101, 102, 103]
    assert weights[0].tolist() == pytest.approx([0, 1, math.exp(-0.5), math.exp(-1.0)])
    # anchor 8: slot 1 -> position 9 (supervised), slots 2-3 run past the end
    assert labels[1].tolist() == [0, 108, 0, 0] and weights[1].tolist() == pytest.approx([0, 1, 0, 0])
    # a masked target position is weighted 0
    _, w = block_targets(argmax, mask, torch.tensor([3]), B, gamma=2.0)
    assert w[0].tolist() == pytest.approx([0, 1, 0, math.exp(-1.0)])
    assert decay_weights(16, 7)[1] == 1.0 and default_gamma(16) == 7 and default_gamma(8) == 4


def test_weighted_ce_matches_the_formula():
    logits = torch.randn(2, B, V)
    labels = torch.randint(0, V, (2, B))
    weights = torch.tensor([[0, 1.0, 0.5, 0.25], [0, 1.0, 0, 0]])
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none").view(2, B)
    assert weighted_ce(logits, labels, weights).item() == pytest.approx(float((ce * weights).sum() / weights.sum()), rel=1e-6)


def test_metrics_on_known_logits():
    labels = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])
    weights = torch.tensor([[0, 1.0, 1.0, 1.0], [0, 1.0, 1.0, 0.0]])
    logits = torch.zeros(2, B, V)
    logits[0, 1, 1] = logits[0, 2, 2] = 10      # block 0: slots 1, 2 right, slot 3 wrong...
    logits[0, 3, 7] = 10
    logits[0, 3, 3] = 5                          # ...but its label is second best (inside top-4)
    logits[1, 1, 9] = 10                         # block 1: slot 1 wrong
    logits[1, 2, 2] = 10
    m = block_metrics(logits, labels, weights)
    assert m["accuracy"] == pytest.approx(3 / 5)
    assert m["avg_streak"] == pytest.approx((2 + 0) / 2)
    assert m["pos_acc"] == pytest.approx([0.5, 1.0, 0.0])
    assert m["top4_acc"] >= 4 / 5 and m["ddtree_streak4"] >= (3 + 0) / 2
