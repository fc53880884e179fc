"""Synthetic chat tasks for the tiny target, shaped like the flagship's traffic: it thinks (in
thinking mode a one-sentence `<think>` block before the answer), and given tools it calls them.

Every answer is a deterministic function of the prompt (and of the tool's reply), and most are
predictable several tokens ahead (counting, repetition, ordered lists, templated prose), so a
DFlash drafter has multi-token structure to learn. Two tasks need a tool the model cannot replace:
multiplying a 3-digit by a 2-digit number (`calculator`) and an order's status (`lookup_order`,
a hash of the order id). They are asked only when the tools are given; other tasks are answered
directly, tools or not.

Shares (per conversation): thinking mode THINKING, tools given TOOLS; with tools each user turn
is a tool task with TOOL_TASK; a conversation whose last turn calls a tool ends at the call
(the reply pending) with PENDING_CALL. Everything is drawn from one `random.Random`, so a seed
fixes the corpus.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Callable

THINKING, TOOLS, TOOL_TASK, PENDING_CALL = 0.5, 0.4, 0.6, 0.4

WORDS = [
    "apple", "river", "stone", "cloud", "tiger", "lemon", "green", "house", "music", "paper",
    "light", "water", "bread", "horse", "table", "glass", "sugar", "plant", "train", "chair",
]
ANIMALS = {
    "cat": ("small", "sleep in the sun", "milk"),
    "dog": ("loyal", "run in the park", "meat"),
    "bird": ("light", "sing at dawn", "seeds"),
    "fish": ("quiet", "swim in the lake", "worms"),
    "horse": ("strong", "run in the field", "hay"),
    "mouse": ("tiny", "hide in the wall", "cheese"),
    "bear": ("big", "sleep in winter", "honey"),
    "frog": ("green", "jump in the pond", "flies"),
}
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a careful assistant. Answer briefly.",
    "You answer in plain text.",
]
LETTERS = "abcdefghijklmnopqrstuvwxyz"


STATUSES = ("shipped", "delivered", "pending", "cancelled")


@dataclass(frozen=True)
class Task:
    prompt: str
    answer: str
    thought: str                       # the reasoning written in thinking mode


def count_range(rng: random.Random) -> Task:
    start = rng.randint(0, 80)
    stop = start + rng.randint(3, 12)
    return Task(f"Count from {start} to {stop}.", ", ".join(str(i) for i in range(start, stop + 1)) + ".",
                f"The user wants the numbers from {start} up to {stop}.")


def count_down(rng: random.Random) -> Task:
    start = rng.randint(10, 90)
    stop = start - rng.randint(3, 9)
    return Task(f"Count down from {start} to {stop}.", ", ".join(str(i) for i in range(start, stop - 1, -1)) + ".",
                f"The user wants the numbers from {start} down to {stop}.")


def repeat_word(rng: random.Random) -> Task:
    word, times = rng.choice(WORDS), rng.randint(2, 8)
    return Task(f"Repeat the word {word} {times} times.", " ".join([word] * times), f"I write {word} {times} times.")


def add_numbers(rng: random.Random) -> Task:
    a, b = rng.randint(1, 49), rng.randint(1, 49)
    return Task(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.", f"I add {a} and {b}.")


def sort_numbers(rng: random.Random) -> Task:
    nums = rng.sample(range(10), rng.randint(3, 6))
    shown = " ".join(map(str, nums))
    return Task(f"Sort these numbers: {shown}.", "Sorted: " + " ".join(map(str, sorted(nums))) + ".",
                f"I sort {len(nums)} numbers from small to large.")


def letter_range(rng: random.Random) -> Task:
    i = rng.randint(0, 18)
    j = i + rng.randint(3, 7)
    return Task(f"List the letters from {LETTERS[i]} to {LETTERS[j]}.", " ".join(LETTERS[i:j + 1]),
                f"The letters run from {LETTERS[i]} to {LETTERS[j]}.")


def spell_word(rng: random.Random) -> Task:
    word = rng.choice(WORDS)
    return Task(f"Spell the word {word}.", f"{word} is spelled " + "-".join(word) + ".",
                f"I spell {word} letter by letter.")


def describe_animal(rng: random.Random) -> Task:
    name = rng.choice(sorted(ANIMALS))
    size, habit, food = ANIMALS[name]
    answer = (f"The {name} is a {size} animal. The {name} likes to {habit}. "
              f"The {name} eats {food}.")
    return Task(f"Tell me about the {name}.", answer, f"The user asks about the {name}.")


TASKS: dict[str, Callable[[random.Random], Task]] = {
    "count_range": count_range,
    "count_down": count_down,
    "repeat_word": repeat_word,
    "add_numbers": add_numbers,
    "sort_numbers": sort_numbers,
    "letter_range": letter_range,
    "spell_word": spell_word,
    "describe_animal": describe_animal,
}


# Tools: OpenAI-style schemas (what a row's `tools` holds) and what running them returns.
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Multiply two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
LOOKUP_ORDER = {"type": "function", "function": {
    "name": "lookup_order", "description": "The status of an order.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}}
TOOL_SCHEMAS = [CALCULATOR, LOOKUP_ORDER]


def order_status(order_id: str) -> str:
    """A status the model cannot know without the tool."""
    return STATUSES[hashlib.sha256(order_id.encode()).digest()[0] % len(STATUSES)]


def run_tool(name: str, arguments: dict) -> str:
    """The tool's reply to a call as the model wrote it (a call that does not fit gets an error
    reply, as a real tool server would answer)."""
    try:
        if name == "calculator":
            return str(int(arguments["a"]) * int(arguments["b"]))
        if name == "lookup_order":
            return order_status(str(arguments["order_id"]))
    except (KeyError, TypeError, ValueError):
        return "error: bad arguments"
    return f"error: no tool named {name}"


@dataclass(frozen=True)
class ToolTask:
    prompt: str
    thought: str                 # before the call, in thinking mode
    name: str
    arguments: dict
    after: str                   # the thought after the reply, in thinking mode

    def answer(self, reply: str) -> str:
        if self.name == "calculator":
            return f"{self.arguments['a']} times {self.arguments['b']} is {reply}."
        return f"Order {self.arguments['order_id']} is {reply}."


def multiply(rng: random.Random) -> ToolTask:
    a, b = rng.randint(100, 999), rng.randint(10, 99)
    return ToolTask(f"What is {a} times {b}?", f"I need {a} times {b}, so I use the calculator.", "calculator",
                    {"a": a, "b": b}, "The calculator gave the product.")


def find_order(rng: random.Random) -> ToolTask:
    order_id = f"{rng.choice('ABCDEFGH')}{rng.randint(1000, 9999)}"
    return ToolTask(f"What is the status of order {order_id}?", f"I look up order {order_id}.", "lookup_order",
                    {"order_id": order_id}, "The lookup gave the status.")


TOOL_TASKS: dict[str, Callable[[random.Random], ToolTask]] = {"multiply": multiply, "find_order": find_order}


@dataclass
class Conversation:
    """Ground truth: the messages as the template reads them, the tools given, the thinking mode."""
    messages: list[dict]
    tools: list[dict] | None
    thinking: bool

    @property
    def template_kwargs(self) -> dict:
        return {"enable_thinking": self.thinking}

    def row(self, row_id: str) -> dict:
        """A dataset row (pipeline/data/conversations.py reads `tools` and `chat_template_kwargs`)."""
        row = {"id": row_id, "messages": self.messages, "chat_template_kwargs": self.template_kwargs}
        if self.tools:
            row["tools"] = self.tools
        return row


def assistant(content: str, thought: str | None, calls: list[dict] | None = None) -> dict:
    message: dict = {"role": "assistant", "content": content}
    if thought is not None:
        message["reasoning_content"] = thought
    if calls:
        message["tool_calls"] = calls
    return message


def tool_call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": dict(arguments)}}


def conversation(rng: random.Random) -> Conversation:
    """One conversation: optional system prompt, 1-3 user turns, each answered (through a tool
    call and its reply for a tool task); the last may end at a pending call."""
    thinking, tools = rng.random() < THINKING, rng.random() < TOOLS
    messages: list[dict] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    num_turns = rng.choices([1, 2, 3], weights=[0.6, 0.3, 0.1])[0]
    for turn in range(num_turns):
        if tools and rng.random() < TOOL_TASK:
            task = TOOL_TASKS[rng.choice(sorted(TOOL_TASKS))](rng)
            messages.append({"role": "user", "content": task.prompt})
            messages.append(assistant("", task.thought if thinking else None, [tool_call(task.name, task.arguments)]))
            if turn == num_turns - 1 and rng.random() < PENDING_CALL:
                break
            reply = run_tool(task.name, task.arguments)
            messages.append({"role": "tool", "content": reply})
            messages.append(assistant(task.answer(reply), task.after if thinking else None))
        else:
            task = TASKS[rng.choice(sorted(TASKS))](rng)
            messages.append({"role": "user", "content": task.prompt})
            messages.append(assistant(task.answer, task.thought if thinking else None))
    return Conversation(messages, list(TOOL_SCHEMAS) if tools else None, thinking)


def conversations(seed: int, num: int) -> list[Conversation]:
    rng = random.Random(seed)
    return [conversation(rng) for _ in range(num)]
