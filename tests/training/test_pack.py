"""A micro-batch packed from prepared sequences (pipeline/training/batch.py): the placeholder a
rank with no anchor packs adds nothing to the loss or to any metric, whatever it packs beside, and
has the cache's context shape; a draft vocabulary's labels and soft targets are worked by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness import loss_batches as lb
from pipeline.drafter.vocab import DraftVocab
from pipeline.training.batch import SequenceBlocks, _to_draft_vocab, forward_logits, loss_sum, pack, placeholder, prepare
from pipeline.training.metrics import metric_sums


def prepared(n: int, seed: int, soft: bool, vocab: DraftVocab | None = None) -> SequenceBlocks:
    return prepare(lb.sample(n, seed), block_size=lb.B, num_anchors=9, max_length=4096, mask_token_id=lb.V - 1,
                   gamma=4.0, generator=torch.Generator().manual_seed(seed), soft=soft, vocab=vocab)


@pytest.mark.parametrize("soft, with_vocab", [(False, False), (True, False), (True, True)])
def test_a_placeholder_beside_real_sequences_changes_no_loss_and_no_metric(soft, with_vocab):
    drafter = lb.drafter(seed=0)
    vocab = DraftVocab(torch.arange(0, lb.V, 2), lb.V) if with_vocab else None
    alone = pack([prepared(57, 0, soft, vocab)], lb.B)
    beside = pack([prepared(57, 0, soft, vocab), placeholder(drafter.config, lb.K if soft else None, vocab=with_vocab)], lb.B)
    assert beside.real_blocks.tolist() == [True] * len(alone.real_blocks) + [False] * len(alone.real_blocks)
    with torch.no_grad():
        logits_alone, logits_beside = forward_logits(drafter, alone), forward_logits(drafter, beside)
    a = len(alone.labels)
    torch.testing.assert_close(logits_beside[:a], logits_alone, rtol=1e-5, atol=1e-5)
    for kind in ("ce", "kl") if soft else ("ce",):
        torch.testing.assert_close(loss_sum(logits_beside, beside, kind), loss_sum(logits_alone, alone, kind),
                                   rtol=1e-5, atol=1e-5)
    sums_alone = metric_sums(logits_alone, alone.labels, alone.weights, alone.real_blocks, alone.outside)
    sums_beside = metric_sums(logits_beside, beside.labels, beside.weights, beside.real_blocks, beside.outside)
    assert sums_beside.keys() == sums_alone.keys()
    for key in sums_alone:
        assert torch.equal(sums_beside[key], sums_alone[key]), key
    # a placeholder alone (a rank with no anchor at all): a forward, and nothing counted
    only = pack([placeholder(drafter.config, lb.K if soft else None, vocab=with_vocab)], lb.B)
    with torch.no_grad():
        sums = metric_sums(forward_logits(drafter, only), only.labels, only.weights, only.real_blocks, only.outside)
    assert all(float(v.sum()) == 0 for v in sums.values())
    if soft:
        assert only.soft_ids.shape == only.soft_probs.shape == (1, lb.B, lb.K)
        assert only.soft_probs.sum(-1).flatten().tolist() == pytest.approx([1.0] * lb.B)


def test_the_placeholder_context_has_the_caches_shape():
    config = lb.drafter().config
    assert placeholder(config).hidden.shape == (1, lb.TAPS, lb.H)
    projected = dataclasses.replace(config, tap_projection=20)
    assert placeholder(projected).hidden.shape == (1, 1, 20)
    ph = placeholder(config)
    assert ph.block_ids.tolist() == [lb.V - 1] * lb.B and ph.block_pos.tolist() == list(range(lb.B))
    assert float(ph.weights.sum()) == 0 and ph.outside is None and placeholder(config, vocab=True).outside.tolist() == [[False] * lb.B]


def test_draft_vocabulary_labels_and_soft_targets_by_hand():
    # target vocabulary of 10; the draft vocabulary keeps target ids 1, 4, 6 (draft ids 0, 1, 2)
    vocab = DraftVocab(torch.tensor([1, 4, 6]), 10)
    blocks = SequenceBlocks(torch.zeros(3, 1, 2), torch.zeros(6, dtype=torch.long), torch.arange(6), torch.tensor([0, 2]),
                            labels=torch.tensor([[0, 4, 5], [0, 6, 1]]),
                            weights=torch.tensor([[0.0, 1.0, 0.5], [0.0, 1.0, 0.0]]))
    blocks.soft_ids = torch.tensor([[[1, 4], [4, 6], [6, 5]], [[1, 6], [6, 1], [9, 8]]])
    p = torch.tensor([0.7, 0.2])
    blocks.soft_probs = p.expand(2, 3, 2).clone()
    _to_draft_vocab(blocks, vocab)
    # slot (0, 2): label 5 is outside: weight 0, marked outside; (1, 2) has weight 0 and is not supervised
    assert blocks.labels.tolist() == [[0, 1, 0], [0, 2, 0]]
    assert blocks.weights.tolist() == [[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]
    assert blocks.outside.tolist() == [[False, False, True], [False, False, False]]
    assert blocks.soft_ids.tolist() == [[[0, 1], [1, 2], [2, 0]], [[0, 2], [2, 0], [0, 0]]]
    # rows with both entries inside keep their probabilities bit for bit; [6, 5] keeps 6 alone
    # (renormalised to 1); [9, 8] keeps nothing and stays all zero
    want = [[[0.7, 0.2], [0.7, 0.2], [1.0, 0.0]], [[0.7, 0.2], [0.7, 0.2], [0.0, 0.0]]]
    assert blocks.soft_probs.tolist() == [[[pytest.approx(x) for x in row] for row in a] for a in want]
    assert torch.equal(blocks.soft_probs[0, 0], p) and torch.equal(blocks.soft_probs[1, 1], p)


def test_a_sample_without_a_valid_anchor_prepares_to_none():
    # DESIGN 3.3: an anchor needs loss_mask[a] and loss_mask[a + 1]; a mask with no two
    # supervised tokens in a row has none, and the step leaves the sample out
    sample = lb.sample(40, 0)
    sample["loss_mask"][:] = [1, 0] * 20
    assert prepare(sample, block_size=lb.B, num_anchors=9, max_length=4096, mask_token_id=lb.V - 1, gamma=4.0,
                   generator=torch.Generator().manual_seed(0)) is None
    sample["loss_mask"][:] = 0
    sample["loss_mask"][10:12] = 1
    blocks = prepare(sample, block_size=lb.B, num_anchors=9, max_length=4096, mask_token_id=lb.V - 1, gamma=4.0,
                     generator=torch.Generator().manual_seed(0))
    assert blocks.anchors.tolist() == [10]
