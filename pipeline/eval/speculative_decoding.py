"""Speculative decoding of one prompt against the live target, block and DDTree, and the plain
decoding it is measured against (greedy, one prompt or a batch of rows); greedy unless a
`SpeculativeSampler` is given (then plain sampling and lossless speculative sampling:
speculative_sampling.py). Several prompts per verify pass: batched.py.

Speculative decoding is lossless by construction: greedy, every emitted token is the target's own
greedy choice given the tokens before it; sampled, every emitted token is distributed as the
target's warped distribution given the tokens before it. The drafter only decides how many of
them one verification pass confirms. Per verify step the acceptance length is (accepted draft
tokens) + 1 (the bonus token the target produces itself).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from pipeline.drafter.incremental import DraftContext
from pipeline.target_model.live import LiveTarget
from pipeline.target_model.plain_rows import decode_plainly
from pipeline.eval.speculative_sampling import SpeculativeSampler, target_tokens
from pipeline.eval.tree import build_tree


@dataclass
class Decoded:
    tokens: list[int]
    accepted: list[int] = field(default_factory=list)   # accepted draft tokens per verify step
    verify_passes: int = 0
    target_passes: int = 0
    drafts: list[list[int]] = field(default_factory=list)  # each step's draft tokens (DDTree: the tree's, best-first)
    verify_tokens: int = 0  # tokens the target processed in verify passes


def _finish(out: list[int], new: list[int], eos: set[int], max_new: int) -> bool:
    """Append `new` to `out`, cutting at the first end-of-sequence or at max_new; True when done."""
    for token in new:
        out.append(token)
        if token in eos or len(out) >= max_new:
            return True
    return False


def _choose(logits: torch.Tensor, position: int, sampling: SpeculativeSampler | None, row: int) -> int:
    """The target's token at `position` from its logits there: the argmax, or a draw."""
    return int(logits.argmax()) if sampling is None else sampling.pick(row, position, logits)


def greedy(target: LiveTarget, prompt: list[int], *, max_new: int, eos: set[int],
           sampling: SpeculativeSampler | None = None, row: int = 0) -> Decoded:
    """Plain decoding, one target pass a token: greedy, or sampled with `sampling` (prompt index
    `row` keys its random numbers)."""
    start = target.passes
    state, pos, token = _prefill(target, prompt, None, sampling, row)
    out: list[int] = []
    while not _finish(out, [token], eos, max_new):
        step = target.run([token], state, pos, with_hidden=False)
        state, pos = step.state, pos + 1
        token = _choose(step.logits[-1], pos, sampling, row)
    return Decoded(out, target_passes=target.passes - start)


@torch.no_grad()
def greedy_rows(target: LiveTarget, prompts: list[list[int]], *, max_new: int, eos: set[int],
                sampling: SpeculativeSampler | None = None, row_ids: list[int] | None = None) -> list[Decoded]:
    """`greedy` for several prompts at once: one target pass per token for all of them, each
    prompt exactly as alone (pipeline/target_model/plain_rows.py); a prompt that finishes leaves
    the batch. Sampled, `row_ids[i]` (default i) keys prompt i's random numbers, so it draws the
    same tokens as `greedy(..., row=row_ids[i])`."""
    ids = list(row_ids) if row_ids is not None else list(range(len(prompts)))
    results = [Decoded([]) for _ in prompts]

    def pick(logits: torch.Tensor, active: list[int]) -> list[int]:
        return target_tokens(logits, ((ids[i], len(prompts[i]) + len(results[i].tokens)) for i in active), sampling)

    passes = decode_plainly(target, prompts, pick, lambda i, token: not _finish(results[i].tokens, [token], eos, max_new))
    for result, n in zip(results, passes):
        result.target_passes = n
    return results


