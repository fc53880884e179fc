"""Rows -> training samples, the one rule extract writes by and verify-cache re-derives by: a
conversation rendered with the chat template and masked (pipeline/data/loss_mask.py), or a
pre-tokenized row's own ids and mask; then the length policy (--overlong), rows without a
supervised token dropped, and what the shard's rows carried counted."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.config import ExtractConfig
from pipeline.data.conversations import Row, index_rows, iter_rows
from pipeline.data.loss_mask import REASONING, TOOL_CALL, ConversationMasker, Tokenized
from pipeline.errors import PipelineError
from pipeline.provenance import file_records
from pipeline.target_model import reserved_token_ids


def row_tokens(row: Row, masker: ConversationMasker) -> tuple[list[int], list[int], Tokenized | None]:
    """(input_ids, loss_mask, the masker's result or None for a pre-tokenized row), before any
    length policy. A conversation the template or the masker refuses raises PipelineError."""
    if row.messages is None:
        return row.input_ids, row.loss_mask, None
    tok = masker(row.messages, tools=row.tools, row_kwargs=row.template_kwargs, where=row.where)
    return tok.input_ids, tok.loss_mask, tok


def scan_dataset(paths: list[Path], on_error: str, masker: ConversationMasker) -> dict:
    """One validating pass over the dataset: row count, malformed rows (fail fast before any GPU
    work and before the manifest is written: every conversation is rendered with the chat
    template, ~0.03-0.3 ms a row), where each row starts (so each shard reads only its rows) and
    file digests, so the shard plan and the manifest's data identity are known up front."""
    index, malformed = index_rows(paths, on_error, masker.validate)
    num_rows = sum(index.counts)
    if num_rows == 0:
        raise PipelineError(f"{', '.join(map(str, paths))}: the dataset has no rows")
    return {"num_rows": num_rows, "malformed_rows": malformed, "files": file_records(paths), "index": index}


# Per-shard counts of what the rows carried and what got supervised (summed over shards in the summary).
CONTENT_COUNTS = ("rows_with_reasoning", "rows_with_tool_calls", "rows_with_tool_replies", "reasoning_turns_dropped",
                  "reasoning_turns_not_rendered", "supervised_tokens", "reasoning_tokens", "tool_call_tokens")
ROW_COUNTS = ("malformed", "no_supervised_tokens", "overlong_skipped", "truncated")


def prepare_samples(cfg: ExtractConfig, paths: list[Path], rows: range, masker: ConversationMasker, vocab_size: int,
                    index=None) -> tuple[list, dict]:
    """(samples [(sample_id, input_ids, loss_mask)], counts) for one shard's rows."""
    counts = {"rows": len(rows), **dict.fromkeys(ROW_COUNTS + CONTENT_COUNTS, 0), "generated_by": {}}

    def refuse(message: str) -> None:
        if cfg.on_error != "skip":
            raise PipelineError(message)
        counts["malformed"] += 1

    samples = []
    for item in iter_rows(paths, on_error=cfg.on_error, wanted=rows, index=index):
        if isinstance(item, PipelineError):
            counts["malformed"] += 1
            continue
        try:
            ids, mask, tok = row_tokens(item, masker)
        except PipelineError as e:
            refuse(str(e))
            continue
        if tok is None and max(ids, default=0) >= vocab_size:
            refuse(f"{item.where}: field 'input_ids' has id {max(ids)} >= vocab_size {vocab_size}")
            continue
        if len(ids) > cfg.max_length:
            if cfg.overlong == "error":
                raise PipelineError(f"{item.where}: {len(ids)} tokens, over max_length {cfg.max_length} "
                                    "(--overlong truncate or skip to accept such rows)")
            if cfg.overlong == "skip":
                counts["overlong_skipped"] += 1
                continue
            ids, mask = ids[:cfg.max_length], mask[:cfg.max_length]
            counts["truncated"] += 1
        if not any(mask):
            counts["no_supervised_tokens"] += 1
            continue
        if tok is not None:
            counts["rows_with_reasoning"] += bool(tok.stats["reasoning_turns"])
            counts["rows_with_tool_calls"] += bool(tok.stats["tool_call_turns"])
            counts["rows_with_tool_replies"] += bool(tok.stats["tool_replies"])
            counts["reasoning_turns_dropped"] += tok.stats["reasoning_turns_dropped"]
            counts["reasoning_turns_not_rendered"] += tok.stats["reasoning_turns_not_rendered"]
            kept = tok.kinds[:len(ids)]  # a truncated row counts only the tokens it keeps
            counts["reasoning_tokens"] += kept.count(REASONING)
            counts["tool_call_tokens"] += kept.count(TOOL_CALL)
        counts["supervised_tokens"] += sum(mask)
        source = item.generated_by or cfg.generated_by or "unknown"
        counts["generated_by"][source] = counts["generated_by"].get(source, 0) + 1
        samples.append((item.sample_id, ids, mask))
    counts["reasoning_share"] = counts["reasoning_tokens"] / counts["supervised_tokens"] if counts["supervised_tokens"] else None
    counts["special_ids"] = special_ids_seen(masker.tokenizer, samples)
    return samples, counts


def special_ids_seen(tokenizer, samples: list) -> list[int]:
    """Which reserved ids (special or added tokens, or past the tokenizer's vocabulary) occur in
    the shard's input_ids: train checks its mask id against this instead of reading every token."""
    if not samples:
        return []
    present = np.unique(np.concatenate([np.asarray(ids, dtype=np.int64) for _, ids, _ in samples]))
    reserved = reserved_token_ids(tokenizer)
    return [int(i) for i in present if int(i) in reserved or i >= len(tokenizer)]


def length_batches(samples: list, batch_tokens: int) -> list[list]:
    """Length-sorted batches whose padded size (count x longest) fits the token budget."""
    ordered = sorted(samples, key=lambda s: (len(s[1]), s[0]))
    batches, current = [], []
    for s in ordered:
        if current and (len(current) + 1) * len(s[1]) > batch_tokens:
            batches.append(current)
            current = []
        current.append(s)
    if current:
        batches.append(current)
    return batches
