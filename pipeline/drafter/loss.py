"""The training loss without full-vocabulary logits (issue 17): lm_head + cross-entropy (or the
top-k KL) on the supervised slots only, a chunk of rows at a time, its gradient taken in the same pass.

A flagship micro-step has 512 anchors x 16 slots = 8,192 queries and a 248,320-token vocabulary:
full logits are 8 GB in fp32 per sequence, and the log-softmax, its gradient and the metrics'
copy multiply that. Here a query's logits exist only inside one chunk of `chunk_rows` rows
(about 256 MB at that vocabulary by default), once: the loss, the metrics and the gradient
w.r.t. the hidden states are all taken from them in forward (backward only scales that
gradient), so autograd keeps one fp32 [N, H] tensor for the supervised slots. Unsupervised slots (weight 0: slot 0, past the end, outside the loss mask, padding) never
reach the lm_head: their loss and gradient are zero in the full computation too.

The lm_head is the target's, frozen: backward returns the gradient for the hidden states only.
The metrics (top-1/4/8 hits of each supervised slot) are taken from the same chunks, no grad.
Written with torch only; a fused kernel (Liger's fused linear cross-entropy, cut-cross-entropy)
would replace `_chunk_logits` + softmax on a GPU once it is measured there.
"""

from __future__ import annotations

import torch

# Rows per chunk: keep one chunk's fp32 logits near this many bytes.
CHUNK_BYTES = 256 * 2**20
LOSS_PATH = "chunked torch (lm_head + loss on supervised slots, gradient taken in forward)"


def chunk_rows_for(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    return max(1, chunk_bytes // (4 * vocab_size))


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits of a chunk: the matmul in the lm_head's dtype (bf16 on a GPU), then upcast,
    as a plain `lm_head(h).float()` computes them."""
    return (h.to(weight.dtype) @ weight.t()).float()


class _LinearTargetLoss(torch.autograd.Function):
    """Per row i: loss_i = sum_k p_ik * (log p_ik - log softmax(h_i W^T)[id_ik]); the hard label
    is K = 1 with p = 1 (cross-entropy). Returns (sum_i w_i * loss_i, hits [N, 3] or an empty
    tensor): the top-1/4/8 hits of `ids[:, 0]` are read off the same chunk of logits."""

    @staticmethod
    def forward(ctx, h, weight, ids, probs, row_weights, chunk_rows, with_hits):
        total = torch.zeros((), dtype=torch.float64, device=h.device)
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
        ctx.mark_non_differentiable(hits)
        return total.to(torch.float32), hits

    @staticmethod
    def backward(ctx, grad_out, _grad_hits):
        (grad_h,) = ctx.saved_tensors
        return (grad_h * grad_out).to(ctx.h_dtype), None, None, None, None, None, None


def supervised_loss(final_hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                    weights: torch.Tensor, *, soft_ids: torch.Tensor | None = None, soft_probs: torch.Tensor | None = None,
                    chunk_rows: int | None = None, with_hits: bool = False):
    """(sum over supervised slots of loss * w, hits [A, B, 3] or None).

    final_hidden [A, B, H] (the drafter's normed output), labels/weights [A, B], soft targets
    [A, B, K] for the KL loss. Equals `weighted_ce(lm_head(final_hidden), ...) * sum(w)` (or the
    KL) and its gradient, without the [A*B, V] logits."""
    rows = weights.reshape(-1) > 0
    h = final_hidden.reshape(-1, final_hidden.shape[-1])[rows]
    w = weights.reshape(-1)[rows].float()
    chunk = chunk_rows or chunk_rows_for(lm_head_weight.shape[0])
    if soft_ids is None:
        ids = labels.reshape(-1)[rows].long()[:, None]
        probs = torch.ones_like(ids, dtype=torch.float32)
    else:
        # The hits (metrics) are of the hard label: it leads the ids, with probability 0 in the loss.
        ids = torch.cat([labels.reshape(-1)[rows].long()[:, None],
                         soft_ids.reshape(-1, soft_ids.shape[-1])[rows].long()], dim=1)
        probs = torch.cat([torch.zeros(len(ids), 1, device=ids.device),
                           soft_probs.reshape(-1, soft_probs.shape[-1])[rows].float()], dim=1)
    loss, row_hits = _LinearTargetLoss.apply(h, lm_head_weight, ids, probs, w, chunk, with_hits)
    hits = None
    if with_hits:
        hits = torch.zeros(*weights.shape, 3, dtype=torch.bool, device=weights.device)
        hits.view(-1, 3)[rows] = row_hits
    return loss, hits