def drafting_blocks_of(drafter, block_size: int, *, name: str = "block_size"):
    """`drafter` drafting blocks of `block_size` (eval's --block-size), itself left as trained.
    Decoding reads the block from `drafter.config`, so a shorter one is a shallow copy of the
    module, sharing its weights, with a config of its own (DrafterConfig.at_block, which checks
    the block; `name` as there); at the trained block, the drafter itself."""
    config = drafter.config.at_block(block_size, name=name)
    if config == drafter.config:
        return drafter
    view = copy.copy(drafter)
    view.config = config     # the view's attribute only: the loaded drafter keeps its config
    return view


@torch.no_grad()
def draft_logits(drafter, context_TNH: torch.Tensor, anchor: int, anchor_pos: int) -> torch.Tensor:
    """Drafter logits [B-1, V] for the positions after `anchor`; context = tapped hidden states of positions < anchor_pos."""
    c = drafter.config
    b = c.block_size
    device = drafter.fc.weight.device
    ids = torch.full((1, b), c.mask_token_id, dtype=torch.long, device=device)
    ids[0, 0] = anchor
    pos = torch.arange(anchor_pos, anchor_pos + b, device=device)[None]
    allowed = torch.ones(1, b, context_TNH.shape[0] + b, dtype=torch.bool, device=device)
    return drafter(context_TNH[None].to(device, drafter.fc.weight.dtype), ids, pos, allowed)[0, 1:].float()


class Recomputed:
    """The drafter without a cache: each step runs it over the whole context (`draft_logits`).
    The reference that DraftContext is tested and benchmarked against."""

    def __init__(self, drafter):
        self.drafter, self.context = drafter, None

    def extend(self, hidden_TNH: torch.Tensor) -> None:
        self.context = hidden_TNH if self.context is None else torch.cat([self.context, hidden_TNH])

    def logits(self, anchor: int, anchor_pos: int) -> torch.Tensor:
        return draft_logits(self.drafter, self.context, anchor, anchor_pos)


def drafting(drafter, cached: bool = True):
    return DraftContext(drafter) if cached else Recomputed(drafter)


def _prefill(target: LiveTarget, prompt: list[int], context, sampling: SpeculativeSampler | None, row: int):
    """(committed state, position of the first new token, that token); the prompt's tapped hidden
    states go into the drafter's context."""
    pre = target.run(prompt, None, 0, with_hidden=context is not None, last_only=True)
    if context is not None:
        context.extend(pre.hidden)
    return pre.state, len(prompt), _choose(pre.logits[-1], len(prompt), sampling, row)


def block_decode(target: LiveTarget, drafter, prompt: list[int], *, max_new: int, eos: set[int],
                 draft=None, cached: bool = True, sampling: SpeculativeSampler | None = None, row: int = 0) -> Decoded:
    """Block speculative decoding. `draft(anchor, pos) -> [B-1] tokens` overrides the drafter
    (tests use an oracle; with `sampling` it returns [B-1, V] logits); `cached=False` drafts
    without the drafter's KV cache (the reference). With `sampling`: speculative sampling, its
    random numbers keyed by prompt index `row`."""
    start = target.passes
    context = drafting(drafter, cached) if draft is None else None
    state, pos, bonus = _prefill(target, prompt, context, sampling, row)
    result = Decoded([])
    while not _finish(result.tokens, [bonus], eos, max_new):
        on_device = None
        if sampling is None and draft is None:
            # The drafts stay on the device into the verify pass; they and the target's choices
            # come back to the host in one read after it (one sync a step, not two).
            on_device = context.logits(bonus, pos).argmax(-1)
            drafts = torch.cat([on_device.new_tensor([bonus]), on_device])
        elif sampling is None:
            drafts = draft(bonus, pos)
        else:
            drafts, q = sampling.draft_chain(row, pos, draft(bonus, pos) if draft else context.logits(bonus, pos))
        verified = target.verify(drafts if on_device is not None else [bonus, *drafts], state, pos,
                                 with_hidden=context is not None)
        verify = verified.step
        if on_device is not None:
            read = torch.cat([on_device, verify.logits.argmax(-1)]).tolist()
            drafts, choices = read[:len(on_device)], read[len(on_device):]
        elif sampling is None:
            choices = verify.logits.argmax(-1).tolist()  # choices[k]: the target's token for position pos+k+1
        result.drafts.append(drafts)
        result.verify_passes += 1
        result.verify_tokens += len(drafts) + 1
        if sampling is None:
            n = 0
            while n < len(drafts) and drafts[n] == choices[n]:
                n += 1
            following = choices[n]
        else:
            n, following = sampling.accept_chain(row, pos, drafts, q, verify.logits)
        result.accepted.append(n)
        state = target.commit(verified, n + 1)           # the bonus token and the accepted drafts, no second pass
        if context is not None:
            context.extend(verify.hidden[:n + 1])
        pos += n + 1
        if _finish(result.tokens, drafts[:n], eos, max_new):
            break
        bonus = following
    result.target_passes = target.passes - start
    return result


