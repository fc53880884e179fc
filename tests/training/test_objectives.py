"""Training objectives (issue 42, DESIGN 3.4): D-PACE slot weights on hand-worked blocks, every
loss term's value and gradient through the chunked path against autograd on a plain
full-vocabulary implementation written here from the formulas, what each term reduces to under a
greedy (one-hot) target, and the chunked path's memory property for every term and weight."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.training import loss as loss_module
from pipeline.training.loss import supervised_loss
from pipeline.config import parse_loss
from pipeline.training.objectives import dpace_weights

# Hand-worked D-PACE blocks (alpha 0.5; slot 0 is the anchor, never supervised). Confidences
# q = exp(-ce) = 0.8, 0.5, 0.9, 0.6 on slots 1-4, so s = 0.5 q + 0.5 = 0.9, 0.75, 0.95, 0.8 and
# the running products are 0.9, 0.675, 0.64125, 0.513.
Q = [1.0, 0.8, 0.5, 0.9, 0.6]
HAND_WORKED = [
    # all four supervised: w_k = sum of the products from k on
    ([0, 1, 1, 1, 1], [0.0, 2.72925, 1.82925, 1.15425, 0.513]),
    # slot 2 outside the loss mask (a user turn inside the block): s = 1 there, weight 0, the
    # chain goes on: products 0.9, 0.9, 0.855, 0.684
    ([0, 1, 0, 1, 1], [0.0, 2.439, 0.0, 1.539, 0.684]),
    # the sequence ends after slot 2: slots 3-4 unsupervised
    ([0, 1, 1, 0, 0], [0.0, 1.575, 0.675, 0.0, 0.0]),
]


@pytest.mark.parametrize("mask, expected", HAND_WORKED)
def test_dpace_weights_on_hand_worked_blocks(mask, expected):
    ce = torch.tensor([[-math.log(q) for q in Q]], dtype=torch.float64)
    got = dpace_weights(ce, torch.tensor([mask]), 0.5)
    assert got[0].tolist() == pytest.approx(expected, abs=1e-9)


def test_dpace_stops_at_a_slot_that_can_never_be_accepted():
    """Slot 2's label is outside a draft vocabulary (weight 0 in the loss, like a masked slot), but
    unlike a masked slot nothing after it can be accepted: s = 0 there, products 0.9, 0, 0, 0."""
    ce = torch.tensor([[-math.log(q) for q in Q]], dtype=torch.float64)
    got = dpace_weights(ce, torch.tensor([[0, 1, 0, 1, 1]]), 0.5, torch.tensor([[False, False, True, False, False]]))
    assert got[0].tolist() == pytest.approx([0.0, 0.9, 0.0, 0.0, 0.0], abs=1e-12)


def test_dpace_alpha_one_gives_the_count_of_supervised_slots_from_k_on():
    """a = 1: every s is 1 whatever the confidence, so w_k = the supervised slots at or after k."""
    ce = torch.rand(3, 6) * 4
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 1, 0, 1, 0, 1], [0, 1, 1, 0, 0, 0]])
    want = torch.tensor([[0, 5, 4, 3, 2, 1], [0, 3, 0, 2, 0, 1], [0, 2, 1, 0, 0, 0]], dtype=torch.float32)
    assert torch.equal(dpace_weights(ce, mask, 1.0), want)


def test_loss_expressions():
    assert parse_loss("ce") == {"ce": 1.0}
    assert parse_loss("ce + 0.5*tv") == {"ce": 1.0, "tv": 0.5}
    assert parse_loss("0.3*kl+0.7*lk") == {"kl": 0.3, "lk": 0.7}
    for bad in ("xe", "ce+ce", "0*ce", "ce-tv", ""):
        with pytest.raises(ValueError):
            parse_loss(bad)


# The plain reference: full-vocabulary logits, each term from its formula, autograd for the gradient.
V, H, A, B, K = 40, 12, 5, 6, 6


def plain_dpace(ce, mask, alpha):
    """D-PACE from its definition, one block and slot at a time."""
    out = torch.zeros_like(ce)
    for a in range(ce.shape[0]):
        s = [((1 - alpha) * math.exp(-float(ce[a, i])) + alpha) if mask[a, i] else 1.0 for i in range(ce.shape[1])]
        prods = [math.prod(s[:j + 1]) for j in range(len(s))]
        for k in range(ce.shape[1]):
            if mask[a, k]:
                out[a, k] = sum(prods[j] for j in range(k, len(s)) if mask[a, j])
    return out


def plain_loss(hidden, weight, labels, weights, soft_ids, soft_probs, terms, dpace_alpha=None):
    logq = torch.log_softmax(hidden.reshape(-1, H) @ weight.t(), dim=-1).reshape(A, B, V)
    q = logq.exp()
    p = torch.zeros(A, B, V).scatter(-1, soft_ids, soft_probs)
    ce = -logq.gather(-1, labels[..., None])[..., 0]
    kl = (torch.where(p > 0, p * (torch.log(p.clamp_min(1e-30)) - logq), torch.zeros(()))).sum(-1)
    alpha = torch.minimum(p, q).sum(-1)
    lam = torch.exp(-3 * alpha).detach()
    values = {"ce": ce, "kl": kl, "tv": 1 - alpha, "nla": -torch.log(alpha.clamp_min(1e-5)),
              "lk": lam * kl + (1 - lam) * (1 - alpha)}
    w = weights if dpace_alpha is None else plain_dpace(ce.detach(), weights > 0, dpace_alpha)
    return sum(c * (values[name] * w).sum() for name, c in terms.items())


def problem(seed: int, one_hot: bool = False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(A, B, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.7
    weights = (torch.rand(A, B, generator=g) < 0.8).float() * torch.exp(-torch.arange(B) / 4.0)
    weights[:, 0] = 0
    weights[1] = 0       # a padding block
    soft_ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(A * B)]).reshape(A, B, K)
    labels = soft_ids[..., 0].clone()               # the target's argmax leads its top-k
    soft_probs = torch.softmax(torch.randn(A, B, K, generator=g) * 2, dim=-1).sort(-1, descending=True).values
    if one_hot:
        soft_probs = torch.zeros(A, B, K)
        soft_probs[..., 0] = 1.0
    return hidden, weight, labels, weights, soft_ids, soft_probs


@pytest.mark.parametrize("terms", [{"ce": 1.0}, {"ce": 2.0}, {"kl": 1.0}, {"kl": 2.0}, {"tv": 1.0}, {"nla": 1.0}, {"lk": 1.0},
                                   {"ce": 1.0, "tv": 0.5}, {"kl": 0.3, "lk": 0.7, "nla": 0.2}])
@pytest.mark.parametrize("dpace_alpha", [None, 0.5])
@pytest.mark.parametrize("chunk_rows", [1, 4, None])
def test_each_loss_value_and_gradient_equal_the_plain_full_vocabulary_reference(terms, dpace_alpha, chunk_rows):
    hidden, weight, labels, weights, soft_ids, soft_probs = problem(3)
    if dpace_alpha is not None:
        weights = (weights > 0).float()               # D-PACE takes the mask
    want_h = hidden.clone().requires_grad_()
    want = plain_loss(want_h, weight, labels, weights, soft_ids, soft_probs, terms, dpace_alpha)
    (3 * want).backward()       # training scales the loss before backward (world / global weight)
    got_h = hidden.clone().requires_grad_()
    sums = {}
    soft = set(terms) != {"ce"}                     # ce alone: hard labels, no stored top-k
    got, _ = supervised_loss(got_h, weight, labels, weights, soft_ids=soft_ids if soft else None,
                             soft_probs=soft_probs if soft else None, chunk_rows=chunk_rows, terms=terms,
                             dpace_alpha=dpace_alpha, term_sums=sums)
    (3 * got).backward()
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    scale = want_h.grad.abs().max()
    assert scale > 0
    assert float((got_h.grad - want_h.grad).abs().max() / scale) < 1e-5
    assert sum(c * float(sums[name]) for name, c in terms.items()) == pytest.approx(float(got.detach()), rel=1e-5)
    # the plain cross-entropy of the hard label, unweighted, over the supervised slots (the log's "ce")
    logq = torch.log_softmax(hidden.reshape(-1, H) @ weight.t(), dim=-1)
    supervised = weights.reshape(-1) > 0
    plain = -logq[supervised].gather(-1, labels.reshape(-1)[supervised][:, None]).sum()
    assert float(sums[loss_module.PLAIN_CE]) == pytest.approx(float(plain), rel=1e-5)
    for name in terms:   # each term on its own, as the train log records it
        alone = plain_loss(hidden, weight, labels, weights, soft_ids, soft_probs, {name: 1.0}, dpace_alpha)
        assert float(sums[name]) == pytest.approx(float(alone), rel=1e-5), name


def test_under_a_greedy_target_each_term_reduces_as_documented():
    """p one-hot at the label: kl = nla = ce, tv = 1 - q(label), lk = lam ce + (1 - lam)(1 - q)."""
    hidden, weight, labels, weights, soft_ids, soft_probs = problem(5, one_hot=True)
    def total(name):
        return float(supervised_loss(hidden, weight, labels, weights, soft_ids=soft_ids, soft_probs=soft_probs,
                                     terms={name: 1.0})[0])
    ce = float(supervised_loss(hidden, weight, labels, weights)[0])
    q = torch.softmax(hidden.reshape(-1, H) @ weight.t(), -1).reshape(A, B, V).gather(-1, labels[..., None])[..., 0]
    lam = torch.exp(-3 * q)
    assert total("kl") == pytest.approx(ce, rel=1e-5) and total("nla") == pytest.approx(ce, rel=1e-5)
    assert total("tv") == pytest.approx(float(((1 - q) * weights).sum()), rel=1e-5)
    lk = (lam * -torch.log(q) + (1 - lam) * (1 - q)) * weights
    assert total("lk") == pytest.approx(float(lk.sum()), rel=1e-5)


@pytest.mark.parametrize("terms", [{"ce": 1.0}, {"tv": 1.0}, {"lk": 1.0}, {"ce": 1.0, "nla": 0.5}])
@pytest.mark.parametrize("dpace_alpha", [None, 0.5])
def test_no_more_than_one_chunk_of_vocabulary_logits(terms, dpace_alpha, monkeypatch):
    """Forward computes logits one chunk of rows at a time; backward keeps nothing with a
    vocabulary axis but the lm_head weight (the full-logits path keeps [rows, V])."""
    hidden, weight, labels, weights, soft_ids, soft_probs = problem(7)
    if dpace_alpha is not None:
        weights = (weights > 0).float()
    chunks, saved = [], []
    original = loss_module._chunk_logits

    def recording(h, w):
        chunks.append(h.shape[0])
        return original(h, w)

    monkeypatch.setattr(loss_module, "_chunk_logits", recording)
    h = hidden.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        soft = set(terms) != {"ce"}
        supervised_loss(h, weight, labels, weights, soft_ids=soft_ids if soft else None,
                        soft_probs=soft_probs if soft else None, chunk_rows=4, terms=terms, dpace_alpha=dpace_alpha)
    assert chunks and max(chunks) <= 4 and sum(chunks) == int((weights > 0).sum())
    assert saved and [s for s in saved if V in s and s != (V, H)] == []


def test_a_chunk_of_logits_is_the_budget_in_fp32_and_never_empty():
    for vocab in (248_320, 151_936, 1000):
        rows = loss_module.chunk_rows_for(vocab)
        assert rows * 4 * vocab <= loss_module.CHUNK_BYTES < (rows + 1) * 4 * vocab
    assert loss_module.chunk_rows_for(10**9) == 1       # a vocabulary wider than the budget: a row a chunk


def test_the_default_chunk_follows_the_vocabulary_not_the_width(monkeypatch):
    hidden, weight, labels, weights, _, _ = problem(5)
    chunks, asked = [], []
    original = loss_module._chunk_logits
    monkeypatch.setattr(loss_module, "_chunk_logits", lambda h, w: chunks.append(h.shape[0]) or original(h, w))
    monkeypatch.setattr(loss_module, "chunk_rows_for", lambda vocab: asked.append(vocab) or 3)
    supervised_loss(hidden, weight, labels, weights)
    assert asked == [V] and max(chunks) == 3


def test_the_hits_of_a_head_narrower_than_the_top_8():
    # a (draft) head of 5 tokens: every label is inside its top 8, the top-1 as the argmax says
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 4, H, generator=g), torch.randn(5, H, generator=g)
    labels, weights = torch.randint(0, 5, (2, 4), generator=g), torch.ones(2, 4)
    soft = (torch.randint(0, 5, (2, 4, 3), generator=g), torch.full((2, 4, 3), 1 / 3))
    for (soft_ids, soft_probs), terms in (((None, None), None), (soft, None), (soft, {"ce": 1.0, "tv": 0.5})):
        _, hits = supervised_loss(hidden, weight, labels, weights, soft_ids=soft_ids, soft_probs=soft_probs,
                                  with_hits=True, terms=terms)
        argmax = (hidden @ weight.t()).argmax(-1)
        assert torch.equal(hits[..., 0], argmax == labels) and hits[..., 2].all()


def test_the_hits_of_every_recipe_are_the_full_logits_top_1_4_8():
    hidden, weight, _, weights, soft_ids, soft_probs = problem(11)
    order = (hidden.reshape(-1, H) @ weight.t()).argsort(-1, descending=True)
    # slot i's label is its (i mod 10)-th most likely token: top-1, inside the top 4, the top 8, or neither
    label = order[torch.arange(A * B), torch.arange(A * B) % 10][:, None]
    labels = label.view(A, B)
    ranked = order[:, :8]
    want = torch.stack([ranked[:, 0] == label[:, 0], (ranked[:, :4] == label).any(-1), (ranked == label).any(-1)], -1)
    want = want.view(A, B, 3) & (weights > 0)[..., None]
    assert 0 < int(want[..., 0].sum()) < int(want[..., 1].sum()) < int(want[..., 2].sum())   # each level adds hits
    for terms in ({"ce": 1.0}, {"ce": 2.0}, {"kl": 1.0}, {"ce": 1.0, "tv": 0.5}):
        soft = set(terms) != {"ce"}
        _, hits = supervised_loss(hidden, weight, labels, weights, soft_ids=soft_ids if soft else None,
                                  soft_probs=soft_probs if soft else None, with_hits=True, terms=terms)
        assert torch.equal(hits, want), terms
