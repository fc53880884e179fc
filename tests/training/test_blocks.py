"""Training's blocks (anchors, block inputs and mask, labels, soft targets and weights), its decayed
CE and its metrics, on hand-made tensors against values worked out by hand (DESIGN 3.2-3.4, 4)."""

import math

import numpy as np
import pytest
import torch
from harness.ranked_logits import EXPECTED as RANKED_EXPECTED
from harness.ranked_logits import ranked_case

from pipeline.cache.schema import (HIDDEN, INPUT_IDS, TARGET_ARGMAX, TARGET_LOGSUMEXP, TARGET_TOPK_IDS,
                                   TARGET_TOPK_LOGITS)
from pipeline.cache.schema import LOSS_MASK as LOSS_MASK_FIELD
from pipeline.training.batch import prepare
from pipeline.training.blocks import (block_inputs, block_soft_targets, block_targets, decay_weights, default_gamma,
                                      sample_anchors, valid_anchors)
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
    assert decay_weights(16, 7)[1] == 1.0


def test_an_anchor_at_position_0_predicts_position_1_from_the_first_argmax():
    argmax = torch.arange(100, 106)
    labels, weights = block_targets(argmax, torch.ones(6, dtype=torch.long), torch.tensor([0]), B, gamma=2.0)
    assert labels[0].tolist() == [0, 100, 101, 102]
    assert weights[0].tolist() == pytest.approx([0, 1, math.exp(-0.5), math.exp(-1.0)])


def test_soft_targets_of_an_anchor_at_position_0():
    # position p stores the target's top-2 for p+1; slot k of anchor 0 takes position k-1's
    ids = torch.tensor([[5, 6], [7, 8], [9, 10], [11, 12]])
    logits = torch.tensor([[2.0, 0.0], [1.0, 1.0], [0.0, 3.0], [4.0, 4.0]])
    soft_ids, soft_probs = block_soft_targets(ids, logits, torch.full((4,), 5.0), torch.tensor([0]), 3)
    assert soft_ids[0, 1:].tolist() == [[5, 6], [7, 8]]
    e = math.exp(2.0)
    assert soft_probs[0, 1:].tolist() == [pytest.approx([e / (e + 1), 1 / (e + 1)]), pytest.approx([0.5, 0.5])]


def test_decay_weights_by_hand():
    assert decay_weights(3, 7.0).tolist() == pytest.approx([0, 1, math.exp(-1 / 7)])


@pytest.mark.parametrize("block_size,gamma", [(16, 7), (10, 5), (8, 4), (12, 5), (14, 7), (6, 4), (32, 7),
                                              (9, 5), (13, 7)])
def test_default_gamma_is_the_nearest_tabled_and_a_tie_takes_the_larger_block(block_size, gamma):
    # DESIGN 3.4's table; 9 and 13 lie halfway between two rows: the larger block size's gamma
    assert default_gamma(block_size) == gamma


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


def test_metrics_equal_the_hand_worked_values():
    """Every metric of DESIGN 4 on logits whose label ranks were placed by hand
    (harness/ranked_logits.py): ranks 5 and 7 are inside the top-8 and outside the top-4, rank 8
    outside both, and a streak stops at a miss and at an unsupervised slot."""
    logits, labels, weights = ranked_case()
    m = block_metrics(logits, labels, weights)
    for name, want in RANKED_EXPECTED.items():
        assert m[name] == pytest.approx(want), name


# A hand-written cache of 8 positions (DESIGN 3.2): at each position t the target's top-3 ids and
# how much probability each carries, out of a full-vocabulary mass of 20 (so the top-3 never cover
# everything, and renormalised over the top-3 they give the fractions below). The stored argmax
# is each position's top-1. Ids repeat across positions (40, 12, 14, 15) as a real cache's do.
TOPK_IDS = [[11, 21, 31], [12, 40, 22], [40, 13, 23], [14, 12, 40],
            [15, 14, 25], [16, 26, 15], [17, 27, 37], [18, 28, 38]]
MASS = [[6, 3, 1], [5, 4, 1], [7, 2, 1], [8, 1, 1], [4, 3, 2], [9, 2, 1], [3, 2, 1], [5, 3, 2]]
ARGMAX = [11, 12, 40, 14, 15, 16, 17, 18]
LOSS_MASK = [0, 1, 1, 1, 1, 0, 1, 1]
GAMMA = 2.0

