"""Sampled decoding and lossless speculative sampling (`pipeline eval --temperature T`).

Distributions: the target's p and the drafter's q are both warped by the one warp of
pipeline/sampler.py (logits / temperature, then top-k, then top-p, renormalised: the serving
engines' order), the warp `pipeline generate` samples from too.

Block drafts (one drafter pass gives q_k for every slot k, none conditioned on the other draft
tokens): draft token x_k ~ q_k; the target accepts it with probability min(1, p_k(x_k)/q_k(x_k)),
else emits a token drawn from the normalised residual max(0, p_k - q_k) and the step ends; when
every draft is accepted, the bonus token is drawn from the target's next p (Leviathan et al.
2023, Chen et al. 2023). Each emitted token is distributed as p given the tokens before it,
whatever q is, so the output is distributed as plain sampling's.

DDTree (a draft tree of the drafter's top-K tokens per depth, deterministic given q): recursive
rejection sampling over a node's children with one-hot drafts (SpecInfer's multi-step
speculative sampling, Miao et al. 2024, with each child's draft distribution a point mass):
child c_1 is accepted with probability p(c_1), else the residual is p without c_1, renormalised,
and c_2 is tried against it, and so on; when no child is accepted the token is drawn from the
last residual. That is exactly drawing y ~ p and following the child equal to y (emitting y
when none is): what `tree_choice` does, one draw per depth.

Randomness is keyed, not streamed (pipeline/sampler.py `uniform`): every number is a hash of
(seed, prompt index, sequence position, purpose), so a prompt decodes the same tokens alone or in
a batch of any size, in any order. A position's purposes (the draft, the acceptance test, the
residual draw, a draw from p) use independent numbers; a draft redrawn at a position a rejection
left undecided reuses its number, which no emitted token depended on.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from pipeline.sampler import Sampler, draw, draw_rows, uniform

TARGET, DRAFT, ACCEPT, RESIDUAL = 0, 1, 2, 3


class LosslessRule:
    """The acceptance test and the residual of speculative sampling. Tests plant faults by
    overriding one of the two and check that the distribution test catches them."""

    def accepts(self, p_x: float, q_x: float, u: float) -> bool:
        return u * q_x < p_x      # u < min(1, p/q) without dividing

    def residual(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        r = (p - q).clamp_min(0)
        # All zero only when p == q up to rounding, where rejection has probability 0: draw from p.
        # Chosen on the device: no read back to the host.
        return torch.where(r.sum() > 0, r, p)


@dataclass(frozen=True)
class SpeculativeSampler(Sampler):
    """eval's sampler: the one sampler's warp and keyed draw (pipeline/sampler.py), its numbers
    keyed by `seed`, and speculative sampling's rule."""
    seed: int = 0
    rule: LosslessRule = field(default_factory=LosslessRule, compare=False)

    def record(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "rule": "speculative sampling: accept min(1, p/q), else the residual max(0, p - q); "
                        "DDTree: recursive rejection over deterministic children (draw from p, follow the match)",
                "randomness": "keyed by (seed, prompt index, position, purpose): batch-size independent"}

    def u(self, row: int, position: int, purpose: int) -> float:
        return uniform(self.seed, row, position, purpose)

    def pick(self, row: int, position: int, logits: torch.Tensor) -> int:
        """The token at `position` drawn from the target's warped distribution (plain sampling;
        a bonus token; a DDTree depth)."""
        return draw(self.warp(logits), self.u(row, position, TARGET))

    def draft_chain(self, row: int, pos: int, logits_DV: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """(draft tokens for positions pos+1.., the drafter's warped q [D, V]) from its block logits."""
        q = self.warp(logits_DV)
        return draw_rows(q, [self.u(row, pos + 1 + k, DRAFT) for k in range(q.shape[0])]), q

    def accept_chain(self, row: int, pos: int, drafts: list[int], q: torch.Tensor,
                     target_logits: torch.Tensor) -> tuple[int, int]:
        """(accepted drafts n, the token emitted after them). target_logits[k] is the target's
        for position pos+1+k given the bonus and drafts[:k] (k = 0..len(drafts))."""
        p = self.warp(target_logits[:len(drafts) + 1])
        # p(x_k) and q(x_k) of every draft in one read back to the host (not two per draft).
        slots = torch.arange(len(drafts), device=p.device)
        x = torch.tensor(drafts, dtype=torch.long, device=p.device)
        p_x, q_x = torch.stack([p[slots, x], q[slots, x].to(p.dtype)]).tolist() if drafts else ([], [])
        for k in range(len(drafts)):
            position = pos + 1 + k
            if not self.rule.accepts(p_x[k], q_x[k], self.u(row, position, ACCEPT)):
                return k, draw(self.rule.residual(p[k], q[k]), self.u(row, position, RESIDUAL))
        n = len(drafts)
        return n, draw(p[n], self.u(row, pos + 1 + n, TARGET))

    def tree_logprobs(self, logits_DV: torch.Tensor) -> torch.Tensor:
        """log q for building the draft tree: the drafter's distribution at the same settings
        (tokens that top-k / top-p remove are -inf and never become nodes)."""
        return torch.log(self.warp(logits_DV))


def target_tokens(logits_NV: torch.Tensor, keys: Iterable[tuple[int, int]], sampling: SpeculativeSampler | None) -> list[int]:
    """The target's token from each row of logits, row n's at keys[n] = (prompt index, position):
    the argmax, or a keyed draw from p; every row's in one read back to the host. `keys` is read
    only when sampling: callers pass a generator, so greedy decoding builds no keys."""
    if sampling is None:
        return logits_NV.argmax(-1).tolist()
    return sampling.draw_keyed(logits_NV, [sampling.u(row, position, TARGET) for row, position in keys])
