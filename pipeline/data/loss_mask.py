"""Loss mask from the target's own chat template (DESIGN 3.5).

The rule: supervise exactly what the target generates in each assistant turn, in the recorded
thinking mode (its reasoning, its content, its tool calls, and the end-of-turn token that closes
the turn); never the assistant header, system/user/tool turns, nor what the generation prompt
supplies.

How it is found. The conversation is rendered once, with every field the template reads. The
generation prompt of the same template and kwargs (rendered for a one-message probe) gives the
assistant header, its first line (`<|im_start|>assistant\\n`), and what it supplies after the
header: Qwen3.5/3.6 supply `<think>\\n` with thinking on and `<think>\\n\\n</think>\\n\\n` with
thinking off; Qwen3 supplies the empty block with thinking off only. Every header in the rendering
opens one assistant turn. A turn's generated text starts after the header and after the longest
*line-prefix* of the supplied text that the turn begins with, and ends with the end-of-turn token.
Whole lines, so that content is never taken for supplied text (`<t` of `<tool_call>` is not
`<think>\\n`); a turn the template renders without a think block (Qwen's history turns) is all
generated, and a turn that kept its reasoning while thinking is off is given `<think>\\n` only.

Tokens that straddle the boundary: Qwen's tokenizer merges `\\n\\n` into one token, so with
thinking on and empty reasoning `<think>\\n` + `\\n</think>` puts one token across the boundary.
Rule: a token is supervised when any of its characters is generated. Nothing the target writes
is lost from the labels; the cost is that the drafter also learns that one token's prediction.

Reasoning in the data while thinking is off is a decision (policy `reasoning`): "error" (default)
refuses the row, "drop" removes it before rendering, "keep" renders it as the data has it.

Cost: one template rendering and one tokenization per conversation (the probe is cached).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from pipeline.errors import PipelineError

REASONING_POLICIES = ("error", "drop", "keep")
THINK_CLOSE = "</think>"
TOOL_CALL_OPEN = "<tool_call>"
# Kinds of supervised token, for counting and for `verify-cache --show`.
NOT_SUPERVISED, REASONING, CONTENT, TOOL_CALL, END_OF_TURN = "", "reasoning", "content", "tool_call", "end_of_turn"


@dataclass(frozen=True, kw_only=True)
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]
    text: str
    kinds: list[str] = field(default_factory=list)   # per token: reasoning / content / tool_call / end_of_turn / ''
    stats: dict = field(default_factory=dict)        # per conversation: turns with reasoning, tool calls, ...


@dataclass(frozen=True, kw_only=True)
class GenerationPrompt:
    header: str          # opens every assistant turn, e.g. "<|im_start|>assistant\n"
    supplied: str        # what the prompt gives the model after the header, e.g. "<think>\n"
    thinking: bool       # False when the prompt closes the think block for the model

    @property
    def supplied_lines(self) -> list[str]:
        """The supplied text's line-prefixes, longest first."""
        cuts = [k + 1 for k, ch in enumerate(self.supplied) if ch == "\n"] + [len(self.supplied)]
        return sorted({self.supplied[:c] for c in cuts if c}, key=len, reverse=True)


def render(tokenizer, messages: list[dict], *, generation_prompt: bool, tools=None, template_kwargs=None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=generation_prompt, **(template_kwargs or {}))


def template_message(error: Exception) -> str:
    """A template's exception as one line (its first)."""
    return (str(error).splitlines() or [type(error).__name__])[0]


def generation_prompt(tokenizer, template_kwargs: dict) -> GenerationPrompt:
    """Header and supplied text of the template's generation prompt in this mode."""
    probe = [{"role": "user", "content": "?"}]
    bare = render(tokenizer, probe, generation_prompt=False, template_kwargs=template_kwargs)
    full = render(tokenizer, probe, generation_prompt=True, template_kwargs=template_kwargs)
    if not full.startswith(bare) or full == bare:
        raise PipelineError("the chat template adds no generation prompt after a user turn, so its assistant turns "
                            "cannot be found; the target needs a chat template that serves generation")
    prompt = full[len(bare):]
    cut = prompt.find("\n") + 1 or len(prompt)
    supplied = prompt[cut:]
    thinking = THINK_CLOSE not in supplied and template_kwargs.get("enable_thinking") is not False
    return GenerationPrompt(header=prompt[:cut], supplied=supplied, thinking=thinking)


