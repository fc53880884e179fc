"""Read training conversations: JSONL or Parquet; OpenAI `messages`, ShareGPT `conversations`, or
pre-tokenized `input_ids` + `loss_mask`.

A message keeps every field a chat template reads (DESIGN 3.5): `reasoning_content` (or
`reasoning`), `tool_calls`, `tool` replies with `tool_call_id`/`name`, `content: null`, text parts;
a row keeps its `tools`, `chat_template_kwargs` and `generated_by`. Nothing is dropped silently:
a field in a shape we cannot pass on is an error naming the row.

Rows are numbered across the given files in order (blank JSONL lines are not rows); that number
is the stable `sample_id`. Every problem names the file and line (or Parquet row) and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from pipeline.errors import PipelineError

# ShareGPT speakers onto OpenAI roles. `function_call` is an assistant turn that calls a tool (its
# value is the call as JSON); `observation` is the tool's reply.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "function_call": "assistant", "observation": "tool", "tool": "tool"}
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True, kw_only=True)
class Row:
    sample_id: int
    where: str                      # "file:line" for messages
    messages: list[dict] | None = None
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    tools: list[dict] | None = None              # function schemas the template renders into the system turn
    template_kwargs: dict | None = None          # the row's own chat_template_kwargs, over the config's
    generated_by: str | None = None              # who wrote the responses, when the row says (DESIGN 3.7)
    row_id: str | int | None = None              # the row's own `id`, when it has one
    fields: dict | None = None                   # the row's other top-level scalars (a `category`, a `source`): eval --group-by


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
        return PipelineError(malformed_json(where, raw, e))


def malformed_json(where: str, raw: bytes, error: json.JSONDecodeError) -> str:
    """Where in its line a row's JSON breaks: the decoder's column within the line (a row cut short
    breaks at its end, which the decoder reports after the newline, as column 1 of the next line),
    and the line's first characters."""
    line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
    column = min(error.pos, len(line)) + 1
    cut = ", past the end of the line: the row looks cut short" if column > len(line) else ""
    start = line[:40] + ("..." if len(line) > 40 else "")
    return f"{where}: malformed JSON ({error.msg} at column {column} of {len(line)}{cut}); the line starts {start!r}"


@dataclass(frozen=True, kw_only=True)
class RowIndex:
    """Where each row starts, so a shard's rows are read without parsing the whole dataset.
    Per file: row count, and for JSONL the (line number, byte offset) of every row."""
    counts: list[int]
    lines: list[np.ndarray | None]
    offsets: list[np.ndarray | None]


def index_rows(paths: list[Path], on_error: str = "fail", check: Callable[[Row], object] | None = None,
               skipped: list[tuple[int, str]] | None = None) -> tuple[RowIndex, int]:
    """One validating pass over the dataset: (index, number of malformed rows). `check` (e.g.
    rendering with the chat template) may refuse a parsed row with a PipelineError. With
    on_error='fail' the first bad row raises its PipelineError; with 'skip' each is counted, and
    (sample id, message) appended to `skipped` when given."""
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
                row = parse_row(sample_id, where, obj)
                if check is not None:
                    check(row)
            except PipelineError as e:
                if on_error != "skip":
                    raise
                malformed += 1
                if skipped is not None:
                    skipped.append((sample_id, str(e)))
            file_lines.append(n)
            file_offsets.append(off)
            count += 1
            sample_id += 1
        counts.append(count)
        jsonl = path.suffix != ".parquet"
        lines.append(np.asarray(file_lines, dtype=np.int64) if jsonl else None)
        offsets.append(np.asarray(file_offsets, dtype=np.int64) if jsonl else None)
    return RowIndex(counts=counts, lines=lines, offsets=offsets), malformed


