"""A generated assistant turn as message fields: reasoning, content, tool calls (DESIGN 3.5).

The target writes one string; extract renders messages back through the chat template. So the
split must be the one the Qwen3.x templates make when they render a message: reasoning is what
stands between `<think>` and `</think>` (the generation prompt may have supplied the opening
tag), content follows the closing tag, and each `<tool_call>...</tool_call>` block is a call in
either of the two formats the templates write: Qwen3's JSON object (`{"name": ..., "arguments":
{...}}`) or Qwen3.5/3.6's `<function=NAME>` with `<parameter=P>` blocks. Text the split cannot
represent (a tool call that does not parse, text after the last call) stays in `content`
verbatim, which every template renders as written; `parse_assistant` says so in `problem`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>\n?(.*?)</function>\s*$", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


@dataclass
class Parsed:
    message: dict
    problem: str | None = None     # why part of the text stayed in `content` as written


def parse_assistant(generated: str, supplied: str = "") -> Parsed:
    """`generated`: the target's text after the generation prompt, end-of-turn token excluded;
    `supplied`: what the generation prompt wrote after the assistant header (e.g. `<think>\\n`)."""
    text = supplied + generated
    message: dict = {"role": "assistant"}
    if THINK_CLOSE in text:
        before, text = text.split(THINK_CLOSE, 1)
        reasoning = before.split(THINK_OPEN)[-1].strip()
        if reasoning or THINK_CLOSE not in supplied:
            # A block the prompt closed itself (thinking off) is not reasoning the target wrote.
            message["reasoning_content"] = reasoning
        text = text.lstrip("\n")
    elif text.startswith(THINK_OPEN):
        # The turn ended inside its reasoning: nothing the templates can render as a field.
        return Parsed({"role": "assistant", "content": generated}, "reasoning never closed")
    first = text.find(TOOL_OPEN)
    if first < 0:
        message["content"] = text
        return Parsed(message)
    content, calls, rest = text[:first].rstrip("\n"), [], text[first:]
    while rest.startswith(TOOL_OPEN):
        end = rest.find(TOOL_CLOSE)
        if end < 0:
            return _verbatim(message, text, "a tool call never closed")
        call = _tool_call(rest[len(TOOL_OPEN):end])
        if call is None:
            return _verbatim(message, text, "a tool call that does not parse")
        calls.append(call)
        rest = rest[end + len(TOOL_CLOSE):].lstrip("\n")
    if rest.strip():
        return _verbatim(message, text, "text after the tool calls")
    message["content"] = content
    message["tool_calls"] = calls
    return Parsed(message)


def _verbatim(message: dict, text: str, problem: str) -> Parsed:
    return Parsed({**{k: v for k, v in message.items() if k != "tool_calls"}, "content": text}, problem)


def _tool_call(body: str) -> dict | None:
    body = body.strip("\n")
    function = _FUNCTION.match(body)
    if function:
        arguments = {name: _value(value) for name, value in _PARAMETER.findall(function.group(2))}
        return {"type": "function", "function": {"name": function.group(1), "arguments": arguments}}
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"type": "function", "function": {"name": call["name"], "arguments": arguments}}


PYTHON_LITERALS = {"True": True, "False": False, "None": None}   # Qwen3.5 writes scalars with `| string`


def _value(text: str):
    """A parameter value as the Qwen3.5/3.6 templates wrote it: strings raw, objects and lists as
    JSON, scalars as JSON (3.6) or as Python prints them (3.5)."""
    if text in PYTHON_LITERALS:
        return PYTHON_LITERALS[text]
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return text if isinstance(value, str) else value
