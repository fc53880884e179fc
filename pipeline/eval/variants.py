"""How each decoding variant of `pipeline eval` decodes a batch of prompts (the variants, their
names and their place in eval's results: pipeline/records/eval_result.py)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.records.eval_result import Variant
from pipeline.eval.batched import decode_rows
from pipeline.eval.speculative_decoding import Decoded, block_decode, greedy, greedy_rows, tree_decode
from pipeline.eval.speculative_sampling import SpeculativeSampler


@dataclass(frozen=True)
class Settings:
    """What every variant decodes with (eval's options)."""
    max_new: int
    eos: set[int]
    sampling: SpeculativeSampler | None     # None: greedy
    batch_size: int = 1
    tree_top_k: int = 8
    tree_verify: str = "tree"


def reference(live, prompts: list[list[int]], row_ids: list[int], s: Settings) -> list[Decoded]:
    """Plain decoding of a batch (greedy, or plain sampling): the lossless reference and the speed
    baseline. With batch_size > 1 the prompts decode together as the variants' do, so a speedup
    compares like with like (one prompt a pass against eight would credit batching to drafting)."""
    if s.batch_size > 1:
        return greedy_rows(live, prompts, max_new=s.max_new, eos=s.eos, sampling=s.sampling, row_ids=row_ids)
    return [greedy(live, prompts[0], max_new=s.max_new, eos=s.eos, sampling=s.sampling, row=row_ids[0])]


def _block(live, drafter, prompts: list[list[int]], row_ids: list[int], s: Settings, _param) -> list[Decoded]:
    if s.batch_size > 1:
        return decode_rows(live, drafter, prompts, max_new=s.max_new, eos=s.eos, sampling=s.sampling, row_ids=row_ids)
    return [block_decode(live, drafter, prompts[0], max_new=s.max_new, eos=s.eos, sampling=s.sampling, row=row_ids[0])]


def _tree(live, drafter, prompts: list[list[int]], row_ids: list[int], s: Settings, budget: int) -> list[Decoded]:
    if s.batch_size > 1:  # one tree pass over every prompt's nodes
        return decode_rows(live, drafter, prompts, max_new=s.max_new, eos=s.eos, budget=budget, top_k=s.tree_top_k,
                           sampling=s.sampling, row_ids=row_ids)
    return [tree_decode(live, drafter, prompts[0], max_new=s.max_new, eos=s.eos, budget=budget, top_k=s.tree_top_k,
                        verify=s.tree_verify, sampling=s.sampling, row=row_ids[0])]


DECODERS = {"block": _block, "tree": _tree}  # by Kind.key


def decode(variant: Variant, live, drafter, prompts: list[list[int]], row_ids: list[int],
           settings: Settings) -> list[Decoded]:
    """One Decoded per prompt of the batch."""
    return DECODERS[variant.kind.key](live, drafter, prompts, row_ids, settings, variant.param)