def has_reasoning(message: dict) -> bool:
    """Reasoning as a field, or written inline as a think block in the content."""
    return bool((message.get("reasoning_content") or "").strip()) or THINK_CLOSE in (message.get("content") or "")


def without_reasoning(message: dict) -> dict:
    """The message as the target would have written it with thinking off (the templates' own split)."""
    out = {k: v for k, v in message.items() if k != "reasoning_content"}
    if THINK_CLOSE in (out.get("content") or ""):
        out["content"] = out["content"].split(THINK_CLOSE)[-1].lstrip("\n")
    return out


@dataclass(frozen=True, kw_only=True)
class Rendered:
    text: str
    messages: list[dict]                 # as rendered (reasoning removed under "drop")
    spans: list[tuple[int, int]]         # generated character spans, one per assistant turn
    reasoning_turns: int                 # assistant turns that carried reasoning in the data
    dropped: int                         # of those, removed before rendering


class ConversationMasker:
    """Renders and masks conversations for one tokenizer, template configuration and reasoning policy."""

    def __init__(self, tokenizer, end_of_turn: str, template_kwargs: dict | None = None, reasoning: str = "error"):
        if reasoning not in REASONING_POLICIES:
            raise PipelineError(f"reasoning must be one of {', '.join(REASONING_POLICIES)}, got {reasoning!r}")
        self.tokenizer, self.end_of_turn, self.reasoning = tokenizer, end_of_turn, reasoning
        self.template_kwargs = dict(template_kwargs or {})
        self._prompts: dict[str, GenerationPrompt] = {}

    def prompt(self, template_kwargs: dict) -> GenerationPrompt:
        key = json.dumps(template_kwargs, sort_keys=True, default=str)
        if key not in self._prompts:
            self._prompts[key] = generation_prompt(self.tokenizer, template_kwargs)
        return self._prompts[key]

    def render(self, messages: list[dict], *, tools=None, row_kwargs: dict | None = None,
               where: str = "conversation") -> Rendered:
        """The rendering and its generated spans, or a PipelineError naming `where` when the row
        cannot be rendered under this configuration. No tokenization: extract's validating pass
        calls this on every row before any shard is written."""
        kwargs = {**self.template_kwargs, **(row_kwargs or {})}
        prompt = self.prompt(kwargs)
        num_assistant = sum(m["role"] == "assistant" for m in messages)
        reasoning_turns = sum(has_reasoning(m) for m in messages if m["role"] == "assistant")
        dropped = 0
        if reasoning_turns and not prompt.thinking:
            if self.reasoning == "error":
                raise PipelineError(f"{where}: an assistant turn carries reasoning but thinking is off in this "
                                    "template configuration; set the extract option reasoning to \"drop\" or \"keep\"")
            if self.reasoning == "drop":
                messages = [without_reasoning(m) if m["role"] == "assistant" else m for m in messages]
                dropped = reasoning_turns
        try:
            text = render(self.tokenizer, messages, generation_prompt=False, tools=tools, template_kwargs=kwargs)
        except Exception as e:  # noqa: BLE001 - templates raise many types (TemplateError, TypeError, ...)
            raise PipelineError(f"{where}: the chat template refuses this row ({template_message(e)})") from None
        return Rendered(text=text, messages=messages, spans=generated_spans(text, prompt, self.end_of_turn, num_assistant, where),
                        reasoning_turns=reasoning_turns, dropped=dropped)

    def validate(self, row, *, prompts: str | None = None) -> None:
        """The check every stage applies to a parsed row before any model work (extract's
        validating pass, generate's): the template renders the conversation and every assistant
        turn is found in it. `prompts="all"` / `"last"` (generate): each assistant turn to be
        written, or the last, must also render as a prompt (the conversation before it plus the
        generation prompt); Qwen3.5/3.6's template refuses one that follows no user turn (a
        greeting after the system prompt), although the whole conversation renders. Raises a
        one-line PipelineError naming the row and the turn."""
        if row.messages is None:
            return
        self.render(row.messages, tools=row.tools, row_kwargs=row.template_kwargs, where=row.where)
        if prompts is None:
            return
        kwargs = {**self.template_kwargs, **(row.template_kwargs or {})}
        turns = [i for i, m in enumerate(row.messages) if m["role"] == "assistant"]
        for k, i in enumerate(turns, 1):
            if prompts == "last" and k < len(turns):
                continue
            try:
                render(self.tokenizer, row.messages[:i], generation_prompt=True, tools=row.tools, template_kwargs=kwargs)
            except Exception as e:  # noqa: BLE001 - templates raise many types
                raise PipelineError(f"{row.where} (assistant turn {k} of {len(turns)}): the chat template cannot render "
                                    f"the prompt for this turn ({template_message(e)})") from None

    def __call__(self, messages: list[dict], *, tools=None, row_kwargs: dict | None = None, where: str = "conversation") -> Tokenized:
        rendered = self.render(messages, tools=tools, row_kwargs=row_kwargs, where=where)
        text, messages, spans = rendered.text, rendered.messages, rendered.spans
        assistant = [m for m in messages if m["role"] == "assistant"]
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(len(offsets), dtype=np.int8)
        for s, e in spans:  # any generated character makes the token a label (module doc)
            mask |= (offsets[:, 0] < e) & (offsets[:, 1] > s)
        loss_mask = mask.tolist()
        kinds = token_kinds(text, offsets, loss_mask, self.end_of_turn)
        # Reasoning the template itself leaves out (Qwen's history turns; a template that ignores the
        # field) is not in the tokens: counted, so a dataset whose reasoning never arrives is visible.
        reasoning_fields = [m["reasoning_content"].strip() for m in messages
                            if m["role"] == "assistant" and (m.get("reasoning_content") or "").strip()]
        stats = {"reasoning_turns": rendered.reasoning_turns,
                 "reasoning_turns_dropped": rendered.dropped,
                 "reasoning_turns_not_rendered": sum(r not in text for r in reasoning_fields),
                 "tool_call_turns": sum(bool(m.get("tool_calls")) for m in assistant),
                 "tool_replies": sum(m["role"] == "tool" for m in messages)}
        return Tokenized(input_ids=list(enc["input_ids"]), loss_mask=loss_mask, text=text, kinds=kinds, stats=stats)


