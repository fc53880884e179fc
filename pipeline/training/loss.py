"""The training loss without full-vocabulary logits (issue 17): lm_head + the loss terms
(objectives.py: cross-entropy, or distribution terms over the stored top-k) on the supervised
slots only, a chunk of rows at a time, its gradient taken in the same pass.

A flagship micro-step has 512 anchors x 16 slots = 8,192 queries and a 248,320-token vocabulary:
full logits are 8 GB in fp32 per sequence, and the log-softmax, its gradient and the metrics'
copy multiply that. Here a query's logits exist only inside one chunk of `chunk_rows` rows
(about 256 MB at that vocabulary by default), once: the loss, the metrics and the gradient
w.r.t. the hidden states are all taken from them in forward (backward only scales that
gradient), so autograd keeps one fp32 [N, H] tensor for the supervised slots. Unsupervised slots (weight 0: slot 0, past the end, outside the loss mask, padding) never
reach the lm_head: their loss and gradient are zero in the full computation too.

The lm_head is the target's, frozen: backward returns the gradient for the hidden states only.
The metrics (top-1/4/8 hits of each supervised slot) are taken from the same chunks, no grad.
Slot weights that depend on the drafter's own predictions (D-PACE) are known only once every
chunk has been seen: then each row's gradient is kept unweighted and scaled at the end (the loss
is linear in the weights), still one [N, H] tensor, no second pass over the logits.
Written with torch only; a fused kernel (Liger's fused linear cross-entropy, cut-cross-entropy)
would replace `_chunk_logits` + softmax on a GPU once it is measured there.
"""

from __future__ import annotations

import torch

from pipeline.training.objectives import dpace_weights, term_rows

# Rows per chunk: keep one chunk's fp32 logits near this many bytes.
CHUNK_BYTES = 256 * 2**20
LOSS_PATH = "chunked torch (lm_head + loss on supervised slots, gradient taken in forward)"
# The key `term_sums` receives the unweighted sum of -log q(label) under: the plain cross-entropy
# that every objective and slot weighting logs alike (a space keeps it apart from any term's name).
PLAIN_CE = "plain ce"


