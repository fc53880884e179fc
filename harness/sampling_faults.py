"""Planted faults in speculative sampling (issues 42 and 81) and the distribution each one gives.

Each fault is a real mutation of the sampling code, planted the way the sampler lets tests in:
  - block faults through the sampler (pipeline/eval/speculative_sampling.py): a faulty
    `LosslessRule` (the acceptance test or the residual), a `SpeculativeSampler` subclass that
    overrides the one method the mutation is in (the key of a random number, the draft's draw),
    or the module's `draw` replaced (the residual drawn without scaling to its total);
  - DDTree faults in its walk, which lives in pipeline/eval/batched.py (`_choices`: the target's
    draw after every node; `_follow`: walk down while the draw is a child): a mutated copy of one
    of the two functions, or a sampler whose keyed draw skips top-p.
`plant(fault, sampling, monkeypatch)` returns the sampler to decode with (and patches what the
fault needs patched).

For each fault, `second_token(fault, step)` is the exact distribution of the second generated
token given the first under the fault, written from the rule (not from decoder code): block slot
1 is drafted from q given token 1 and verified against p given token 1; a DDTree's depth 0 is the
target's draw given token 1, walked into the tree's children of the root. With token 1 the
prefill's draw from p, `first_two(...)` gives the exact joint distribution, the one the
distribution test's power is computed from (harness/sampling_stats.py `calibrated_power`).

The drafter of the powered tests is `CloseDrafter`: the target's own next-token logits with
fixed noise added, so most drafts are plausible (slot 1 accepts 0.76 of them): a fault that only
acts on a rejection (the residual, its random number) then moves the output by a visible amount,
where a drafter whose drafts the target mostly rejects outright hides it (issue 81: a total
variation of 0.0016).

Not planted for DDTree: the draft's top-p (a tree built from q before the cut). The walk never
reads q, only the target's draw, so any tree is lossless and that mutation changes no output
distribution (an equivalent mutant: no test can catch it, none needs to).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from pipeline.eval import batched, speculative_sampling
from pipeline.eval.speculative_sampling import (ACCEPT, DRAFT, RESIDUAL, LosslessRule, SpeculativeSampler,
                                               target_tokens)
from pipeline.eval.tree import build_tree
from pipeline.sampler import Sampler, draw_rows


# ---- block faults ---------------------------------------------------------------------------

class SkippedRejection(LosslessRule):
    """Every draft token is accepted."""
    def accepts(self, p_x, q_x, u):
        return True


class ResidualFromTarget(LosslessRule):
    """A rejected position is redrawn from p instead of the residual max(0, p - q)."""
    def residual(self, p, q):
        return p


class UnclampedResidual(LosslessRule):
    """The residual p - q without the clamp at 0 (negative weights where q > p)."""
    def residual(self, p, q):
        r = p - q
        return torch.where(r.sum() > 0, r, p)


@dataclass(frozen=True)
class ResidualWithAcceptanceNumber(SpeculativeSampler):
    """The residual drawn with the acceptance test's random number (the key's purpose RESIDUAL
    mistyped as ACCEPT). That number is known to be >= p/q on a rejection, so the residual draw
    lands in the top of the residual's cumulative distribution: the fault issue 81's audit found
    surviving."""
    def u(self, row, position, purpose):
        return super().u(row, position, ACCEPT if purpose == RESIDUAL else purpose)


@dataclass(frozen=True)
class DraftBeforeTopP(SpeculativeSampler):
    """Top-p applied to the drafter's q after the draft token is drawn, not before: the draft is
    drawn from q cut by top-k alone, the rule is handed q cut by top-p as well (so a draft from
    q's tail has q = 0 there and passes the acceptance test whenever p > 0)."""
    def draft_chain(self, row, pos, logits_DV):
        q = self.warp(logits_DV)
        uncut = Sampler(self.temperature, top_k=self.top_k).warp(logits_DV)
        return draw_rows(uncut, [self.u(row, pos + 1 + k, DRAFT) for k in range(q.shape[0])]), q


def unscaled_draw(probs: torch.Tensor, u: float) -> int:
    """pipeline/sampler.py `draw` without scaling u by the weights' total: weights that sum to s <
    1 (the residual) are drawn as if they summed to 1, the missing 1 - s landing on the last
    token (the search runs off the end and is clamped there)."""
    cdf = probs.double().cumsum(-1)
    index = int(torch.searchsorted(cdf, cdf.new_tensor([u]), right=True))
    return min(index, probs.shape[-1] - 1)


# ---- DDTree faults (mutated copies of pipeline/eval/batched.py's `_choices` / `_follow`) -----

def _choices_keyed_one_early(logits_RNV, trees, active, ids, starts, sampling):
    """`batched._choices` with a node at depth d keyed at position pos + d, not pos + 1 + d: the
    draw after the root reuses the number the root (bonus) token was drawn with."""
    n = logits_RNV.shape[1]

    def keys():
        for r, (i, tree) in enumerate(zip(active, trees)):
            depths = [0, *(d + 1 for d in tree.depths)]
            depths += [0] * (n - len(depths))
            yield from ((ids[i], starts[r] + d) for d in depths)          # the mutation: + d, not + 1 + d

    chosen = target_tokens(logits_RNV.reshape(-1, logits_RNV.shape[-1]), keys(), sampling)
    return [chosen[r * n:(r + 1) * n] for r in range(len(trees))]


def _choices_redrawn_on_a_miss(logits_RNV, trees, active, ids, starts, sampling):
    """`batched._choices`, but a draw that matches none of its node's children is replaced by a
    second draw from p: the residual after rejecting every child is p itself, not p without the
    children (recursive rejection's residual not taken)."""
    chosen = batched_choices(logits_RNV, trees, active, ids, starts, sampling)
    n = logits_RNV.shape[1]
    flat = logits_RNV.reshape(-1, logits_RNV.shape[-1])
    us = []
    for r, (i, tree) in enumerate(zip(active, trees)):
        depths = [0, *(d + 1 for d in tree.depths)]
        depths += [0] * (n - len(depths))
        us += [sampling.u(ids[i], starts[r] + 1 + d, RESIDUAL) for d in depths]
    again = sampling.draw_keyed(flat, us)
    out = []
    for r, tree in enumerate(trees):
        row = list(chosen[r])
        for node in range(-1, len(tree.tokens)):
            if row[node + 1] not in tree.children.get(node, {}):
                row[node + 1] = again[r * n + node + 1]
        out.append(row)
    return out


def _follow_best_child_on_a_miss(tree, choice_at):
    """`_follow`, but where the target's draw matches no child the walk takes the best child
    anyway (the rejection skipped: a draft the target did not choose is accepted)."""
    accepted, nodes, node = [], [], -1
    while True:
        choice = choice_at(node, len(accepted))
        kids = tree.children.get(node, {})
        child = kids.get(choice)
        if child is None and kids:
            child = next(iter(kids.values()))      # the first child built: the drafter's most likely
            choice = tree.tokens[child]
        if child is None:
            return accepted, choice, nodes
        accepted.append(choice)
        nodes.append(child)
        node = child


@dataclass(frozen=True)
class TargetDrawBeforeTopP(SpeculativeSampler):
    """The target's keyed draws (a DDTree's draw after every node) from p before top-p: the cut
    left until after the draw, where it changes nothing."""
    def draw_keyed(self, logits_RV, us):
        return draw_rows(Sampler(self.temperature, top_k=self.top_k).warp(logits_RV), us)


batched_choices = batched._choices     # the code's own, for the fault that wraps it

BLOCK_FAULTS = ("every draft accepted", "residual from p", "residual not renormalised",
                "residual with the acceptance number", "draft drawn before top-p")
# The un-clamped residual p - q is no distribution: what the draw makes of it turns on the sign of
# the rounding residue of sum(p - q) (about 1e-8), which the verify pass and any oracle's forward
# round apart, so its distribution end to end cannot be computed. The slot test hands the code
# known float32 p and q, where the fault's arithmetic can be followed exactly: there only.
SLOT_FAULTS = (*BLOCK_FAULTS, "residual un-clamped")
TREE_FAULTS = ("best child on a miss", "miss redrawn from p", "depth keyed one early", "target drawn before top-p")
GROSS = {"every draft accepted", "residual un-clamped", "residual not renormalised", "best child on a miss",
         "depth keyed one early"}


def plant(fault: str, sampling: SpeculativeSampler, monkeypatch) -> SpeculativeSampler:
    """The sampler to decode with under `fault` (None: the clean code), patching with pytest's
    `monkeypatch` what the fault mutates outside the sampler."""
    settings = dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed)
    if fault is None:
        return sampling
    if fault == "every draft accepted":
        return SpeculativeSampler(**settings, rule=SkippedRejection())
    if fault == "residual from p":
        return SpeculativeSampler(**settings, rule=ResidualFromTarget())
    if fault == "residual un-clamped":
        return SpeculativeSampler(**settings, rule=UnclampedResidual())
    if fault == "residual not renormalised":
        monkeypatch.setattr(speculative_sampling, "draw", unscaled_draw)
        return sampling
    if fault == "residual with the acceptance number":
        return ResidualWithAcceptanceNumber(**settings)
    if fault == "draft drawn before top-p":
        return DraftBeforeTopP(**settings)
    if fault == "best child on a miss":
        monkeypatch.setattr(batched, "_follow", _follow_best_child_on_a_miss)
        return sampling
    if fault == "miss redrawn from p":
        monkeypatch.setattr(batched, "_choices", _choices_redrawn_on_a_miss)
        return sampling
    if fault == "depth keyed one early":
        monkeypatch.setattr(batched, "_choices", _choices_keyed_one_early)
        return sampling
    if fault == "target drawn before top-p":
        return TargetDrawBeforeTopP(**settings)
    raise ValueError(f"unknown fault {fault!r}")