def generated_spans(text: str, prompt: GenerationPrompt, end_of_turn: str, num_turns: int, where: str) -> list[tuple[int, int]]:
    """[(start, end)] character spans of what the target generates, one per assistant turn."""
    starts, at = [], text.find(prompt.header)
    while at >= 0:
        starts.append(at)
        at = text.find(prompt.header, at + len(prompt.header))
    if len(starts) != num_turns:
        raise PipelineError(f"{where}: the rendering has {len(starts)} assistant headers {prompt.header!r} for "
                            f"{num_turns} assistant messages; cannot tell the turns apart")
    spans = []
    for k, at in enumerate(starts):
        start = at + len(prompt.header)
        start += next((len(line) for line in prompt.supplied_lines if text.startswith(line, start)), 0)
        close = text.find(end_of_turn, start)
        following = starts[k + 1] if k + 1 < len(starts) else len(text)
        if close < 0 or close > following:
            raise PipelineError(f"{where}: assistant turn {k} is not closed by {end_of_turn!r} in the rendering")
        spans.append((start, close + len(end_of_turn)))
    return spans


def token_kinds(text: str, offsets, loss_mask: list[int], end_of_turn: str) -> list[str]:
    """Per token: reasoning (up to and including `</think>`), tool call (from `<tool_call>` on),
    content, end of turn; '' where unsupervised. Each run of supervised tokens is one turn."""
    kinds = [NOT_SUPERVISED] * len(loss_mask)
    i, n = 0, len(loss_mask)
    while i < n:
        if not loss_mask[i]:
            i += 1
            continue
        j = i
        while j < n and loss_mask[j]:
            j += 1
        lo, hi = int(offsets[i][0]), int(offsets[j - 1][1])
        turn = text[lo:hi]
        close = turn.find(THINK_CLOSE)
        think_end = lo + close + len(THINK_CLOSE) if close >= 0 else lo
        call = turn.find(TOOL_CALL_OPEN, think_end - lo)
        call_start = lo + call if call >= 0 else None
        for t in range(i, j):
            a, b = int(offsets[t][0]), int(offsets[t][1])
            if text[a:b] == end_of_turn:
                kinds[t] = END_OF_TURN
            elif a < think_end:
                kinds[t] = REASONING
            elif call_start is not None and b > call_start:
                kinds[t] = TOOL_CALL
            else:
                kinds[t] = CONTENT
        i = j
    return kinds


