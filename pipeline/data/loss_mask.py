"""Loss mask from the target's own chat template (DESIGN 3.5).

Supervised: the assistant's content tokens and the end-of-turn token that closes them.
Not supervised: system and user turns, the assistant header, the newline after the
end-of-turn token, padding.

The spans are found by rendering prefixes with the template itself, so the rule follows
whatever the template emits: the assistant turn's text is what rendering messages[:i+1]
adds after rendering messages[:i] with the generation prompt (the header).

Some templates are not prefix-stable: Qwen3.x renders the last assistant turn with a
`<think>` block and earlier turns without. For those the spans are found in the full
rendering instead: each assistant turn starts after the generation prompt's header, skipping
whatever else the generation prompt supplies at inference (with thinking off, the empty
`<think></think>` block), and ends with the end-of-turn token.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]
    text: str


def supervised_char_spans(tokenizer, messages: list[dict], end_of_turn: str, **template_kwargs) -> tuple[str, list[tuple[int, int]]]:
    """Render `messages` and return (text, [(start, end) character spans to supervise])."""
    def render(msgs, gen):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, **template_kwargs)

    text = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        with_header = render(messages[:i], True)
        with_turn = render(messages[: i + 1], False)
        if not (with_turn.startswith(with_header) and text.startswith(with_turn)):
            return text, _scan_spans(text, messages, end_of_turn, render)
        turn = with_turn[len(with_header):]
        close = turn.rfind(end_of_turn)
        if close < 0:
            raise ValueError(f"assistant message {i} is not closed by {end_of_turn!r} in the rendered template")
        spans.append((len(with_header), len(with_header) + close + len(end_of_turn)))
    return text, spans


def _scan_spans(text: str, messages: list[dict], end_of_turn: str, render) -> list[tuple[int, int]]:
    """Spans for templates that render history differently from the last turn (see module doc)."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prompt = render(messages[:first], True)[len(render(messages[:first], False)):]  # e.g. "<|im_start|>assistant\n"
    num_turns = sum(m["role"] == "assistant" for m in messages)
    cuts = [k + 1 for k, ch in enumerate(prompt) if ch == "\n"] or [len(prompt)]
    header = next((prompt[:c] for c in sorted(cuts, reverse=True) if text.count(prompt[:c]) == num_turns), None)
    if not header:
        raise ValueError("chat template is not prefix-stable and its assistant header "
                         f"{prompt!r} does not mark each assistant turn; cannot derive the loss mask")
    supplied = prompt[len(header):]  # given to the model at inference, so never a label
    spans, cursor = [], 0
    for _ in range(num_turns):
        start = text.index(header, cursor) + len(header)
        if supplied and text.startswith(supplied, start):
            start += len(supplied)
        close = text.find(end_of_turn, start)
        if close < 0:
            raise ValueError(f"an assistant turn is not closed by {end_of_turn!r} in the rendered template")
        spans.append((start, close + len(end_of_turn)))
        cursor = close
    return spans


def tokenize_conversation(tokenizer, messages: list[dict], end_of_turn: str, **template_kwargs) -> Tokenized:
    text, spans = supervised_char_spans(tokenizer, messages, end_of_turn, **template_kwargs)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s <= a and b <= e for s, e in spans)) for a, b in enc["offset_mapping"]]
    return Tokenized(input_ids=list(enc["input_ids"]), loss_mask=mask, text=text)


def mask_violations(input_ids: list[int], loss_mask: list[int], *, turn_start: int, end_of_turn: int, decode) -> dict[str, int]:
    """Where a stored mask breaks the rule, for Qwen-style chat tokens (<|im_start|>role\\n ...
    <|im_end|>). Returns {violation: first position}; empty when the mask obeys DESIGN 3.5:
    headers and non-assistant turns unsupervised, each supervised assistant turn closed by a
    supervised end-of-turn, nothing supervised outside a turn."""
    found: dict[str, int] = {}

    def note(kind: str, pos: int) -> None:
        found.setdefault(kind, pos)

    n, i = len(input_ids), 0
    while i < n:
        if input_ids[i] != turn_start:
            if loss_mask[i]:
                note("supervised token outside any turn", i)
            i += 1
            continue
        header_end = i + 1
        while header_end < n and "\n" not in decode([input_ids[header_end]]):
            header_end += 1
        role = decode(input_ids[i + 1:header_end]).strip()
        end = header_end + 1
        while end < n and input_ids[end] != end_of_turn and input_ids[end] != turn_start:
            end += 1
        if any(loss_mask[i:header_end + 1]):
            note(f"{role} header supervised", i + next(k for k, m in enumerate(loss_mask[i:header_end + 1]) if m))
        content = loss_mask[header_end + 1:end + 1]
        if role != "assistant" and any(content):
            note(f"{role} turn supervised", header_end + 1 + content.index(1))
        if role == "assistant" and any(loss_mask[header_end + 1:end]) and end < n and input_ids[end] == end_of_turn \
                and not loss_mask[end]:
            note("end-of-turn token not supervised", end)
        i = end + 1 if end < n and input_ids[end] == end_of_turn else end
    return found
