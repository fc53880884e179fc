"""DDTree: a draft tree from one drafter pass, best-first under a node budget.

The drafter gives one distribution per block slot (slots 1..B-1), not conditioned on the other
draft tokens, so a path is a choice of one of the top-K tokens at each depth and its score is
the sum of their log-probabilities. Expansion is lazy and best-first: popping a node adds it to
the tree and offers its first child (rank 0 one level deeper) and its next sibling (rank r+1 at
its level); both score lower than the node (log-probabilities are <= 0 and the top-K lists are
sorted), so nodes leave the heap in score order and the first `budget` popped are the best tree.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)    # node -> token
    parents: list[int] = field(default_factory=list)   # node -> parent node (-1: the root, the bonus token)
    depths: list[int] = field(default_factory=list)    # node -> depth (0: first draft position)
    children: dict[int, dict[int, int]] = field(default_factory=dict)  # node (-1 root) -> {token: child}

    def paths(self) -> list[list[int]]:
        """Node ids of every root-to-leaf path."""
        out = []
        for node in range(len(self.tokens)):
            if node not in self.children:
                path = []
                while node != -1:
                    path.append(node)
                    node = self.parents[node]
                out.append(path[::-1])
        return out


def top_lists(logprobs_XDV: torch.Tensor, top_k: int) -> tuple[list, list]:
    """(values, ids) of the top-k per depth, as host lists, in one read back from the device (ids
    travel as float64, exact below 2^53)."""
    values, ids = logprobs_XDV.topk(min(top_k, logprobs_XDV.shape[-1]), dim=-1)
    both = torch.stack([values.double(), ids.double()]).tolist()
    return both[0], _ints(both[1])


def _ints(nested):
    return [_ints(x) for x in nested] if isinstance(nested, list) else int(nested)


def build_tree(logprobs_DV: torch.Tensor, budget: int, top_k: int) -> DraftTree:
    """The best `budget` nodes over depths 0..D-1 (D = B-1 draft positions)."""
    return tree_of(*top_lists(logprobs_DV, top_k), budget)


def tree_of(values: list[list[float]], ids: list[list[int]], budget: int) -> DraftTree:
    """`build_tree` from the top-k lists per depth (`top_lists`)."""
    depth_count = len(values)
    tree = DraftTree()
    heap = [(-values[0][0], 0, -1, 0, 0.0)]   # (-score, tie-break, parent node, rank, parent score)
    counter = 1
    while heap and len(tree.tokens) < budget:
        neg, _, parent, rank, parent_score = heapq.heappop(heap)
        depth = 0 if parent == -1 else tree.depths[parent] + 1
        node = len(tree.tokens)
        token = ids[depth][rank]
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.depths.append(depth)
        tree.children.setdefault(parent, {})[token] = node
        score = -neg
        if rank + 1 < len(ids[depth]) and values[depth][rank + 1] > float("-inf"):  # -inf: cut by top-k / top-p
            heapq.heappush(heap, (-(parent_score + values[depth][rank + 1]), counter, parent, rank + 1, parent_score))
            counter += 1
        if depth + 1 < depth_count:
            heapq.heappush(heap, (-(score + values[depth + 1][0]), counter, node, 0, score))
            counter += 1
    return tree
