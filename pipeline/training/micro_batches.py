"""How a rank's share of a step is cut into micro-batches: sequences of like size together.

A micro-batch is one padded forward (pipeline/training/batch.py: `pack`): every sequence in it is
padded to its longest context and its most anchors, and padded queries cost as much as real ones.
Taking the sequences in the stream's order, a short turn next to a long one paid for the long one:
on the embedded kit's conversations half the queries of an 8-sequence micro-batch were padding, and
57% of the work (BENCHMARKS "The newcomer's hour"). So the share is sorted by size and cut where
that saves work, never into more than `cap` sequences a micro-batch (the memory
bound `--micro-batch-sequences` sets).

The gradient does not depend on the cut: the loss of every micro-batch is divided by the global
sum of weights (step.py), so micro-batches add up to the same sum in another order (equal up to
float rounding). The cut is a pure function of the share, so a resumed run cuts as the first did.
"""

from __future__ import annotations

from dataclasses import dataclass

# What one more forward and backward costs beyond its arithmetic, in padded query-context pairs
# (the unit of `padded_work`): Python, the launches and the allocations of every layer. Chosen by
# measurement on the CPU for the tiny preset (BENCHMARKS "The newcomer's hour": steps 1.82x / 1.78x /
# 1.58x faster than the stream's order at 20,000 / 70,000 / 150,000, a tie between the first two,
# of which 70,000 makes fewer forwards; a micro-batch per sequence, the other extreme, 1.03x). At
# the flagship's width a sequence's work is millions of these units, so the cut there follows the
# padding alone.
FORWARD_COST = 70_000


@dataclass(frozen=True)
class Sizes:
    """A sequence's size as `pack` pads it: its anchors (blocks) and its context tokens."""
    anchors: int
    tokens: int

    @classmethod
    def of(cls, seq) -> "Sizes":
        """Of a prepared sequence (pipeline/training/batch.py: `SequenceBlocks`)."""
        return cls(anchors=seq.labels.shape[0], tokens=seq.num_tokens)


def padded_work(sizes: list[Sizes], per_query: int) -> int:
    """Query-context pairs of one packed forward of these sequences, padding included: every
    sequence padded to the most anchors and the longest context among them; `per_query` adds a
    query's work besides attention (its projections and MLP) in the same unit."""
    anchors = max(s.anchors for s in sizes)
    tokens = max(s.tokens for s in sizes)
    return len(sizes) * anchors * (tokens + per_query)


def cut(sizes: list[Sizes], cap: int, *, per_query: int, forward_cost: int | None = None) -> list[list[int]]:
    """Micro-batches as lists of indices into `sizes`: sorted by size (largest first; ties keep
    their order), cut into runs of at most `cap` that minimise the padded work plus `forward_cost`
    a micro-batch (FORWARD_COST unless given; an exact minimum over the sorted order, by dynamic
    programming)."""
    forward_cost = FORWARD_COST if forward_cost is None else forward_cost
    if not sizes:
        return []
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i].anchors, -sizes[i].tokens, i))
    ranked = [sizes[i] for i in order]
    n = len(ranked)
    best = [0] + [None] * n          # best[i]: the least cost of the first i sequences
    cut_at = [0] * (n + 1)
    for i in range(1, n + 1):
        for j in range(max(0, i - cap), i):
            cost = best[j] + padded_work(ranked[j:i], per_query) + forward_cost
            if best[i] is None or cost < best[i]:
                best[i], cut_at[i] = cost, j
    runs, i = [], n
    while i > 0:
        runs.append(order[cut_at[i]:i])
        i = cut_at[i]
    return runs[::-1]


def per_query_work(config, *, head_rows: int) -> int:
    """A block query's work besides attention, in query-context pairs of attention: every layer's
    projections and MLP plus the head's row per logit (`head_rows`: the vocabulary or the draft
    vocabulary), over every layer's attention per context key (scores and values: 2 x heads x
    head_dim multiply-adds). About 550 for the tiny preset, 70,000 for the flagship's drafter:
    there the padded queries, not the padded context, decide the cut."""
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    layer = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size
    attention_per_key = config.num_hidden_layers * 2 * config.num_attention_heads * d
    return max(1, round((config.num_hidden_layers * layer + h * head_rows) / attention_per_key))
