"""A micro-batch packed from prepared sequences (pipeline/training/batch.py): the placeholder a
rank with no anchor packs adds nothing to the loss or to any metric, whatever it packs beside, and
has the cache's context shape; a draft vocabulary's labels and soft targets are worked by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness import loss_batches as lb
from pipeline.drafter.vocab import DraftVocab
from pipeline.training.batch import (SequenceBlocks, _to_draft_vocab, anchor_generator, forward_logits, loss_sum,
                                     noise_generator, pack, placeholder, prepare)
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
    projected = dataclasses.replace(config, projected_rank=20)
    assert placeholder(projected).hidden.shape == (1, 1, 20)
    ph = placeholder(config)
    assert ph.block_ids.tolist() == [lb.V - 1] * lb.B and ph.block_pos.tolist() == list(range(lb.B))
    assert float(ph.weights.sum()) == 0 and ph.outside is None and placeholder(config, vocab=True).outside.tolist() == [[False] * lb.B]


def test_draft_vocabulary_labels_and_soft_targets_by_hand():
    # target vocabulary of 10; the draft vocabulary keeps target ids 1, 4, 6 (draft ids 0, 1, 2)
    vocab = DraftVocab(torch.tensor([1, 4, 6]), 10)
    blocks = SequenceBlocks(torch.zeros(3, 1, 2), torch.zeros(6, dtype=torch.long), torch.arange(6), torch.tensor([0, 2]),
                            labels=torch.tensor([[4, 4, 5], [0, 6, 6]]),
                            weights=torch.tensor([[0.0, 1.0, 0.5], [0.0, 1.0, 0.0]]))
    blocks.soft_ids = torch.tensor([[[1, 4], [4, 6], [6, 5]], [[9, 8], [6, 1], [1, 4]]])
    p = torch.tensor([0.7, 0.2])
    blocks.soft_probs = p.expand(2, 3, 2).clone()
    _to_draft_vocab(blocks, vocab)
    # slot (0, 2): label 5 is outside: weight 0, marked outside; a slot of weight 0 has label 0
    # whatever its target id ((0, 0), (1, 2): inside, yet not supervised)
    assert blocks.labels.tolist() == [[0, 1, 0], [0, 2, 0]]
    assert blocks.weights.tolist() == [[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]
    assert blocks.outside.tolist() == [[False, False, True], [False, False, False]]
    assert blocks.soft_ids.tolist() == [[[0, 1], [1, 2], [2, 0]], [[0, 0], [2, 0], [0, 1]]]
    # a row with both entries inside keeps its probabilities bit for bit, whatever the other rows
    # of its slot or block lose; [6, 5] keeps 6 alone (renormalised to 1); [9, 8] keeps nothing
    want = [[[0.7, 0.2], [0.7, 0.2], [1.0, 0.0]], [[0.0, 0.0], [0.7, 0.2], [0.7, 0.2]]]
    assert blocks.soft_probs.tolist() == [[[pytest.approx(x) for x in row] for row in a] for a in want]
    for a, b in ((0, 0), (0, 1), (1, 1), (1, 2)):
        assert torch.equal(blocks.soft_probs[a, b], p), (a, b)


def test_every_sample_epoch_and_step_draws_from_its_own_stream():
    """Anchors are resampled per (seed, epoch, sample) and the context noise per (seed, step,
    sample): each key gets a stream of its own (the module docstring), the same one again for the
    same key (so a resumed or re-sharded run draws what the first did)."""
    def first_draws(generator):
        return tuple(torch.randint(0, 2**31, (4,), generator=generator).tolist())

    keys = [(seed, at, sample) for seed in (0, 1) for at in (0, 1, 7) for sample in (0, 1, 5, 1000)]
    for make in (anchor_generator, noise_generator):
        draws = [first_draws(make(*key)) for key in keys]
        assert len(set(draws)) == len(keys), make.__name__
        assert draws == [first_draws(make(*key)) for key in keys]


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
