"""Regenerating a shard's rows: each assistant turn in order, the later ones conditioned on the
regenerated earlier ones (or only the last), a row dropped when a turn does not finish; and the
check every row passes before any generation."""

from __future__ import annotations

import hashlib

from pipeline.config import ExtractConfig
from pipeline.data.loss_mask import ConversationMasker
from pipeline.errors import PipelineError
from pipeline.generate.turns import Turn


def turn_seed(seed: int, sample_id: int, turn: int) -> int:
    """A sequence's own seed: its tokens never depend on the batch it shares."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{sample_id}:{turn}".encode()).digest()[:8], "little") >> 1


def regenerate_rows(rows, backend, *, turns: str, seed: int, generated_by: dict) -> tuple[list[dict], dict]:
    """The shard's output rows and its counts."""
    convs = [list(r.messages) for r in rows]
    where = [[i for i, m in enumerate(c) if m["role"] == "assistant"] for c in convs]
    if turns == "last":
        where = [w[-1:] for w in where]
    alive = [True] * len(rows)
    counts = {"rows": len(rows), "turns_written": 0, "dropped_unfinished": 0, "kept_verbatim": 0, "tokens": 0}
    problems: dict[str, int] = {}
    for t in range(max((len(w) for w in where), default=0)):
        pending = [k for k in range(len(rows)) if alive[k] and t < len(where[k])]
        written = backend.write([Turn(convs[k][:where[k][t]], rows[k].tools, rows[k].template_kwargs,
                                      turn_seed(seed, rows[k].sample_id, t)) for k in pending],
                                [f"{rows[k].where} (assistant turn {t + 1})" for k in pending])
        for k, w in zip(pending, written):
            counts["tokens"] += w.tokens
            if w.message is None:
                alive[k] = False
                counts["dropped_unfinished"] += 1
                continue
            convs[k][where[k][t]] = w.message
            counts["turns_written"] += 1
            if w.problem:
                counts["kept_verbatim"] += 1
                problems[w.problem] = problems.get(w.problem, 0) + 1
    out = []
    for row, conv, ok in zip(rows, convs, alive):
        if not ok:
            continue
        item = {**({"id": row.row_id} if row.row_id is not None else {}), "messages": conv}
        if row.tools:
            item["tools"] = row.tools
        if row.template_kwargs:
            item["chat_template_kwargs"] = row.template_kwargs
        item["generated_by"] = generated_by
        out.append(item)
    return out, {**counts, "verbatim_reasons": problems}


def row_check(tokenizer, turns: str):
    """What a row must pass before generation: a conversation (not pre-tokenized) and, with the
    target's tokenizer, extract's own check plus a renderable prompt for every turn to write."""
    masker = ConversationMasker(tokenizer, ExtractConfig.end_of_turn, reasoning="keep") if tokenizer is not None else None

    def check(row) -> None:
        if row.messages is None:
            raise PipelineError(f"{row.where}: a pre-tokenized row (input_ids) has no conversation to regenerate")
        if masker is not None:
            masker.validate(row, prompts=turns)
    return check