# ---- the powered fixtures ------------------------------------------------------------------

# End to end (live target): held-out prompt 15 cut after its first three tokens
# ("<|im_start|>user\n"): the first words of a user turn, the miniature's least certain place (after
# the full prompt its first tokens are near certain, and no fault can move them). At temperature
# 1.2, top-k 20, top-p 0.85, with the close drafter's noise 0.5: slot 1 accepts 0.76 of drafts.
# The power against the residual-number fault hangs on where the residual's tokens sit in token
# order, so it varies from context to context (scanned: many settings near this one need more
# than 3,000 samples for it); the slot test below is the guarantee that does not hang on that.
POWERED_PROMPT = (15, 3)            # (held-out prompt index, tokens kept)
POWERED_SETTING = dict(temperature=1.2, top_p=0.85, top_k=20)
DRAFT_NOISE = 0.5
TREE_BUDGET = 3                     # DDTree: 3 nodes, the drafter's top 3 at depth 0 (block 2)

# The slot test: one block slot (`draft_chain` then `accept_chain`) on fixed logits, no model.
# Under its setting (temperature 1, top-p 0.9) p is 0 on tokens 2 and 3, and q drafts token 2
# (q(2) = 0.08); q is 0 on tokens 0 and 7, which the residual must supply; q's tail cut by top-p
# (0.095 before the cut, on tokens 0, 3 and 7) lies mostly where p > 0. Acceptance 0.77.
SLOT_SETTING = dict(temperature=1.0, top_p=0.9)
SLOT_P = [-0.47, 0.03, -1.08, -1.51, 1.30, -0.33, 0.66, -0.99]
SLOT_Q = [-0.91, 0.55, -0.04, -1.49, 1.91, -0.44, 0.60, -0.48]

# Samples per run: for each fault the smallest on the ladder where the test's power against it is
# at least 0.995 (0.99 with a margin for the simulation's error; benchmarks/decoding/
# sampling_power.py prints the table); the clean run takes its test's largest, so the test of the
# clean code has that power against every planted fault.
LADDER = (100, 150, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1500, 2000, 3000)
SAMPLES = {
    "block": {"every draft accepted": 200, "residual from p": 800, "residual not renormalised": 200,
              "residual with the acceptance number": 1000, "draft drawn before top-p": 1200},
    "ddtree": {"best child on a miss": 200, "miss redrawn from p": 400, "depth keyed one early": 200,
               "target drawn before top-p": 300},
    "slot": {"every draft accepted": 200, "residual from p": 400, "residual un-clamped": 100,
             "residual not renormalised": 150, "residual with the acceptance number": 300,
             "draft drawn before top-p": 900},
}


def clean_samples(test: str) -> int:
    return max(SAMPLES[test].values())


def reference_warp(temperature: float, top_p: float = 1.0, top_k: int = 0):
    """logits [..., V] -> probabilities by transformers' own warpers (temperature, then top-k,
    then top-p, as generate applies them) and a softmax: the oracle's warp, not the sampler's."""
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    chain = LogitsProcessorList([TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else [])
                                + ([TopPLogitsWarper(top_p)] if top_p < 1 else []))

    def warp(logits: torch.Tensor) -> torch.Tensor:
        rows = logits.float().reshape(-1, logits.shape[-1]).clone()
        return torch.softmax(chain(None, rows), dim=-1).double().reshape(logits.shape)
    return warp


