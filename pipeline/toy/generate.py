"""Regenerate a conversation set with the target itself (DESIGN 3.7: drafters learn the target's
distribution, so the training responses come from the target).

User turns (and the system prompt, tools and thinking mode) come from the ground truth; every
assistant turn is the target's greedy answer to the conversation so far. When the target calls a
tool, the tool runs on the arguments it wrote (tasks.run_tool) and the target answers the reply;
a conversation whose ground truth ends at a pending call ends at the target's call too.

A turn is kept only if it renders back exactly: the conversation with the parsed message
(reasoning, content, tool calls split as pipeline/generate/assistant.py splits them) renders
through the template to the prompt's tokens, the generated tokens and the end of turn. A
conversation with a turn that never ends, does not render back, or chains more than MAX_CHAIN
answers to one user turn is dropped, never cut.

All live conversations decode together, one batch per round of turns
(pipeline/generate/decoding.py: prompts of any lengths, each as it would decode alone).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pipeline.data.loss_mask import generation_prompt, render
from pipeline.generate.assistant import parse_assistant
from pipeline.generate.decoding import generate
from pipeline.target_model.live import LiveTarget
from pipeline.toy.tasks import Conversation, run_tool

MAX_CHAIN = 3          # answers to one user turn (call, reply, call, ... answer)
BATCH = 64


@dataclass
class _State:
    truth: Conversation
    segments: list[list[dict]]                  # per user turn: the messages the user side adds
    done: list[dict] = field(default_factory=list)
    turn: int = 0                               # the user turn being answered
    chain: int = 0                              # answers written to it so far
    failed: str | None = None
    failed_text: str = ""                       # the prompt's end and what the target wrote, for the log

    @property
    def finished(self) -> bool:
        return self.failed is not None or self.turn >= len(self.segments)


def user_segments(messages: list[dict]) -> list[list[dict]]:
    """The ground truth's user side: [system?, user], [user], ... (assistant and tool turns are
    the target's to write)."""
    segments: list[list[dict]] = []
    lead: list[dict] = []
    for m in messages:
        if m["role"] == "system":
            lead.append(m)
        elif m["role"] == "user":
            segments.append(lead + [m])
            lead = []
    return segments


def ends_pending(messages: list[dict]) -> bool:
    return messages[-1]["role"] == "assistant" and bool(messages[-1].get("tool_calls"))


def regenerate(model, tokenizer, conversations: list[Conversation], *, max_new_tokens: int = 128
               ) -> tuple[list[Conversation | None], Counter, dict[str, str]]:
    """([regenerated conversation or None when dropped], Counter of why conversations were dropped,
    {why: the first such turn's text})."""
    target = LiveTarget(model, [])
    stop = {tokenizer.convert_tokens_to_ids(tokenizer.eos_token)}
    supplied = {t: generation_prompt(tokenizer, {"enable_thinking": t}).supplied for t in (False, True)}
    states = [_State(c, user_segments(c.messages)) for c in conversations]
    for s in states:
        s.done = list(s.segments[0])
    while True:
        live = [s for s in states if not s.finished]
        if not live:
            break
        for first in range(0, len(live), BATCH):
            chunk = live[first:first + BATCH]
            texts = [render(tokenizer, s.done, generation_prompt=True, tools=s.truth.tools,
                            template_kwargs=s.truth.template_kwargs) for s in chunk]
            prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
            for s, prompt, out in zip(chunk, prompts, generate(target, prompts, max_new=max_new_tokens, stop=stop)):
                _advance(s, tokenizer, prompt, out, supplied[s.truth.thinking])
    why = Counter(s.failed for s in states if s.failed)
    examples: dict[str, str] = {}
    for s in states:
        if s.failed:
            examples.setdefault(s.failed, s.failed_text)
    return [None if s.failed else Conversation(s.done, s.truth.tools, s.truth.thinking) for s in states], why, examples


def _advance(s: _State, tokenizer, prompt: list[int], out, supplied: str) -> None:
    if not out.finished:
        s.failed, s.failed_text = "a turn never ended", tokenizer.decode(prompt[-40:] + out.tokens)
        return
    parsed = parse_assistant(tokenizer.decode(out.tokens), supplied)
    message = parsed.message
    whole = render(tokenizer, s.done + [message], generation_prompt=False, tools=s.truth.tools,
                   template_kwargs=s.truth.template_kwargs)
    expected = prompt + out.tokens + [tokenizer.convert_tokens_to_ids(tokenizer.eos_token)]
    if parsed.problem or tokenizer(whole, add_special_tokens=False)["input_ids"][:len(expected)] != expected:
        s.failed, s.failed_text = "a turn does not render back", tokenizer.decode(prompt[-40:] + out.tokens)
        return
    s.done.append(message)
    s.chain += 1
    calls = message.get("tool_calls") or []
    last_turn = s.turn == len(s.segments) - 1
    if calls and not (last_turn and ends_pending(s.truth.messages)):
        if s.chain >= MAX_CHAIN:
            s.failed = "too many tool calls"
            return
        s.done.extend({"role": "tool", "content": run_tool(c["function"]["name"], c["function"]["arguments"])}
                      for c in calls)
        return
    s.turn, s.chain = s.turn + 1, 0
    if not last_turn:
        s.done.extend(s.segments[s.turn])
