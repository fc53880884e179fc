"""The row parser keeps every field a chat template reads (no template or model needed)."""

import json

import pytest

from pipeline.data.conversations import parse_row
from pipeline.errors import PipelineError

CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}


def parsed(obj):
    return parse_row(0, "data.jsonl:1", obj)


def test_openai_fields_are_kept_and_normalised():
    row = parsed({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "1 plus "}, {"type": "text", "text": "2?"}]},
        {"role": "assistant", "content": None, "reasoning": "Use add.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "content": "3", "tool_call_id": "c1", "name": "add"},
        {"role": "assistant", "content": "3.", "reasoning_content": "It said 3."}],
        "tools": [{"type": "function", "function": {"name": "add"}}], "chat_template_kwargs": {"enable_thinking": True},
        "generated_by": {"model": "t", "temperature": 0}})
    assert row.messages == [
        {"role": "user", "content": "1 plus 2?"},
        {"role": "assistant", "content": None, "reasoning_content": "Use add.", "tool_calls": [{**CALL, "id": "c1"}]},
        {"role": "tool", "content": "3", "tool_call_id": "c1", "name": "add"},
        {"role": "assistant", "content": "3.", "reasoning_content": "It said 3."}]
    assert row.tools == [{"type": "function", "function": {"name": "add"}}]
    assert row.template_kwargs == {"enable_thinking": True}
    assert json.loads(row.generated_by) == {"model": "t", "temperature": 0}


def test_sharegpt_tool_turns_map_onto_the_openai_structure():
    row = parsed({"conversations": [
        {"from": "human", "value": "1 plus 2?"},
        {"from": "function_call", "value": json.dumps({"name": "add", "arguments": {"a": 1, "b": 2}})},
        {"from": "observation", "value": "3"},
        {"from": "gpt", "value": "3."}], "tools": json.dumps([{"name": "add"}])})
    assert row.messages == [{"role": "user", "content": "1 plus 2?"},
                            {"role": "assistant", "content": None, "tool_calls": [CALL]},
                            {"role": "tool", "content": "3"},
                            {"role": "assistant", "content": "3."}]
    assert row.tools == [{"name": "add"}]


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "x", "reasoning_content": "y"}],
     "messages[1] has both 'reasoning_content' and 'reasoning', and they differ"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
                                         "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
     "messages[1].tool_calls[0].arguments is not valid JSON"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}],
     "messages[1].tool_calls[0] needs a function name"),
    ([{"role": "user", "content": None}, {"role": "assistant", "content": "a"}],
     "messages[0].content must be a string or a list of text parts, got null"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": 3}],
     "messages[1].reasoning_content must be a string"),
])
def test_bad_fields_name_the_row_and_field(messages, message):
    with pytest.raises(PipelineError) as e:
        parsed({"messages": messages})
    assert str(e.value).startswith("data.jsonl:1: ") and message in str(e.value), str(e.value)