def parse_row(sample_id: int, where: str, obj, *, need_answer: bool = True) -> Row:
    """One row, normalised. `need_answer=False` (eval's prompt sets): a conversation with no
    assistant turn is a prompt, not an error."""
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
        turns, field, sharegpt = obj["messages"], "messages", False
    elif "conversations" in obj:
        turns, field, sharegpt = obj["conversations"], "conversations", True
    else:
        raise PipelineError(f"{where}: row has none of 'messages', 'conversations', 'input_ids'")
    if not isinstance(turns, list) or not turns:
        raise PipelineError(f"{where}: field '{field}' must be a non-empty list")
    messages = []
    for i, turn in enumerate(turns):
        at = f"{where}: {field}[{i}]"
        if not isinstance(turn, dict):
            raise PipelineError(f"{at} must be an object")
        messages.append(_sharegpt_message(at, turn) if sharegpt else _openai_message(at, turn))
    _check_tool_replies(where, field, messages)
    if need_answer and not any(m["role"] == "assistant" for m in messages):
        raise PipelineError(f"{where}: field '{field}' has no assistant turn, so nothing to learn from")
    return Row(sample_id=sample_id, where=where, messages=messages, tools=_tools(where, obj.get("tools")),
               template_kwargs=_template_kwargs(where, obj.get("chat_template_kwargs")),
               generated_by=_generated_by(where, obj.get("generated_by")),
               row_id=obj["id"] if isinstance(obj.get("id"), (str, int)) else None,
               fields={k: v for k, v in obj.items() if k not in _CONVERSATION_FIELDS and isinstance(v, (str, int, float, bool))}
               or None)


# The fields a conversation row is read from; any other top-level scalar is the row's own label.
_CONVERSATION_FIELDS = ("messages", "conversations", "tools", "chat_template_kwargs", "generated_by")


def _openai_message(at: str, turn: dict) -> dict:
    """One message as the chat template reads it: every field it renders kept, normalised so that
    all Qwen3.x templates accept it (tool-call arguments as objects, text parts joined)."""
    role = turn.get("role")
    if role not in ROLES:
        raise PipelineError(f"{at}.role is {role!r}; expected one of {sorted(ROLES)}")
    message = {"role": role, "content": _content(at, turn.get("content"), nullable=role == "assistant")}
    if role == "assistant":
        reasoning = _reasoning(at, turn)
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if turn.get("tool_calls") is not None:
            message["tool_calls"] = _tool_calls(at, turn["tool_calls"])
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if turn.get(key) is not None:
                if not isinstance(turn[key], str):
                    raise PipelineError(f"{at}.{key} must be a string, got {type(turn[key]).__name__}")
                message[key] = turn[key]
    return message


def _sharegpt_message(at: str, turn: dict) -> dict:
    speaker = turn.get("from")
    if speaker not in SHAREGPT_ROLES:
        raise PipelineError(f"{at}.from is {speaker!r}; expected one of {sorted(SHAREGPT_ROLES)}")
    role, value = SHAREGPT_ROLES[speaker], turn.get("value")
    if speaker == "function_call":
        # LLaMA-Factory's convention: the value is the call, {"name": ..., "arguments": ...}.
        call = _json_value(f"{at}.value", value) if isinstance(value, str) else value
        return {"role": "assistant", "content": None, "tool_calls": _tool_calls(f"{at}.value", [call])}
    if not isinstance(value, str):
        raise PipelineError(f"{at}.value must be a string, got {type(value).__name__}")
    message = {"role": role, "content": value}
    if role == "assistant":
        reasoning = _reasoning(at, turn)
        if reasoning is not None:
            message["reasoning_content"] = reasoning
    return message


def _content(at: str, content, *, nullable: bool) -> str | None:
    """A string; None where the role may omit it (an assistant turn that only calls a tool); an
    OpenAI list of parts with its text parts joined. Anything else is refused, never dropped."""
    if isinstance(content, str):
        return content
    if content is None and nullable:
        return None
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise PipelineError(f"{at}.content[{k}] is a {kind!r} part; only text parts can be trained on")
            texts.append(part["text"])
        # Concatenated as they are: OpenAI's meaning of a list of text parts, and what the Qwen3.5/3.6
        # templates themselves do with one.
        return "".join(texts)
    kind = "null" if content is None else type(content).__name__
    raise PipelineError(f"{at}.content must be a string or a list of text parts, got {kind}")


