"""Training objectives (DESIGN 3.4): the loss terms, their weighted sums, and the slot weights.

A loss is a weighted sum of terms, written `ce`, `lk` or `ce + 0.5*tv`. Per supervised slot, with
p the target's distribution and q the drafter's softmax, and alpha = sum_v min(p_v, q_v) (the
probability that speculative sampling accepts the drafter's token):
- ce:  -log q(label), the target's argmax (the hard label; the first recipe);
- kl:  KL(p || q);
- tv:  1 - alpha (total variation);
- nla: -log max(alpha, 1e-5) (negative log acceptance);
- lk:  lam * KL(p || q) + (1 - lam) * (1 - alpha), lam = exp(-3 alpha) taken without gradient
  (the adaptive blend of LK Losses, arXiv 2602.23881: KL while acceptance is low, TV as it rises).

p is the cache's top-k (32 by default: stored logits minus the stored full-vocabulary
logsumexp give exact probabilities) renormalised over those k tokens: the tail's mass is spread
over them in proportion. Why: every term then compares two distributions (KL >= 0, alpha <= 1,
each minimised at q = p), and the tail it drops is what the cache cannot describe anyway (on the
embedded miniature's supervised positions the tail beyond the top-32 averages 1.5e-4 of the
target's mass, 0.4% at the 99th percentile, 1.5% at most: BENCHMARKS "Objectives").
Under a greedy target the label is the whole distribution (p one-hot): alpha = q(label), so kl
and nla reduce to ce, tv to 1 - q(label), lk to exp(-3 q) ce + (1 - exp(-3 q)) (1 - q).

Slot weights (`position_weight`): "decay", exp(-(k-1)/gamma) (the first recipe), or "dpace", the
expected-acceptance gain of improving slot k (speculators' D-PACE): with the drafter's own
confidence q_k = exp(-ce_k) smoothed to s_k = (1 - a) q_k + a on supervised slots (1 on the
others), w_k = m_k * sum_{j>=k} m_j prod_{i<=j} s_i, computed without gradient; the loss is then
sum(loss * w) / sum(m), m the supervised slots (speculators' normaliser).
"""

from __future__ import annotations

import torch

POSITION_WEIGHTS = ("decay", "dpace")
NLA_FLOOR = 1e-5
LK_ETA = 3.0


def describe_slot_weights(position_weight: str, gamma: float, alpha: float) -> str:
    """What weighs the slots, as run.json records it: under dpace the decay's gamma (a preset's,
    say) is in the config but plays no part, and the record says so."""
    if position_weight == "dpace":
        return f"dpace (alpha {alpha:g}; gamma {gamma:g} unused)"
    return f"decay exp(-(k-1)/{gamma:g})"


def needs_distribution(terms: dict[str, float]) -> bool:
    """Whether the loss reads the target's stored top-k (every term but ce does)."""
    return any(name != "ce" for name in terms)


@torch.no_grad()
def dpace_weights(ce_AB: torch.Tensor, supervised_AB: torch.Tensor, alpha: float,
                  unreachable_AB: torch.Tensor | None = None) -> torch.Tensor:
    """D-PACE slot weights [A, B] from the drafter's per-slot cross-entropy (any value on
    unsupervised slots) and the supervised slots (bool or 0/1). `unreachable_AB`: slots that can
    never be accepted (a label outside a draft vocabulary): s = 0 there, so the chain stops and
    nothing after them weighs."""
    m = supervised_AB.to(torch.float64)
    q = torch.exp(-ce_AB.to(torch.float64))
    s = torch.where(m > 0, (1 - alpha) * q + alpha, torch.ones_like(q))
    if unreachable_AB is not None:
        s = torch.where(unreachable_AB.bool(), torch.zeros_like(s), s)
    reach = m * torch.cumprod(s, dim=-1)                     # m_j * prod_{i<=j} s_i
    after = reach.flip(-1).cumsum(-1).flip(-1)               # sum over j >= k
    return (m * after).to(ce_AB.dtype)


def term_rows(logq: torch.Tensor, p: torch.Tensor, terms: dict[str, float]):
    """Per row of a chunk: (each term's value {name: [c]}, a [c], b [c, K]) such that the gradient
    of sum_t coef_t * term_t with respect to the row's logits is a * softmax - (b scattered at
    the row's ids). `logq` [c, K] is log q at the row's ids, `p` [c, K] the target's probability
    there; column 0 is the hard label (for ce; its p is 0 wherever p also lists it among the rest)."""
    q = logq.exp()
    values, a, b = {}, torch.zeros_like(q[:, 0]), torch.zeros_like(q)
    if "ce" in terms:
        values["ce"] = -logq[:, 0]
        a += terms["ce"]
        b[:, 0] += terms["ce"]
    if len(terms) == 1 and "ce" in terms:
        return values, a, b
    soft = p
    kl = (soft * (torch.log(soft.clamp_min(1e-30)) - logq)).sum(-1)
    below = (q < soft).to(q.dtype)          # where min(p, q) = q: alpha's gradient flows through q
    alpha = torch.minimum(soft, q).sum(-1)
    mq = below * q
    d_tv_a, d_tv_b = mq.sum(-1), mq          # d(1 - alpha)/dlogits = (sum m q) softmax - scatter(m q)
    if "kl" in terms:
        values["kl"] = kl
        a += terms["kl"] * soft.sum(-1)
        b += terms["kl"] * soft
    if "tv" in terms:
        values["tv"] = 1 - alpha
        a += terms["tv"] * d_tv_a
        b += terms["tv"] * d_tv_b
    if "nla" in terms:
        clamped = alpha.clamp_min(NLA_FLOOR)
        values["nla"] = -torch.log(clamped)
        scale = torch.where(alpha > NLA_FLOOR, 1 / clamped, torch.zeros_like(alpha))
        a += terms["nla"] * scale * d_tv_a
        b += terms["nla"] * scale[:, None] * d_tv_b
    if "lk" in terms:
        lam = torch.exp(-LK_ETA * alpha)
        values["lk"] = lam * kl + (1 - lam) * (1 - alpha)
        a += terms["lk"] * (lam * soft.sum(-1) + (1 - lam) * d_tv_a)
        b += terms["lk"] * (lam[:, None] * soft + (1 - lam)[:, None] * d_tv_b)
    return values, a, b


# ce and kl from full logits [A, B, V] (batch.py's `loss_sum`): the reference the chunked loss
# (loss.py) is checked against.
def weighted_ce(logits_ABV: torch.Tensor, labels_AB: torch.Tensor, weights_AB: torch.Tensor) -> torch.Tensor:
    """sum(ce * w) / sum(w) (DESIGN 3.4)."""
    ce = torch.nn.functional.cross_entropy(logits_ABV.flatten(0, 1).float(), labels_AB.flatten(), reduction="none")
    total = weights_AB.sum()
    return (ce * weights_AB.flatten()).sum() / total.clamp_min(1e-12)


def weighted_soft_kl(logits_ABV, soft_ids_ABK, soft_probs_ABK, weights_AB) -> torch.Tensor:
    """sum(KL(p || q) * w) / sum(w), p the renormalised target top-k, q the drafter's softmax."""
    logq = torch.log_softmax(logits_ABV.float(), dim=-1).gather(-1, soft_ids_ABK)
    p = soft_probs_ABK
    kl = (p * (torch.log(p.clamp_min(1e-30)) - logq)).sum(-1)
    return (kl * weights_AB).sum() / weights_AB.sum().clamp_min(1e-12)
