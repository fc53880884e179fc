"""Read training conversations: JSONL or Parquet; OpenAI `messages`, ShareGPT `conversations`, or
pre-tokenized `input_ids` + `loss_mask`.

Rows are numbered across the given files in order (blank JSONL lines are not rows); that number
is the stable `sample_id`. Every problem names the file and line (or Parquet row) and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from pipeline.errors import PipelineError

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True, kw_only=True)
class Row:
    sample_id: int
    where: str                      # "file:line" for messages
    messages: list[dict] | None = None
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None


def _parquet_rows(path: Path) -> Iterator[tuple[str, object]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PipelineError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001
        raise PipelineError(f"{path}: not a readable Parquet file ({e})") from None
    row = 0
    for batch in table.iter_batches(batch_size=1024):
        for obj in batch.to_pylist():
            yield f"{path}:row {row}", obj
            row += 1


def _jsonl_lines(path: Path, offset: int = 0, line_no: int = 1) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset, raw bytes) of each non-blank line, from `offset` on."""
    with open(path, "rb") as f:
        f.seek(offset)
        for raw in f:
            if raw.strip():
                yield line_no, offset, raw
            offset += len(raw)
            line_no += 1


def _decode(where: str, raw: bytes):
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return PipelineError(f"{where}: not valid UTF-8 (byte {e.start})")
    except json.JSONDecodeError as e:
        return PipelineError(f"{where}: malformed JSON ({e.msg} at column {e.colno})")


@dataclass(frozen=True, kw_only=True)
class RowIndex:
    """Where each row starts, so a shard's rows are read without parsing the whole dataset.
    Per file: row count, and for JSONL the (line number, byte offset) of every row."""
    counts: list[int]
    lines: list[np.ndarray | None]
    offsets: list[np.ndarray | None]


def index_rows(paths: list[Path], on_error: str = "fail") -> tuple[RowIndex, int]:
    """One validating pass over the dataset: (index, number of malformed rows). With
    on_error='fail' the first bad row raises its PipelineError."""
    counts, lines, offsets, malformed, sample_id = [], [], [], 0, 0
    for path in paths:
        if not path.is_file():
            raise PipelineError(f"{path}: dataset file not found")
        if path.suffix == ".parquet":
            items = ((where, obj, None, None) for where, obj in _parquet_rows(path))
        else:
            items = ((f"{path}:{n}", _decode(f"{path}:{n}", raw), n, off) for n, off, raw in _jsonl_lines(path))
        file_lines, file_offsets, count = [], [], 0
        for where, obj, n, off in items:
            try:
                parse_row(sample_id, where, obj)
            except PipelineError:
                if on_error != "skip":
                    raise
                malformed += 1
            file_lines.append(n)
            file_offsets.append(off)
            count += 1
            sample_id += 1
        counts.append(count)
        jsonl = path.suffix != ".parquet"
        lines.append(np.asarray(file_lines, dtype=np.int64) if jsonl else None)
        offsets.append(np.asarray(file_offsets, dtype=np.int64) if jsonl else None)
    return RowIndex(counts=counts, lines=lines, offsets=offsets), malformed


def parse_row(sample_id: int, where: str, obj) -> Row:
    if isinstance(obj, Exception):
        raise obj
    if not isinstance(obj, dict):
        raise PipelineError(f"{where}: a row must be a JSON object, got {type(obj).__name__}")
    if "input_ids" in obj or "loss_mask" in obj:
        ids, mask = obj.get("input_ids"), obj.get("loss_mask")
        if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise PipelineError(f"{where}: field 'input_ids' must be a list of non-negative integers")
        if not isinstance(mask, list) or len(mask) != len(ids) or not all(m in (0, 1) for m in mask):
            raise PipelineError(f"{where}: field 'loss_mask' must be a list of 0/1 as long as 'input_ids'")
        return Row(sample_id=sample_id, where=where, input_ids=ids, loss_mask=[int(m) for m in mask])
    if "messages" in obj:
        turns = obj["messages"]
        role_key, content_key, roles = "role", "content", {r: r for r in ROLES}
        field = "messages"
    elif "conversations" in obj:
        turns = obj["conversations"]
        role_key, content_key, roles = "from", "value", SHAREGPT_ROLES
        field = "conversations"
    else:
        raise PipelineError(f"{where}: row has none of 'messages', 'conversations', 'input_ids'")
    if not isinstance(turns, list) or not turns:
        raise PipelineError(f"{where}: field '{field}' must be a non-empty list")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise PipelineError(f"{where}: {field}[{i}] must be an object")
        role = turn.get(role_key)
        if role not in roles:
            raise PipelineError(f"{where}: {field}[{i}].{role_key} is {role!r}; expected one of {sorted(roles)}")
        content = turn.get(content_key)
        if not isinstance(content, str):
            raise PipelineError(f"{where}: {field}[{i}].{content_key} must be a string, got {type(content).__name__}")
        messages.append({"role": roles[role], "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise PipelineError(f"{where}: field '{field}' has no assistant turn, so nothing to learn from")
    return Row(sample_id=sample_id, where=where, messages=messages)


def iter_rows(paths: list[Path], *, on_error: str = "fail", wanted: range | set[int] | None = None,
              index: RowIndex | None = None) -> Iterator[Row | PipelineError]:
    """Rows in order with global sample ids, only those in `wanted` (all if None). With
    on_error='skip' a bad row is yielded as its PipelineError (so the caller can count it);
    with 'fail' it is raised. With an index, JSONL files are entered at the first wanted row
    and files outside `wanted` are not opened."""
    if wanted is not None and not wanted:
        return
    lo, hi = ((wanted.start, wanted.stop) if isinstance(wanted, range) else (min(wanted), max(wanted) + 1)) \
        if wanted is not None else (0, None)
    base = 0
    for i, path in enumerate(paths):
        if not path.is_file():
            raise PipelineError(f"{path}: dataset file not found")
        count = index.counts[i] if index is not None else None
        if count is not None and (base + count <= lo or (hi is not None and base >= hi)):
            base += count
            continue
        if path.suffix == ".parquet":
            items = ((base + k, where, lambda obj=obj: obj) for k, (where, obj) in enumerate(_parquet_rows(path)))
        else:
            first = max(0, lo - base) if index is not None else 0
            start = (int(index.offsets[i][first]), int(index.lines[i][first])) if first else (0, 1)
            items = ((base + first + k, f"{path}:{n}", lambda raw=raw, where=f"{path}:{n}": _decode(where, raw))
                     for k, (n, _, raw) in enumerate(_jsonl_lines(path, *start)))
        seen = 0
        for sample_id, where, load in items:
            seen = sample_id - base + 1
            if hi is not None and sample_id >= hi:
                return  # every later row has a larger id
            if wanted is not None and sample_id not in wanted:
                continue
            try:
                yield parse_row(sample_id, where, load())
            except PipelineError as e:
                if on_error != "skip":
                    raise
                yield e
        base += count if count is not None else seen
