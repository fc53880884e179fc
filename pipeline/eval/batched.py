"""Several prompts per verify pass (`pipeline eval --batch-size`): block or DDTree decoding of a
batch of prompts in lockstep, one target pass per step for all of them.

Each prompt keeps its own drafter context and its own acceptance: a block is verified as a chain
(a tree with one child per token), so both methods go through `LiveTarget.verify_trees`, whose
rows may hold different committed lengths (key/value slots marked per row) and trees of
different shapes. A prompt that finishes leaves the batch. Lossless per prompt, like the
single-prompt decoders in speculative_decoding.py, which these are tested against: the same
drafts, the same accepted tokens at every step. Sampled (a `SpeculativeSampler`), a block is accepted by speculative
sampling's rule rather than walked as a chain; random numbers are keyed by each prompt's index
(`rows_ids`), so a prompt decodes the same tokens here as alone.
"""

from __future__ import annotations

import torch

from pipeline.eval.speculative_decoding import Decoded, _choose, _finish, _follow, drafting
from pipeline.eval.speculative_sampling import SpeculativeSampler, target_tokens
from pipeline.target_model.live import LiveTarget
from pipeline.eval.tree import DraftTree, top_lists, tree_of


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
                budget: int | None = None, top_k: int = 8, draft: list | None = None,
                sampling: SpeculativeSampler | None = None, row_ids: list[int] | None = None) -> list[Decoded]:
    """Block decoding (`budget=None`) or DDTree with `budget` nodes for all `prompts` at once.
    `draft[i](anchor, pos) -> [B-1, V] logits` overrides the drafter for prompt i (benchmarks).
    With `sampling`, `row_ids[i]` (default i) is prompt i's index for its random numbers."""
    ids = list(row_ids) if row_ids is not None else list(range(len(prompts)))
    rows, steps = target.prefill_rows(prompts)
    contexts = [drafting(drafter) for _ in prompts] if draft is None else [None] * len(prompts)
    results = [Decoded([]) for _ in prompts]
    bonus = []
    for i, (context, step) in enumerate(zip(contexts, steps)):
        if context is not None:
            context.extend(step.hidden)
        bonus.append(_choose(step.logits[-1], len(prompts[i]), sampling, ids[i]))
    active = [i for i in range(len(prompts)) if not _finish(results[i].tokens, [bonus[i]], eos, max_new)]
    if len(active) < len(prompts):
        rows = target.keep_rows(rows, active)
    while active:
        trees, qs, starts = [], [], list(rows.starts)
        drafted = [contexts[i].logits(bonus[i], pos) if draft is None else draft[i](bonus[i], pos)
                   for i, pos in zip(active, starts)]
        if budget is None and sampling is None:
            # Every row's drafts in one read back to the host (one sync a step, not one a row).
            trees = [_chain(d) for d in torch.stack(drafted).argmax(-1).tolist()]
        elif budget is None:
            for i, pos, logits in zip(active, starts, drafted):
                drafts, q = sampling.draft_chain(ids[i], pos, logits)
                qs.append(q)
                trees.append(_chain(drafts))
        else:
            logprobs = torch.stack([torch.log_softmax(logits, dim=-1) if sampling is None else sampling.tree_logprobs(logits)
                                    for logits in drafted])
            values, top = top_lists(logprobs, top_k)     # every row's in one read
            trees = [tree_of(v, t, budget) for v, t in zip(values, top)]
        for i, tree in zip(active, trees):
            results[i].drafts.append(list(tree.tokens))
        size = max(len(t.tokens) for t in trees)
        padded = [_pad(t, size, bonus[i]) for t, i in zip(trees, active)]
        verified = target.verify_trees([t for t, _ in padded], [p for _, p in padded], rows)
        logits = verified.step.logits                        # [row, token, V]: the target's next-token logits
        walked = sampling is None or budget is not None      # else speculative sampling's rule along the chain
        choices = _choices(logits, trees, active, ids, starts, sampling) if walked else None
        paths, still = [], []
        for r, (i, tree) in enumerate(zip(active, trees)):
            if not walked:
                n, choice = sampling.accept_chain(ids[i], starts[r], tree.tokens, qs[r], logits[r])
                accepted, nodes = tree.tokens[:n], list(range(n))
            else:
                accepted, choice, nodes = _follow(tree, lambda node, depth, r=r: choices[r][node + 1])
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


def _choices(logits_RNV: torch.Tensor, trees: list[DraftTree], active: list[int], ids: list[int], starts: list[int],
             sampling: SpeculativeSampler | None) -> list[list[int]]:
    """Per row, the target's token after each of its tree's tokens (0: the bonus; padding
    included), every row's in one read back to the host."""
    n = logits_RNV.shape[1]

    def keys():  # read only when sampling: greedy verification builds none
        for r, (i, tree) in enumerate(zip(active, trees)):
            depths = [0, *(d + 1 for d in tree.depths)]
            depths += [0] * (n - len(depths))              # padding leaves: drawn, never read
            yield from ((ids[i], starts[r] + 1 + d) for d in depths)

    chosen = target_tokens(logits_RNV.reshape(-1, logits_RNV.shape[-1]), keys(), sampling)
    return [chosen[r * n:(r + 1) * n] for r in range(len(trees))]