class CloseDrafter:
    """A drafter for `decode_rows(draft=...)`: for an anchor token, the target's logits after
    prompt + [anchor] and along its greedy continuation (one row per draft slot), each plus fixed
    Gaussian noise of standard deviation `noise` (seeded by the anchor and slot). It sees the
    prompt and the anchor only, so after the first verify step its drafts are guesses; at the
    first step, the one the two-token test reads, slot 1's q is p perturbed."""

    def __init__(self, model, prompt: list[int], slots: int, noise: float, seed: int = 0):
        self.model, self.prompt, self.slots, self.noise, self.seed = model, list(prompt), slots, noise, seed
        self.memo: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def logits(self, anchor: int) -> torch.Tensor:
        if anchor not in self.memo:
            ids, rows = self.prompt + [anchor], []
            for _ in range(self.slots):
                row = self.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                rows.append(row)
                ids = ids + [int(row.argmax())]
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + anchor)
            noise = torch.randn(self.slots, rows[0].shape[-1], generator=g) * self.noise
            self.memo[anchor] = torch.stack(rows) + noise
        return self.memo[anchor]

    def __call__(self, anchor: int, pos: int) -> torch.Tensor:
        return self.logits(anchor)


def slot_samples(sampling: SpeculativeSampler, samples: int) -> Counter:
    """{(0, token): count} of the token block slot 1 emits (its draft when accepted, else the
    residual's draw) over `samples` independent rows, the sampler's own `draft_chain` and
    `accept_chain` on SLOT_Q and SLOT_P (keyed by row: every row's numbers are independent)."""
    q_logits = torch.tensor([SLOT_Q])
    p_logits = torch.tensor([SLOT_P, SLOT_P])          # the slot's p and the bonus position's (unread)
    out = Counter()
    for row in range(samples):
        drafts, q = sampling.draft_chain(row, 0, q_logits)
        n, following = sampling.accept_chain(row, 0, drafts, q, p_logits)
        out[(0, drafts[0] if n else following)] += 1
    return out


def slot_step() -> "SecondStep":
    """The slot test's `SecondStep` (no token 1: a single context of probability 1)."""
    warp, uncut = reference_warp(**SLOT_SETTING), reference_warp(SLOT_SETTING["temperature"])
    p, q = torch.tensor(SLOT_P), torch.tensor(SLOT_Q)
    code = SpeculativeSampler(**SLOT_SETTING)             # for the un-clamped residual alone (SLOT_FAULTS)
    return SecondStep(torch.ones(1, dtype=torch.float64), 0, warp(p), uncut(p), warp(q), uncut(q), [],
                      p32=code.warp(torch.stack([p, p]))[0], q32=code.warp(q[None])[0])


# ---- exact distributions --------------------------------------------------------------------

@dataclass
class SecondStep:
    """What token 2's distribution under any fault depends on, given token 1 (double, [V])."""
    p1: torch.Tensor        # the target's warped distribution of token 1
    t1: int
    p: torch.Tensor         # the target's warped distribution of token 2 given token 1
    p_uncut: torch.Tensor   # the same before top-p
    q: torch.Tensor         # the drafter's warped distribution of block slot 1 / DDTree depth 0
    q_uncut: torch.Tensor   # the same before top-p
    children: list[int]     # DDTree: the tree's children of the root, best first
    p32: torch.Tensor | None = None   # the slot test: p and q exactly as the code computes them (float32),
    q32: torch.Tensor | None = None   # for the un-clamped residual, whose outcome is their rounding's


