"""Conversations of every shape a chat template must handle (system prompts, reasoning in the
last turn or in history, tool calls and replies, null content) as a user's rows, the thinking
modes of each real Qwen3.x template, and the loss-mask oracle written from the rule of DESIGN 3.5
(render with the template itself, supervise each assistant turn after what the generation
prompt supplies, up to and including `<|im_end|>`; a token is supervised when any of its
characters is). Shared by the chat-shape tests on the embedded tokenizer and on the real
Qwen3.6 one."""

from __future__ import annotations

import copy
import json

HEADER, END = "<|im_start|>assistant\n", "<|im_end|>"
QWEN_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# Template x mode -> (chat_template_kwargs, what the generation prompt supplies after the header).
MODES = {
    ("qwen3", "thinking"): ({}, ""),
    ("qwen3", "no_thinking"): ({"enable_thinking": False}, "<think>\n\n</think>\n\n"),
    ("qwen3.5", "thinking"): ({}, "<think>\n"),
    ("qwen3.5", "no_thinking"): ({"enable_thinking": False}, "<think>\n\n</think>\n\n"),
    ("qwen3.6", "thinking"): ({}, "<think>\n"),
    ("qwen3.6", "no_thinking"): ({"enable_thinking": False}, "<think>\n\n</think>\n\n"),
    ("qwen3.6", "preserve_thinking"): ({"preserve_thinking": True}, "<think>\n"),
}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def call(city: str) -> dict:
    return {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


def system(text): return {"role": "system", "content": text}
def user(text): return {"role": "user", "content": text}
def tool(text): return {"role": "tool", "content": text, "tool_call_id": "call_0"}


def assistant(content, reasoning=None, tool_calls=None):
    m = {"role": "assistant", "content": content}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
    if tool_calls is not None:
        m["tool_calls"] = tool_calls
    return m


# Template-ready messages (what the oracle renders) and, for tool shapes, the tools.
SHAPES = {
    "single_turn": [user("What is 2 plus 3?"), assistant("2 plus 3 is 5.")],
    "system": [system("You answer briefly."), user("Spell cat."), assistant("c-a-t.")],
    "three_turns": [user("Count to 3."), assistant("1 2 3"), user("And back?"), assistant("3 2 1"),
                    user("Spell dog."), assistant("d-o-g")],
    "reasoning_last": [user("What is 2 plus 3?"), assistant("5.", reasoning="Two plus three.\nThat is five.")],
    "reasoning_in_history": [user("What is 2 plus 3?"), assistant("5.", reasoning="Add them."),
                             user("And 4 plus 4?"), assistant("8.")],
    "reasoning_in_both": [user("What is 2 plus 3?"), assistant("5.", reasoning="Add them."),
                          user("And 4 plus 4?"), assistant("8.", reasoning="Double four.")],
    "think_inline": [user("What is 2 plus 3?"), assistant("<think>\nAdd them.\n</think>\n\n5.")],
    "empty_reasoning": [user("Say hi."), assistant("hi", reasoning="")],
    "tool_reply_answer": [user("Weather in Paris?"), assistant("", tool_calls=[call("Paris")]), tool("18 C, sunny"),
                          assistant("It is 18 C and sunny in Paris.")],
    "tool_then_question": [user("Weather in Paris?"), assistant("", tool_calls=[call("Paris")]), tool("18 C"),
                           assistant("18 C."), user("Thanks. Spell sun."), assistant("s-u-n")],
    "tool_with_reasoning": [user("Weather in Rome?"), assistant("Let me check.", reasoning="I need the tool.",
                                                                 tool_calls=[call("Rome")]),
                            tool("21 C"), assistant("21 C in Rome.", reasoning="The tool said 21 C.")],
    "ends_in_tool_call": [user("Weather in Oslo?"), assistant("Checking.", tool_calls=[call("Oslo")])],
    "content_null": [user("Weather in Kyiv?"), assistant(None, tool_calls=[call("Kyiv")])],
    "empty_content": [user("Say nothing."), assistant("")],
    "assistant_first": [assistant("Hello! What can I do?"), user("Spell ox."), assistant("o-x")],
    "system_then_greeting": [system("You are kind."), assistant("Hello!"), user("Spell owl."), assistant("o-w-l")],
}
TOOL_SHAPES = {"tool_reply_answer", "tool_then_question", "tool_with_reasoning", "ends_in_tool_call", "content_null"}
REASONING_SHAPES = {"reasoning_last", "reasoning_in_history", "reasoning_in_both", "think_inline", "tool_with_reasoning"}


def as_row(shape: str) -> dict:
    """The row a user would have: OpenAI arguments as JSON strings (objects in one shape), the
    `reasoning` spelling in one shape, the system prompt as text parts in another."""
    messages = copy.deepcopy(SHAPES[shape])
    for m in messages:
        for c in m.get("tool_calls") or []:
            if shape != "tool_with_reasoning":
                c["function"]["arguments"] = json.dumps(c["function"]["arguments"])
        if shape == "reasoning_last" and "reasoning_content" in m:
            m["reasoning"] = m.pop("reasoning_content")
        if shape == "system" and m["role"] == "system":
            m["content"] = [{"type": "text", "text": "You answer "}, {"type": "text", "text": "briefly."}]
    row = {"messages": messages}
    if shape in TOOL_SHAPES:
        row["tools"] = [WEATHER_TOOL]
    return row


def expected_outcome(template: str, mode: str, shape: str) -> str:
    if mode == "no_thinking" and shape in REASONING_SHAPES:
        return "reasoning refused"
    if template == "qwen3" and shape == "content_null":
        return "template refuses"  # Qwen3's template tests '</think>' in content, which fails on null
    return "stored"


def oracle(tokenizer, shape: str, template_kwargs: dict, supplied: str) -> tuple[list[int], list[int]]:
    text = tokenizer.apply_chat_template(SHAPES[shape], tools=[WEATHER_TOOL] if shape in TOOL_SHAPES else None,
                                         tokenize=False, **template_kwargs)
    spans, at = [], text.find(HEADER)
    while at >= 0:
        start = at + len(HEADER)
        if supplied and text.startswith(supplied, start):
            start += len(supplied)
        end = text.index(END, start) + len(END)
        spans.append((start, end))
        at = text.find(HEADER, end)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a < e and b > s for s, e in spans)) for a, b in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask
