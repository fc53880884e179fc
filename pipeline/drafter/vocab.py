"""A draft vocabulary (DESIGN 3.4): the drafter drafts from K of the target's V tokens.

The head is the K corresponding rows of the target's lm_head (frozen, as the full head is); a
draft id j stands for the target id `ids[j]`, the ids sorted ascending. Two spellings of that map
travel with an export, as EAGLE-3 drafters, speculators and vLLM's DFlash model read them:
`d2t` [K] int64, an offset per draft id (target id = j + d2t[j]), and `t2d` [V] bool, which
target ids are in the vocabulary. Draft logits go back into the target's vocabulary as vLLM's
`compute_logits` does: scattered into a row of -inf, so greedy and sampled decoding, DDTree's
top-k and speculative sampling read them unchanged (the drafter's q is zero outside the
vocabulary, which speculative sampling already allows: lossless either way).

Without a draft vocabulary nothing here runs: the head is the target's own lm_head module.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import PipelineError


class DraftVocab:
    """The K target ids a drafter drafts from (sorted, distinct, inside [0, V))."""

    def __init__(self, ids, target_size: int):
        ids = torch.as_tensor(ids, dtype=torch.long).flatten().cpu()
        if len(ids) == 0:
            raise PipelineError("draft vocabulary: no token")
        if not bool((ids[1:] > ids[:-1]).all()):
            raise PipelineError("draft vocabulary: ids must be sorted and distinct")
        if int(ids[0]) < 0 or int(ids[-1]) >= target_size:
            raise PipelineError(f"draft vocabulary: ids must lie in [0, {target_size}), got {int(ids[0])}..{int(ids[-1])}")
        self.ids, self.target_size = ids, int(target_size)
        self._t2d = torch.full((self.target_size,), -1, dtype=torch.long)
        self._t2d[ids] = torch.arange(len(ids))

    @property
    def size(self) -> int:
        return len(self.ids)

    def d2t(self) -> torch.Tensor:
        """[K] int64 offsets: target id = draft id + d2t[draft id] (speculators' and vLLM's format)."""
        return self.ids - torch.arange(self.size)

    def t2d(self) -> torch.Tensor:
        """[V] bool: which target ids are in the vocabulary."""
        return self._t2d >= 0

    @classmethod
    def from_d2t(cls, d2t: torch.Tensor, target_size: int) -> "DraftVocab":
        return cls(d2t.long() + torch.arange(len(d2t)), target_size)

    def to_draft(self, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft ids, inside): each target id's draft id (0 where it is outside), and whether it is inside."""
        draft = self._t2d.to(target_ids.device)[target_ids.long()]
        inside = draft >= 0
        return draft.clamp_min(0), inside

    def digest(self) -> str:
        """sha256 of the ids (int64 little-endian): the vocabulary's identity in run.json."""
        return hashlib.sha256(self.ids.numpy().astype("<i8").tobytes()).hexdigest()

    def __eq__(self, other) -> bool:
        return (isinstance(other, DraftVocab) and self.target_size == other.target_size
                and torch.equal(self.ids, other.ids))

    def __repr__(self) -> str:
        return f"DraftVocab({self.size} of {self.target_size})"


class DraftHead(nn.Module):
    """The K rows of the target's lm_head (a frozen copy) and where they go in its vocabulary."""

    def __init__(self, lm_head: nn.Linear, vocab: DraftVocab):
        super().__init__()
        weight = lm_head.weight
        if weight.shape[0] != vocab.target_size:
            raise PipelineError(f"draft vocabulary: chosen for a {vocab.target_size}-token vocabulary, "
                                f"the target's lm_head has {weight.shape[0]} rows")
        self.weight = nn.Parameter(weight.detach()[vocab.ids.to(weight.device)].clone(), requires_grad=False)
        self.vocab = vocab
        self.register_buffer("target_ids", vocab.ids.to(weight.device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., K]."""
        return F.linear(x, self.weight)

    def to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., K] as target-vocabulary logits [..., V]: -inf outside the vocabulary."""
        out = logits.new_full((*logits.shape[:-1], self.vocab.target_size), float("-inf"))
        out.index_copy_(-1, self.target_ids, logits)
        return out