TREE_VERIFY = ("tree", "paths")
# `--tree-verify auto`: the tree pass wins where the target's compute dominates, the paths where
# Python overhead per layer call does (BENCHMARKS "Tree verification": a 229 M target verifies
# 1.25x / 1.54x faster as a tree at budgets 16 / 64; the 1.7 M embedded target 1.31x / 1.14x
# faster as paths). The threshold lies between the two measured sizes; the crossover itself was
# not measured.
TREE_PASS_FROM_PARAMETERS = 20_000_000


def choose_tree_verify(non_embedding_parameters: int, *, batch_size: int, takes_mask: bool) -> tuple[str, str]:
    """(method, why) for `--tree-verify auto`."""
    if batch_size > 1:
        return "tree", "several prompts per pass verify their trees in one pass over the nodes"
    if not takes_mask:
        return "paths", "the target's attention implementation takes no tree mask"
    if non_embedding_parameters >= TREE_PASS_FROM_PARAMETERS:
        return "tree", (f"{non_embedding_parameters / 1e6:.1f} M non-embedding parameters >= "
                        f"{TREE_PASS_FROM_PARAMETERS / 1e6:.0f} M: the target's compute dominates")
    return "paths", (f"{non_embedding_parameters / 1e6:.1f} M non-embedding parameters < "
                     f"{TREE_PASS_FROM_PARAMETERS / 1e6:.0f} M: per-layer call overhead dominates")


def tree_decode(target: LiveTarget, drafter, prompt: list[int], *, max_new: int, eos: set[int], budget: int,
                top_k: int = 8, cached: bool = True, verify: str = "tree", draft=None,
                sampling: SpeculativeSampler | None = None, row: int = 0) -> Decoded:
    """DDTree: verify a best-first draft tree in one target pass and follow the target's choices
    down it. `verify="tree"` processes each tree node once (an ancestor mask for the attention
    layers, per-node recurrent states from the parent's for the Gated DeltaNet layers);
    `verify="paths"` batches the tree's root-to-leaf paths as rows (shared prefixes recomputed;
    the exactness reference). Either way the committed state is cut out of that one pass.
    `draft(anchor, pos) -> [B-1, V] logits` overrides the drafter (benchmarks use an oracle).
    With `sampling`: the tree is built from the drafter's warped q and walked by drawing from the
    target's p at each depth (speculative_sampling.py), its random numbers keyed by prompt index `row`."""
    if verify not in TREE_VERIFY:
        raise ValueError(f"verify must be one of {TREE_VERIFY}, got {verify!r}")
    start = target.passes
    context = drafting(drafter, cached) if draft is None else None
    state, pos, bonus = _prefill(target, prompt, context, sampling, row)
    result = Decoded([])
    while not _finish(result.tokens, [bonus], eos, max_new):
        logits = draft(bonus, pos) if draft else context.logits(bonus, pos)
        logprobs = torch.log_softmax(logits, dim=-1) if sampling is None else sampling.tree_logprobs(logits)
        tree = build_tree(logprobs, budget, top_k)
        result.drafts.append(list(tree.tokens))
        walk = _verify_as_tree if verify == "tree" else _verify_as_paths
        before = target.tokens
        chooser = Chooser(sampling, row, pos)
        accepted, choice, state, hidden = walk(target, tree, bonus, state, pos, chooser)
        result.verify_passes += 1
        result.verify_tokens += target.tokens - before
        result.accepted.append(len(accepted))
        if context is not None:
            context.extend(hidden)                        # the bonus token's and the accepted tokens'
        pos += len(accepted) + 1
        if _finish(result.tokens, accepted, eos, max_new):
            break
        bonus = choice
    result.target_passes = target.passes - start
    return result