def _reasoning(at: str, turn: dict) -> str | None:
    """`reasoning_content` (Qwen's templates, vLLM) or `reasoning` (other OpenAI-compatible servers)."""
    values = {key: turn[key] for key in ("reasoning_content", "reasoning") if turn.get(key) is not None}
    for key, value in values.items():
        if not isinstance(value, str):
            raise PipelineError(f"{at}.{key} must be a string, got {type(value).__name__}")
    if len(set(values.values())) > 1:
        raise PipelineError(f"{at} has both 'reasoning_content' and 'reasoning', and they differ")
    return next(iter(values.values()), None)


def _tool_calls(at: str, calls) -> list[dict]:
    """OpenAI tool calls, {"type": "function", "function": {"name", "arguments"}} (a flat
    {"name", "arguments"} is accepted too). Arguments given as a JSON string become an object, as
    serving engines do before rendering (the Qwen3.5/3.6 templates iterate over them)."""
    if not isinstance(calls, list):
        raise PipelineError(f"{at}.tool_calls must be a list, got {type(calls).__name__}")
    out = []
    for k, call in enumerate(calls):
        here = f"{at}.tool_calls[{k}]"
        if not isinstance(call, dict):
            raise PipelineError(f"{here} must be an object")
        function = call.get("function", call)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise PipelineError(f"{here} needs a function name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            arguments = _json_value(f"{here}.arguments", arguments) if arguments.strip() else {}
        if not isinstance(arguments, dict):
            raise PipelineError(f"{here}.arguments must be a JSON object, got {type(arguments).__name__}")
        normalised = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            normalised["id"] = call["id"]
        out.append(normalised)
    return out


def _json_value(at: str, text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise PipelineError(f"{at} is not valid JSON ({e.msg} at column {e.colno})") from None


def _check_tool_replies(where: str, field: str, messages: list[dict]) -> None:
    """A tool reply answers a call: it follows an assistant turn with tool calls (or another reply)."""
    for i, m in enumerate(messages):
        if m["role"] != "tool":
            continue
        before = next((p for p in reversed(messages[:i]) if p["role"] != "tool"), None)
        if before is None or before["role"] != "assistant" or not before.get("tool_calls"):
            raise PipelineError(f"{where}: {field}[{i}] is a tool reply with no tool call before it")


def _tools(where: str, tools) -> list[dict] | None:
    if isinstance(tools, str):  # ShareGPT datasets often carry the schema list as a JSON string
        tools = _json_value(f"{where}: field 'tools'", tools)
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise PipelineError(f"{where}: field 'tools' must be a list of function schemas (objects)")
    return tools


def _template_kwargs(where: str, kwargs) -> dict | None:
    if kwargs is not None and not isinstance(kwargs, dict):
        raise PipelineError(f"{where}: field 'chat_template_kwargs' must be an object")
    return kwargs or None


def _generated_by(where: str, value) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    if not isinstance(value, str):
        raise PipelineError(f"{where}: field 'generated_by' must be a string or an object")
    return value


def iter_rows(paths: list[Path], *, on_error: str = "fail", wanted: range | set[int] | None = None,
              index: RowIndex | None = None, need_answer: bool = True) -> Iterator[Row | PipelineError]:
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
                yield parse_row(sample_id, where, load(), need_answer=need_answer)
            except PipelineError as e:
                if on_error != "skip":
                    raise
                yield e
        base += count if count is not None else seen


def resolve_data(data: list[str]) -> list[Path]:
    """Dataset options -> files: a path, or `embedded:train` / `embedded:heldout`."""
    from pipeline.embedded import HELDOUT_DATA, TRAIN_DATA
    named = {"embedded:train": TRAIN_DATA, "embedded:heldout": HELDOUT_DATA}
    out = []
    for d in data:
        if d.startswith("embedded:") and d not in named:
            raise PipelineError(f"data: unknown embedded dataset {d!r}; use one of {sorted(named)}")
        out.append(named.get(d, Path(d)))
    return out
