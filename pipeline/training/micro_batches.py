"""How a rank's share of a step is cut into micro-batches: sequences of like size together.

A micro-batch is one padded forward (pipeline/training/batch.py: `pack`): every sequence in it is
padded to its longest context and its most anchors, and padded queries cost as much as real ones.
Taking the sequences in the stream's order, a short turn next to a long one paid for the long one:
on the embedded kit's conversations half the queries of an 8-sequence micro-batch were padding, and
57% of the work (BENCHMARKS "The newcomer's hour"). So the share is sorted by size (largest first)
and cut into runs of at most `cap` sequences (the memory bound `--micro-batch-sequences` sets).
Where to cut depends on what a forward costs besides its arithmetic, so on the device:

- On the CPU a forward's fixed cost is small and was measured (FORWARD_COST, in padded work): the
  cut minimises padded work plus FORWARD_COST a forward, which may make more forwards than
  ceil(n / cap) when that saves padding (the tiny preset: 2.4 forwards a step of its 8 sequences,
  on average over the embedded cache's first 20 steps, where ceil(n / cap) is 1).
- On an accelerator (any device but the CPU: CUDA, the test kit's simulated one) a forward's
  fixed cost is its kernel launches and syncs, every layer's, forward and backward, while the
  padding it saves at these sizes is arithmetic a GPU does in parallel at little cost: the cut
  makes the fewest forwards the memory bound allows, ceil(n / cap), and among those the least
  padding (so sorting by size still helps). Not timed on a GPU yet (BENCHMARKS "issue 69 item 4").

`forward_cost_on(device)` picks the rule; the step passes it to `cut` (no global setting).

The gradient does not depend on the cut: the loss of every micro-batch is divided by the global
sum of weights (step.py), so micro-batches add up to the same sum in another order (equal up to
float rounding). The cut is a pure function of the share and the device type, so a resumed run on
the same kind of device cuts as the first did.

Cost: an exact dynamic program over the sorted order, O(n * cap) (the padded maxima kept as the
run grows), and the sort.
"""

from __future__ import annotations

from dataclasses import dataclass

# The CPU's rule (`forward_cost_on`): what one more forward and backward costs beyond its
# arithmetic, in padded query-context pairs (the unit of `padded_work`): Python, the launches and
# the allocations of every layer. Chosen by measurement on the CPU for the tiny preset (BENCHMARKS
# "The newcomer's hour": steps 1.82x / 1.78x / 1.58x faster than the stream's order at 20,000 /
# 70,000 / 150,000, a tie between the first two, of which 70,000 makes fewer forwards; a
# micro-batch per sequence, the other extreme, 1.03x). At the flagship's width a sequence's work is
# millions of these units, so the cut there follows the padding alone.
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


def forward_cost_on(device) -> int | None:
    """The cost of one more forward on `device`'s type, for `cut`: FORWARD_COST on the CPU; None
    on an accelerator, where a forward's fixed cost dominates padding (the fewest forwards)."""
    return FORWARD_COST if device.type == "cpu" else None


def cut(sizes: list[Sizes], cap: int, *, per_query: int, forward_cost: int | None) -> list[list[int]]:
    """Micro-batches as lists of indices into `sizes`: sorted by size (largest first; ties keep
    their order), cut into runs of at most `cap` that minimise the padded work plus `forward_cost`
    a micro-batch; None: the fewest micro-batches, ceil(n / cap), and the least padded work among
    those. An exact minimum over the sorted order, by dynamic programming."""
    if not sizes:
        return []
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i].anchors, -sizes[i].tokens, i))
    ranked = [sizes[i] for i in order]
    if forward_cost is None:
        forward_cost = _dearer_than_any_padding(ranked, per_query)
    cut_at = _least_cost_cuts(ranked, cap, per_query, forward_cost)
    runs, i = [], len(ranked)
    while i > 0:
        runs.append(order[cut_at[i]:i])
        i = cut_at[i]
    return runs[::-1]


def _dearer_than_any_padding(ranked: list[Sizes], per_query: int) -> int:
    """A forward cost above the padded work of any cut (every sequence padded to the largest
    anchors and context of all): one forward more then always costs more than any padding saved,
    so the least cost has the fewest forwards and, among those, the least padded work (exact: ints)."""
    return padded_work(ranked, per_query) + 1


def _least_cost_cuts(ranked: list[Sizes], cap: int, per_query: int, forward_cost: int) -> list[int]:
    """cut_at[i]: where the last run of the cheapest cut of ranked[:i] starts. For each end i the
    run ranked[j:i] grows as j walks down, its most tokens kept as it grows (O(n * cap), not a max
    over each slice); its most anchors are ranked[j]'s, the order being by anchors first."""
    n = len(ranked)
    best = [0] + [0] * n             # best[i]: the least cost of the first i sequences
    cut_at = [0] * (n + 1)
    for i in range(1, n + 1):
        most_tokens, least = 0, None
        for j in range(i - 1, max(0, i - cap) - 1, -1):
            most_tokens = max(most_tokens, ranked[j].tokens)
            cost = best[j] + (i - j) * ranked[j].anchors * (most_tokens + per_query) + forward_cost
            if least is None or cost <= least:     # a tie goes to the longest last run, as before issue 69
                least, cut_at[i] = cost, j
        best[i] = least
    return cut_at


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