def _follow(tree, choice_at) -> tuple[list[int], int, list[int]]:
    """Walk down the tree while the target's choice is a child: (accepted tokens, the target's
    choice after them, the accepted nodes). `choice_at(node, depth)` is the target's token after
    the path ending at `node` (-1: the root)."""
    accepted, nodes, node = [], [], -1
    while True:
        choice = choice_at(node, len(accepted))
        child = tree.children.get(node, {}).get(choice)
        if child is None:
            return accepted, choice, nodes
        accepted.append(choice)
        nodes.append(child)
        node = child


@dataclass(frozen=True)
class Chooser:
    """The target's token after a tree node from that node's logits, at depth d (position
    pos + 1 + d): the argmax, or a draw from p (speculative_sampling.py's DDTree rule)."""
    sampling: SpeculativeSampler | None
    row: int
    pos: int

    def many(self, logits_NV: torch.Tensor, depths: list[int]) -> list[int]:
        """The target's token after each of N nodes (node i at depth depths[i]) from their logits,
        in one read back to the host: every node's, the walk then reads the ones it reaches (a
        sync per accepted token otherwise)."""
        return target_tokens(logits_NV, ((self.row, self.pos + 1 + d) for d in depths), self.sampling)


def _verify_as_tree(target: LiveTarget, tree, bonus: int, state, pos: int, chooser: Chooser):
    verified = target.verify_tree([bonus, *tree.tokens], [-1, *(p + 1 for p in tree.parents)], state, pos)
    logits = verified.step.logits                        # per tree token (0: the bonus), the target's next-token logits
    choices = chooser.many(logits, [0, *(d + 1 for d in tree.depths)])
    accepted, choice, nodes = _follow(tree, lambda node, depth: choices[node + 1])
    path = [0, *(n + 1 for n in nodes)]
    return accepted, choice, target.commit_path(verified, path), verified.step.hidden[path]


def _verify_as_paths(target: LiveTarget, tree, bonus: int, state, pos: int, chooser: Chooser):
    paths = tree.paths()
    width = max(len(p) for p in paths)
    rows = torch.tensor([[bonus] + [tree.tokens[n] for n in p] + [bonus] * (width - len(p)) for p in paths])
    verified = target.verify_rows(rows, state, pos)
    logits = verified.step.logits
    row_of = {n: r for r, p in enumerate(paths) for n in p}
    # Per tree token (0: the bonus), where its next-token logits are: (path row, depth).
    at = [(0, 0), *((row_of[n], d + 1) for n, d in enumerate(tree.depths))]
    index = torch.tensor(at, dtype=torch.long, device=logits.device)
    choices = chooser.many(logits[index[:, 0], index[:, 1]], [d for _, d in at])
    accepted, choice, nodes = _follow(tree, lambda node, depth: choices[node + 1])
    row = row_of[nodes[-1]] if nodes else 0
    keep = len(accepted) + 1
    return accepted, choice, target.commit(verified, keep, row=row), verified.step.hidden[row, :keep]
