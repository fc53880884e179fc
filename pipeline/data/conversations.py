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


def _raw_rows(path: Path) -> Iterator[tuple[str, object]]:
    """(location, parsed object or exception) for each row of one file."""
    if path.suffix == ".parquet":
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
        return
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                yield where, json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                yield where, PipelineError(f"{where}: not valid UTF-8 (byte {e.start})")
            except json.JSONDecodeError as e:
                yield where, PipelineError(f"{where}: malformed JSON ({e.msg} at column {e.colno})")


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
    return Row(sample_id=sample_id, where=where, messages=messages)


def iter_rows(paths: list[Path], *, on_error: str = "fail", wanted: range | None = None) -> Iterator[Row | PipelineError]:
    """Rows in order with global sample ids. With on_error='skip' a bad row is yielded as its
    PipelineError (so the caller can count it); with 'fail' it is raised. `wanted` limits which
    sample ids are parsed (the rest are only counted)."""
    sample_id = 0
    for path in paths:
        if not path.is_file():
            raise PipelineError(f"{path}: dataset file not found")
        for where, obj in _raw_rows(path):
            if wanted is None or sample_id in wanted:
                try:
                    yield parse_row(sample_id, where, obj)
                except PipelineError as e:
                    if on_error != "skip":
                        raise
                    yield e
            sample_id += 1