def _interval_mass(cdf_lo: torch.Tensor, cdf_hi: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """Per token y, the length of [cdf_lo[y], cdf_hi[y]) inside [lo, hi): the chance that a
    uniform on [lo, hi) (scaled by its length) lands in token y's interval."""
    return (torch.minimum(cdf_hi, torch.tensor(hi, dtype=cdf_hi.dtype))
            - torch.maximum(cdf_lo, torch.tensor(lo, dtype=cdf_lo.dtype))).clamp_min(0)


def _cdf(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lower, upper) of each token's interval in the normalised cumulative distribution, in token
    order: inverse transform sampling draws y when lower[y] <= u < upper[y]."""
    upper = weights.cumsum(-1) / weights.sum()
    return upper - weights / weights.sum(), upper


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = (p - q).clamp_min(0)
    return r if float(r.sum()) > 0 else p


def second_token(fault: str | None, s: SecondStep) -> torch.Tensor:
    """The exact distribution of token 2 given token 1 under `fault` (None: the clean code, p)."""
    p, q = s.p, s.q
    overlap = torch.minimum(p, q)                      # accepted drafts: q(x) min(1, p(x)/q(x))
    rejected = 1 - float(overlap.sum())
    r = _residual(p, q)
    if fault is None:
        return p
    if fault == "every draft accepted":
        return q
    if fault == "residual from p":
        return overlap + rejected * p
    if fault == "residual un-clamped":
        if s.p32 is None:
            raise ValueError("the un-clamped residual's outcome needs the code's own float32 p and q")
        return overlap + rejected * _unclamped_outcome(s.p32, s.q32)
    if fault == "residual not renormalised":
        # The draw runs off the end of weights of total s with chance 1 - s: the last token.
        unscaled = r.clone()
        unscaled[-1] += max(0.0, 1 - float(r.sum()))
        return overlap + rejected * unscaled
    if fault == "residual with the acceptance number":
        # A draft x is rejected when its number u >= a = p(x)/q(x); the residual is then drawn with
        # that same u, uniform on [a, 1): token y's share is its interval's overlap with [a, 1).
        lower, upper = _cdf(r)
        out = overlap.clone()
        for x in (q > p).nonzero()[:, 0].tolist():
            out += float(q[x]) * _interval_mass(lower, upper, float(p[x] / q[x]), 1.0)
        return out
    if fault == "draft drawn before top-p":
        # Drafts come from q before top-p; the rule reads q after it: where that q is 0 the test
        # u * 0 < p(x) accepts exactly when p(x) > 0.
        accept = torch.where(q > 0, torch.minimum(torch.ones_like(p), p / q.clamp_min(1e-300)), (p > 0).double())
        kept = s.q_uncut * accept
        return kept + (1 - float(kept.sum())) * r / r.sum()
    if fault == "best child on a miss":
        if not s.children:
            return p
        out = torch.zeros_like(p)                      # a draw outside the children is never emitted
        out[s.children] = p[s.children]
        out[s.children[0]] += 1 - float(p[s.children].sum())
        return out
    if fault == "miss redrawn from p":
        missed = 1 - float(p[s.children].sum()) if s.children else 1.0
        out = missed * p
        if s.children:
            out[s.children] += p[s.children]
        return out
    if fault == "depth keyed one early":
        # Token 2 is drawn with the number token 1 was drawn with: uniform on token 1's interval of
        # p1's cumulative distribution.
        lo1, hi1 = _cdf(s.p1)
        lo, hi = float(lo1[s.t1]), float(hi1[s.t1])
        lower, upper = _cdf(p)
        return _interval_mass(lower, upper, lo, hi) / (hi - lo)
    if fault == "target drawn before top-p":
        return s.p_uncut
    raise ValueError(f"unknown fault {fault!r}")


def _unclamped_outcome(p32: torch.Tensor, q32: torch.Tensor, grid: int = 4096) -> torch.Tensor:
    """What the rule's draw makes of the weights p - q (not a distribution: they sum to 0 up to
    rounding), from the float32 p and q the code itself holds: where their difference sums to <= 0
    the rule falls back to p; else inverse transform sampling searches a cumulative sum that is not
    monotone, and the token it lands on is read off a grid of numbers (it barely depends on u: the
    search value is u times a total of about 1e-8)."""
    r = p32 - q32
    if not float(r.sum()) > 0:
        return p32.double()
    cdf = r.double().cumsum(-1)
    us = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    index = torch.searchsorted(cdf, cdf[-1] * us, right=True).clamp_max(len(r) - 1)
    return torch.bincount(index, minlength=len(r)).double() / grid


@torch.no_grad()
def second_steps(model, prompt: list[int], setting: dict, drafter: CloseDrafter, budget: int | None = None,
                 top_k: int = 8) -> list[SecondStep]:
    """One `SecondStep` for every token 1 the target can draw (p1 > 0): the target's plain
    forwards and the drafter's logits, warped by transformers' warpers at `setting`
    (temperature, top_p, top_k). `budget`: the DDTree's node budget (its children of the root are
    the tree's, built from the drafter's warped q with `top_k` children per depth)."""
    warp = reference_warp(**setting)
    uncut = reference_warp(setting["temperature"], top_k=setting.get("top_k", 0))
    p1 = warp(model(input_ids=torch.tensor([prompt])).logits[0, -1])
    firsts = p1.nonzero()[:, 0].tolist()
    logits = model(input_ids=torch.tensor([prompt + [t] for t in firsts])).logits[:, -1]
    steps = []
    for t1, row in zip(firsts, logits):
        q_logits = drafter.logits(t1)
        children = []
        if budget is not None:
            tree = build_tree(torch.log(warp(q_logits)).float(), budget, top_k)
            children = list(tree.children.get(-1, {}))
        steps.append(SecondStep(p1, t1, warp(row), uncut(row), warp(q_logits[0]), uncut(q_logits[0]), children))
    return steps


def first_two(steps: list[SecondStep], fault: str | None) -> dict[tuple[int, int], float]:
    """{(token 1, token 2): probability} under `fault`, every pair of probability > 0."""
    out = {}
    for s in steps:
        dist = second_token(fault, s)
        w = float(s.p1[s.t1])
        for t2 in (dist > 0).nonzero()[:, 0].tolist():
            out[(s.t1, t2)] = w * float(dist[t2])
    return out


def acceptance(steps: list[SecondStep], tree: bool = False) -> float:
    """The chance that the first verify step accepts a draft: block slot 1, sum over token 1 of p1
    * sum min(p, q); DDTree (`tree`), of p1 * p(the children of the root)."""
    return sum(float(s.p1[s.t1]) * float(s.p[s.children].sum() if tree else torch.minimum(s.p, s.q).sum())
               for s in steps)


def total_variation(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def powered_prompt(prompts: list[list[int]]) -> list[int]:
    """The end-to-end tests' prompt from the held-out prompts (`read_prompts` ids, in order)."""
    index, keep = POWERED_PROMPT
    return prompts[index][:keep]


def distributions(test: str, model=None, prompt: list[int] | None = None) -> tuple[dict, dict[str, dict], float]:
    """(exact, {fault: its distribution}, slot 1's acceptance) for `test`: "block" and "ddtree"
    over the first two generated tokens after `prompt` (the close drafter, POWERED_SETTING),
    "slot" over the slot test's one token (keyed (0, token))."""
    if test == "slot":
        steps = [slot_step()]
    else:
        drafter = CloseDrafter(model, prompt, 1, DRAFT_NOISE)
        steps = second_steps(model, prompt, POWERED_SETTING, drafter,
                             budget=TREE_BUDGET if test == "ddtree" else None, top_k=TREE_BUDGET)
    faults = {"block": BLOCK_FAULTS, "ddtree": TREE_FAULTS, "slot": SLOT_FAULTS}[test]
    return first_two(steps, None), {f: first_two(steps, f) for f in faults}, acceptance(steps, test == "ddtree")