def tokenize_conversation(tokenizer, messages: list[dict], end_of_turn: str, *, tools=None, reasoning: str = "error",
                          **template_kwargs) -> Tokenized:
    """One conversation, for callers that mask a handful (extract keeps a ConversationMasker)."""
    return ConversationMasker(tokenizer, end_of_turn, template_kwargs, reasoning)(messages, tools=tools)


def newline_tokens(tokenizer, vocab_size: int) -> np.ndarray:
    """[vocab] bool: which token ids decode to text containing a newline (one decode per id, once)."""
    size = max(vocab_size, len(tokenizer))
    return np.array(["\n" in piece for piece in tokenizer.batch_decode([[i] for i in range(size)])], dtype=bool)


def mask_violations(input_ids, loss_mask, *, turn_start: int, end_of_turn: int, newline: np.ndarray, decode) -> dict[str, int]:
    """Where a stored mask breaks the rule, for Qwen-style chat tokens (<|im_start|>role\n ...
    <|im_end|>). Returns {violation: first position}; empty when the mask obeys DESIGN 3.5:
    headers and non-assistant turns unsupervised, each supervised assistant turn closed by a
    supervised end-of-turn (unless the sample ends first), nothing supervised outside a turn.
    `newline[id]`: the token holds a newline (see newline_tokens). Work is per turn, not per token."""
    ids, mask = np.asarray(input_ids), np.asarray(loss_mask).astype(bool)
    n = len(ids)
    found: dict[str, int] = {}
    starts = np.flatnonzero(ids == turn_start)
    closers = np.flatnonzero((ids == end_of_turn) | (ids == turn_start))
    newlines = np.flatnonzero(newline[ids])
    covered = np.zeros(n, dtype=bool)

    def note(kind: str, pos: int) -> None:
        found[kind] = min(found.get(kind, pos), pos)

    def first(a: int, b: int) -> int | None:
        hit = np.flatnonzero(mask[a:b])
        return a + int(hit[0]) if len(hit) else None

    for i in starts:
        k = np.searchsorted(newlines, i + 1)
        header_end = int(newlines[k]) if k < len(newlines) else n
        role = decode(ids[i + 1:header_end].tolist()).strip()
        k = np.searchsorted(closers, header_end + 1)
        end = int(closers[k]) if k < len(closers) else n
        closed = end < n and ids[end] == end_of_turn
        covered[i:end + closed] = True
        # The header's last token may carry generated text after its newline (a merged "\n\n"):
        # then it straddles the boundary and follows the straddling rule, not the header's.
        last = header_end
        if header_end < n:
            piece = decode([int(ids[header_end])])
            last -= bool(piece[piece.index("\n") + 1:]) if "\n" in piece else 0
        if (pos := first(i, last + 1)) is not None:
            note(f"{role} header supervised", pos)
        if role != "assistant" and (pos := first(header_end + 1, end + 1)) is not None:
            note(f"{role} turn supervised", pos)
        if role == "assistant" and closed and not mask[end] and first(header_end + 1, end) is not None:
            note("end-of-turn token not supervised", end)
        # A supervised answer that the next turn's start interrupts (a pre-tokenized row): the target
        # would never be taught to end it. A sample cut by max_length (end == n) is not this.
        if role == "assistant" and not closed and end < n and first(header_end + 1, end) is not None:
            note("assistant turn not closed by the end-of-turn token", end)
    outside = np.flatnonzero(mask & ~covered)
    if len(outside):
        note("supervised token outside any turn", int(outside[0]))
    return found