# Worked by hand from DESIGN 3.3: slot k of the block anchored at a predicts position a+k; its hard
# label is the argmax stored at a+k-1 and its soft target the top-k stored there (the target's
# prediction from the prefix 0..a+k-1). Per anchor, per supervised slot k: (label, ids, probs).
# Slots out of the loss (loss_mask[a+k] == 0, or a+k past the end) are left out: label 0, weight 0.
HAND = {
    1: {1: (12, [12, 40, 22], [5 / 10, 4 / 10, 1 / 10]),     # predicts 2 from position 1
        2: (40, [40, 13, 23], [7 / 10, 2 / 10, 1 / 10]),     # predicts 3 from position 2
        3: (14, [14, 12, 40], [8 / 10, 1 / 10, 1 / 10])},    # predicts 4 from position 3
    2: {1: (40, [40, 13, 23], [7 / 10, 2 / 10, 1 / 10]),     # predicts 3 from position 2
        2: (14, [14, 12, 40], [8 / 10, 1 / 10, 1 / 10])},    # predicts 4; slot 3 predicts 5 (mask 0)
    3: {1: (14, [14, 12, 40], [8 / 10, 1 / 10, 1 / 10]),     # predicts 4 from position 3; slot 2: 5 (mask 0)
        3: (16, [16, 26, 15], [9 / 12, 2 / 12, 1 / 12])},    # predicts 6 from position 5
    6: {1: (17, [17, 27, 37], [3 / 6, 2 / 6, 1 / 6])},       # predicts 7 from position 6; slots 2, 3 past the end
}
DECAY = [0.0, 1.0, math.exp(-1 / GAMMA), math.exp(-2 / GAMMA)]   # w_k = exp(-(k-1)/gamma), slot 0 never


def stored_topk():
    """(ids [T, 3], logits [T, 3], logsumexp [T]) as extract stores them: logits are log-masses
    plus a per-position offset (the model's logits are not normalised), the logsumexp that of the
    full vocabulary (total mass 20, same offset)."""
    offset = torch.arange(len(MASS), dtype=torch.float32)[:, None] * 0.7 - 3.0
    logits = torch.tensor(MASS, dtype=torch.float32).log() + offset
    return torch.tensor(TOPK_IDS), logits, math.log(20.0) + offset[:, 0]


def check_against_hand(anchors, labels, weights, soft_ids, soft_probs):
    assert list(anchors) == list(HAND)
    for i, a in enumerate(anchors):
        for k in range(B):
            if k not in HAND[a]:
                assert weights[i, k] == 0 and labels[i, k] == 0, (a, k)
                continue
            label, ids, probs = HAND[a][k]
            assert weights[i, k] == pytest.approx(DECAY[k]), (a, k)
            assert labels[i, k] == label, (a, k)
            assert soft_ids[i, k].tolist() == ids, (a, k)
            assert soft_probs[i, k].tolist() == pytest.approx(probs, abs=1e-6), (a, k)
            assert soft_ids[i, k, 0] == labels[i, k]   # on a supervised slot the soft top-1 is the hard label


def test_hard_labels_and_soft_targets_against_a_hand_worked_alignment():
    """`block_targets` and `block_soft_targets` on the hand-written cache, anchors 1, 2, 3, 6 and
    B = 4: each supervised slot's label, weight, top-k ids and renormalised probabilities are the
    ones worked out by hand (DESIGN 3.2-3.4). A soft target read one position late or early, or a
    label off by one, lands on another position's ids or masses."""
    anchors = torch.tensor(list(HAND))
    labels, weights = block_targets(torch.tensor(ARGMAX), torch.tensor(LOSS_MASK), anchors, B, gamma=GAMMA)
    soft_ids, soft_probs = block_soft_targets(*stored_topk(), anchors, B)
    assert soft_ids.shape == soft_probs.shape == (len(HAND), B, 3)
    check_against_hand(anchors.tolist(), labels, weights, soft_ids, soft_probs)


def test_a_prepared_sample_carries_the_hand_worked_targets():
    """The same cache row as a decoded sample through `prepare` (what training's stream feeds):
    the anchors are every valid one (1, 2, 3, 6: loss_mask[a] and loss_mask[a+1] both 1, DESIGN
    3.3), and its labels, weights and soft targets are the hand-worked ones."""
    ids, logits, lse = stored_topk()
    sample = {INPUT_IDS: np.arange(100, 108), LOSS_MASK_FIELD: np.array(LOSS_MASK, dtype=np.uint8),
              TARGET_ARGMAX: np.array(ARGMAX), HIDDEN: np.zeros((8, 2, 4), dtype=np.float32),
              TARGET_TOPK_IDS: ids.numpy(), TARGET_TOPK_LOGITS: logits.numpy(),
              TARGET_LOGSUMEXP: lse.numpy()}
    blocks = prepare(sample, block_size=B, num_anchors=16, max_length=64, mask_token_id=99, gamma=GAMMA,
                     generator=torch.Generator().manual_seed(0), soft=True)
    check_against_hand(blocks.anchors.tolist(), blocks.labels, blocks.weights, blocks.soft_ids, blocks.soft_probs)
    assert blocks.block_ids.view(-1, B)[:, 0].tolist() == [101, 102, 103, 106]   # the anchor tokens
