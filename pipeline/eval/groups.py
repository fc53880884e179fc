"""eval's tau per group of prompts: by kind of turn, always, and by a row field (`--group-by`).

The flagship thinks and calls tools, and a drafter's acceptance differs between a reasoning
block, a plain answer and a JSON tool call: one tau over all of them hides which one a drafter
(or a data mix) serves badly. The kind of a generated turn is read from tokens, with the chat
template's own markers:
- tool_call: the target's greedy output opens a `<tool_call>`;
- thinking: the prompt leaves a `<think>` block open for the answer (the generation prompt of
  thinking mode, `<|im_start|>assistant\\n<think>\\n`), or the output opens one itself;
- non_thinking: anything else (thinking off renders an empty, closed `<think></think>` block).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.records.eval_result import Variant, nest
from pipeline.eval.speculative_decoding import Decoded
from pipeline.eval.summary import tau_figures

KINDS = ("thinking", "non_thinking", "tool_call")
MISSING = "(none)"  # the group of rows without the --group-by field


@dataclass(frozen=True)
class TurnMarkers:
    """Token ids of the template's markers; None where the tokenizer has no such single token."""
    im_start: int | None
    think: int | None
    think_end: int | None
    tool_call: int | None

    @classmethod
    def of(cls, tokenizer) -> TurnMarkers:
        def single(text: str) -> int | None:
            token = tokenizer.convert_tokens_to_ids(text)
            return token if isinstance(token, int) and token != tokenizer.unk_token_id else None
        return cls(single("<|im_start|>"), single("<think>"), single("</think>"), single("<tool_call>"))


def _last(ids: list[int], token: int | None) -> int:
    return max((i for i, t in enumerate(ids) if t == token), default=-1) if token is not None else -1


def turn_kind(prompt: list[int], output: list[int], markers: TurnMarkers) -> str:
    if markers.tool_call is not None and markers.tool_call in output:
        return "tool_call"
    opened = _last(prompt, markers.think)
    if opened > _last(prompt, markers.im_start) and opened > _last(prompt, markers.think_end):
        return "thinking"
    if markers.think is not None and markers.think in output:
        return "thinking"
    return "non_thinking"


def _group(indices: list[int], runs: dict[Variant, list[Decoded]]) -> dict:
    return {"prompts": len(indices), **nest({v: tau_figures([results[i] for i in indices]) for v, results in runs.items()})}


def by_kind(prompts: list[list[int]], reference: list[Decoded], runs: dict[Variant, list[Decoded]],
            markers: TurnMarkers) -> dict:
    """{kind: {prompts, block: tau figures, tree: {budget: tau figures}}} for the kinds present
    (each variant where eval's JSON puts it: pipeline/records/eval_result.py)."""
    kinds = [turn_kind(p, g.tokens, markers) for p, g in zip(prompts, reference)]
    return {k: _group([i for i, x in enumerate(kinds) if x == k], runs) for k in KINDS if k in kinds}


def by_field(field: str, values: list[dict], runs: dict[Variant, list[Decoded]]) -> dict:
    """{"field": field, "groups": {value: the same figures}}; rows without it form MISSING."""
    keys = [str(v[field]) if field in v else MISSING for v in values]
    return {"field": field, "groups": {k: _group([i for i, x in enumerate(keys) if x == k], runs)
                                       for k in sorted(set(keys))}}
