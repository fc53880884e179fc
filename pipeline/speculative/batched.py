"""Several prompts per verify pass (`pipeline eval --batch-size`): block or DDTree decoding of a
batch of prompts in lockstep, one target pass per step for all of them.

Each prompt keeps its own drafter context and its own acceptance: a block is verified as a chain
(a tree with one child per token), so both methods go through `LiveTarget.verify_trees`, whose
rows may hold different committed lengths (key/value slots marked per row) and trees of
different shapes. A prompt that finishes leaves the batch. Lossless per prompt, like the
single-prompt decoders in decode.py, which these are tested against: the same drafts, the same
accepted tokens at every step.
"""

from __future__ import annotations

import torch

from pipeline.speculative.decode import Decoded, _finish, _follow, drafting
from pipeline.target.live import LiveTarget
from pipeline.speculative.tree import DraftTree, build_tree


def _chain(drafts: list[int]) -> DraftTree:
    tree = DraftTree()
    for k, token in enumerate(drafts):
        tree.tokens.append(token)
        tree.parents.append(k - 1)
        tree.depths.append(k)
        tree.children.setdefault(k - 1, {})[token] = k
    return tree


def _pad(tree: DraftTree, size: int, filler: int) -> tuple[list[int], list[int]]:
    """The tree's tokens and parents (root first) with extra leaves under the root up to `size`
    nodes (so every row of a batch has as many): they are not in `tree.children`, so the walk
    never follows them."""
    tokens, parents = [filler, *tree.tokens], [-1, *(p + 1 for p in tree.parents)]
    tokens += [filler] * (size + 1 - len(tokens))
    parents += [0] * (size + 1 - len(parents))
    return tokens, parents


def decode_rows(target: LiveTarget, drafter, prompts: list[list[int]], *, max_new: int, eos: set[int],
                budget: int | None = None, top_k: int = 8, draft: list | None = None) -> list[Decoded]:
    """Block decoding (`budget=None`) or DDTree with `budget` nodes for all `prompts` at once.
    `draft[i](anchor, pos) -> [B-1, V] logits` overrides the drafter for prompt i (benchmarks)."""
    rows, steps = target.prefill_rows(prompts)
    contexts = [drafting(drafter) for _ in prompts] if draft is None else [None] * len(prompts)
    results = [Decoded([]) for _ in prompts]
    bonus = []
    for context, step in zip(contexts, steps):
        if context is not None:
            context.extend(step.hidden)
        bonus.append(int(step.logits[-1].argmax()))
    active = [i for i in range(len(prompts)) if not _finish(results[i].tokens, [bonus[i]], eos, max_new)]
    if len(active) < len(prompts):
        rows = target.keep_rows(rows, active)
    while active:
        trees = []
        for i, pos in zip(active, rows.starts):
            logits = contexts[i].logits(bonus[i], pos) if draft is None else draft[i](bonus[i], pos)
            trees.append(_chain(logits.argmax(-1).tolist()) if budget is None
                         else build_tree(torch.log_softmax(logits, dim=-1), budget, top_k))
            results[i].drafts.append(list(trees[-1].tokens))
        size = max(len(t.tokens) for t in trees)
        padded = [_pad(t, size, bonus[i]) for t, i in zip(trees, active)]
        verified = target.verify_trees([t for t, _ in padded], [p for _, p in padded], rows)
        choices = verified.step.logits.argmax(-1).tolist()    # [row][token]: the target's next token
        paths, still = [], []
        for r, (i, tree) in enumerate(zip(active, trees)):
            accepted, choice, nodes = _follow(tree, lambda node, _, r=r: choices[r][node + 1])
            path = [0, *(n + 1 for n in nodes)]
            paths.append(path)
            result = results[i]
            result.verify_passes += 1
            result.verify_tokens += size + 1
            result.accepted.append(len(accepted))
            if contexts[i] is not None:
                contexts[i].extend(verified.step.hidden[r, path])
            if not (_finish(result.tokens, accepted, eos, max_new) or _finish(result.tokens, [choice], eos, max_new)):
                bonus[i] = choice
                still.append(r)
        rows = target.commit_paths(verified, paths)
        if len(still) < len(active):
            rows = target.keep_rows(rows, still) if still else rows
            active = [active[r] for r in still]
    for result in results:
        result.target_passes = 1 + result.verify_passes     # its prefill, then the verify passes it took part in
    return results