def chunk_rows_for(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    return max(1, chunk_bytes // (4 * vocab_size))


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits of a chunk: the matmul in the lm_head's dtype (bf16 on a GPU), then upcast,
    as a plain `lm_head(h).float()` computes them."""
    return (h.to(weight.dtype) @ weight.t()).float()


class _LinearTargetLoss(torch.autograd.Function):
    """Per row i: loss_i = sum_t coef_t * term_t(p_i, softmax(h_i W^T)) over `terms`
    (objectives.py); the hard label is K = 1 with p = 1. Row weights: `row_weights` [N], or
    `weigh(ce [N]) -> [N]` from each row's cross-entropy against its label (D-PACE). Returns
    (sum_i w_i * loss_i, hits [N, 3] or an empty tensor, [each term's sum_i w_i * term_i (T
    values), then sum_i -log q_i(ids[i, 0]) unweighted]): the top-1/4/8 hits and the plain
    cross-entropy of the hard label `ids[:, 0]` are read off the same chunk of logits."""

    @staticmethod
    def forward(ctx, h, weight, ids, probs, row_weights, chunk_rows, with_hits, terms=(("ce", 1.0),), weigh=None):
        terms = dict(terms)
        hard = probs.shape[1] == 1
        if weigh is None and (terms == {"ce": 1.0} and hard or terms == {"kl": 1.0} and not hard):
            return _LinearTargetLoss._first_recipe(ctx, h, weight, ids, probs, row_weights, chunk_rows, with_hits)
        n = h.shape[0]
        rows = {name: torch.zeros(n, dtype=torch.float32, device=h.device) for name in terms}
        ce = torch.zeros(n, dtype=torch.float32, device=h.device)
        hits = torch.zeros(n if with_hits else 0, 3, dtype=torch.bool, device=h.device)
        grad_h = torch.empty(h.shape, dtype=torch.float32, device=h.device) if ctx.needs_input_grad[0] else None
        top = min(8, weight.shape[0])
        for a in range(0, n, chunk_rows):
            b = min(a + chunk_rows, n)
            logits = _chunk_logits(h[a:b], weight)
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            logq = logits.gather(-1, ids[a:b]) - lse
            values, coef_a, coef_b = term_rows(logq, probs[a:b], terms)
            for name, value in values.items():
                rows[name][a:b] = value
            ce[a:b] = -logq[:, 0]
            if with_hits:
                hit = logits.topk(top, dim=-1).indices == ids[a:b, :1]
                hits[a:b, 0], hits[a:b, 1], hits[a:b, 2] = hit[:, 0], hit[:, :4].any(-1), hit.any(-1)
            if grad_h is not None:
                grad = logits.sub_(lse).exp_().mul_(coef_a[:, None])   # in place: the logits are done
                grad.scatter_add_(-1, ids[a:b], -coef_b)
                if weigh is None:
                    grad.mul_(row_weights[a:b, None])
                grad_h[a:b] = grad.to(weight.dtype) @ weight
        w = weigh(ce) if weigh is not None else row_weights
        if grad_h is not None and weigh is not None:
            grad_h.mul_(w[:, None])
        sums = torch.stack([(rows[name].double() * w.double()).sum() for name in terms])
        total = sum(coef * sums[i] for i, coef in enumerate(terms.values()))
        sums = torch.cat([sums, ce.double().sum().reshape(1)]).to(torch.float32)
        ctx.save_for_backward(grad_h)
        ctx.h_dtype = h.dtype
        ctx.mark_non_differentiable(hits, sums)
        return total.to(torch.float32), hits, sums

    @staticmethod
    def _first_recipe(ctx, h, weight, ids, probs, row_weights, chunk_rows, with_hits):
        """ce or kl with fixed row weights: the path before issue 42, kept as it was (same bits)."""
        total = torch.zeros((), dtype=torch.float64, device=h.device)
        plain = torch.zeros((), dtype=torch.float64, device=h.device)
        hits = torch.zeros(h.shape[0] if with_hits else 0, 3, dtype=torch.bool, device=h.device)
        # The loss is a sum that backward only scales: its gradient w.r.t. h is computed here,
        # from the chunk's logits while they exist, instead of recomputing them in backward
        # (two lm_head matmuls a chunk, not three).
        grad_h = torch.empty(h.shape, dtype=torch.float32, device=h.device) if ctx.needs_input_grad[0] else None
        top = min(8, weight.shape[0])
        for a in range(0, h.shape[0], chunk_rows):
            b = min(a + chunk_rows, h.shape[0])
            logits = _chunk_logits(h[a:b], weight)
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            logq = logits.gather(-1, ids[a:b]) - lse
            p = probs[a:b]
            per_row = (p * (torch.log(p.clamp_min(1e-30)) - logq)).sum(-1)
            total += (per_row * row_weights[a:b]).sum().double()
            plain -= logq[:, 0].sum().double()
            if with_hits:
                hit = logits.topk(top, dim=-1).indices == ids[a:b, :1]
                hits[a:b, 0], hits[a:b, 1], hits[a:b, 2] = hit[:, 0], hit[:, :4].any(-1), hit.any(-1)
            if grad_h is not None:
                # d/dlogits of sum_k p_k (log p_k - logq_k) = (sum_k p_k) softmax - p scattered at ids.
                grad = logits.sub_(lse).exp_().mul_(p.sum(-1, keepdim=True))  # in place: the logits are done
                grad.scatter_add_(-1, ids[a:b], -p)
                grad.mul_(row_weights[a:b, None])
                grad_h[a:b] = grad.to(weight.dtype) @ weight
        ctx.save_for_backward(grad_h)
        ctx.h_dtype = h.dtype
        sums = torch.stack([total, plain]).to(torch.float32)
        ctx.mark_non_differentiable(hits, sums)
        return total.to(torch.float32), hits, sums

    @staticmethod
    def backward(ctx, grad_out, _grad_hits, _grad_sums):
        (grad_h,) = ctx.saved_tensors
        return (grad_h * grad_out).to(ctx.h_dtype), None, None, None, None, None, None, None, None


def supervised_loss(final_hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                    weights: torch.Tensor, *, soft_ids: torch.Tensor | None = None, soft_probs: torch.Tensor | None = None,
                    chunk_rows: int | None = None, with_hits: bool = False, terms: dict[str, float] | None = None,
                    dpace_alpha: float | None = None, term_sums: dict | None = None, outside: torch.Tensor | None = None):
    """(sum over supervised slots of loss * w, hits [A, B, 3] or None).

    final_hidden [A, B, H] (the drafter's normed output), labels/weights [A, B], soft targets
    [A, B, K] for the distribution terms. `terms` {name: coefficient} (objectives.py; default
    {"ce": 1}, or {"kl": 1} with soft targets). Equals `weighted_ce(lm_head(final_hidden), ...) *
    sum(w)` (or the KL) and its gradient, without the [A*B, V] logits. With `dpace_alpha`, the
    slot weights are D-PACE's from the drafter's own cross-entropy, on the slots where `weights`
    > 0 (give 0/1 weights then: the mask), and a slot `outside` marks (its label outside a draft
    vocabulary) stops the chain. `term_sums`, when given, receives each term's
    weighted sum and, under PLAIN_CE, the unweighted sum of the hard label's cross-entropy over
    the same slots (no grad)."""
    # The supervised slots as indices: one read of the mask's size here, where four boolean-mask
    # gathers (and their backward) would each read it again.
    rows = (weights.reshape(-1) > 0).nonzero()[:, 0]
    h = final_hidden.reshape(-1, final_hidden.shape[-1])[rows]
    w = weights.reshape(-1)[rows].float()
    chunk = chunk_rows or chunk_rows_for(lm_head_weight.shape[0])
    if terms is None:
        terms = {"ce": 1.0} if soft_ids is None else {"kl": 1.0}
    weigh = None if dpace_alpha is None else _dpace_weigher(weights, rows, dpace_alpha, outside)
    if soft_ids is None:
        ids = labels.reshape(-1)[rows].long()[:, None]
        probs = torch.ones_like(ids, dtype=torch.float32)
    else:
        # The hits (metrics) are of the hard label: it leads the ids, with probability 0 in the loss.
        ids = torch.cat([labels.reshape(-1)[rows].long()[:, None],
                         soft_ids.reshape(-1, soft_ids.shape[-1])[rows].long()], dim=1)
        probs = torch.cat([torch.zeros(len(ids), 1, device=ids.device),
                           soft_probs.reshape(-1, soft_probs.shape[-1])[rows].float()], dim=1)
    loss, row_hits, sums = _LinearTargetLoss.apply(h, lm_head_weight, ids, probs, w, chunk, with_hits,
                                                   tuple(terms.items()), weigh)
    if term_sums is not None:
        term_sums.update({name: sums[i] for i, name in enumerate(terms)})
        term_sums[PLAIN_CE] = sums[-1]
    hits = None
    if with_hits:
        hits = torch.zeros(*weights.shape, 3, dtype=torch.bool, device=weights.device)
        hits.view(-1, 3)[rows] = row_hits
    return loss, hits


def _dpace_weigher(weights: torch.Tensor, rows: torch.Tensor, alpha: float, outside: torch.Tensor | None):
    """ce of the supervised rows -> their D-PACE weights, computed over the [A, B] blocks."""
    def weigh(ce_rows: torch.Tensor) -> torch.Tensor:
        ce_AB = torch.zeros(weights.shape, dtype=ce_rows.dtype, device=ce_rows.device)
        ce_AB.view(-1)[rows] = ce_rows
        return dpace_weights(ce_AB, weights > 0, alpha, outside).reshape(-1)[rows]
    return weigh
