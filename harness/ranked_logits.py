"""A hand-built case for the training metrics (DESIGN 4): drafter logits whose ranks are placed by
hand, and every metric's value worked out by hand from those ranks, so the metrics are checked
against arithmetic done on paper rather than against the code's own helpers. Shared by the
full-logits path (tests/training/test_blocks.py) and the chunked loss's hits
(tests/training/test_loss.py).

Three blocks of B = 5 slots over a vocabulary of 12. RANKS[a][k] is where slot k's label stands
in the drafter's ranking (0 = its top-1, 7 = the last place inside the top-8); None marks a slot
out of the loss (slot 0 always, and block 1's slot 4).

    block 0: ranks 0 0 2 0   top-1 hits slots 1,2,4   streak 2; top-4 and top-8 all: streak 4
    block 1: ranks 5 0 1 -   top-1 hits slot 2        streak 0; top-4 misses slot 1: streak 0;
                                                      top-8 hits 1-3, slot 4 unsupervised: streak 3
    block 2: ranks 0 3 7 8   top-1 hits slot 1        streak 1; top-4 hits 1,2: streak 2;
                                                      top-8 hits 1-3 (rank 7 is 8th), not 4: streak 3
"""

from __future__ import annotations

import torch

A, B, V = 3, 5, 12
RANKS = [[None, 0, 0, 2, 0],
         [None, 5, 0, 1, None],
         [None, 0, 3, 7, 8]]

# Worked by hand from RANKS: 11 supervised slots (4 + 3 + 4).
EXPECTED = {
    "accuracy": 5 / 11,                 # top-1 hits: 3 + 1 + 1
    "top4_acc": 8 / 11,                 # ranks 0-3: 4 + 2 + 2
    "top8_acc": 10 / 11,                # ranks 0-7: 4 + 3 + 3 (only block 2's rank 8 misses)
    "avg_streak": (2 + 0 + 1) / 3,
    "ddtree_streak4": (4 + 0 + 2) / 3,
    "ddtree_streak8": (4 + 3 + 3) / 3,
    "pos_acc": [2 / 3, 2 / 3, 0 / 3, 1 / 2],   # slot 4 is supervised in blocks 0 and 2 only
    "supervised_slots": 11,
}


def ranked_case(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [A, B, V], labels [A, B], weights [A, B]). Each slot's logits are V distinct values
    laid on a random order of the vocabulary (no ties, so every rank is exact); the label is the
    token placed at the slot's rank. Weights are decayed (not 0/1): metrics ignore the decay."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.zeros(A, B, V)
    labels = torch.zeros(A, B, dtype=torch.long)
    weights = torch.zeros(A, B)
    for a in range(A):
        for k in range(B):
            order = torch.randperm(V, generator=g)                # order[r]: the token ranked r
            logits[a, k, order] = torch.linspace(4.0, -4.0, V)    # strictly decreasing along the ranks
            if RANKS[a][k] is not None:
                labels[a, k] = order[RANKS[a][k]]
                weights[a, k] = 0.8 ** (k - 1)
    return logits, labels, weights
