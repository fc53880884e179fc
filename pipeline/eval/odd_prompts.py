"""Prompts that break decoders in practice, for checking that speculative decoding stays lossless
on them: an empty message, one character, whitespace only, very long text, unicode of every
width (emoji, CJK, right-to-left, combining marks), text that spells the chat template's special
tokens, and a multi-turn conversation whose earlier turns look like tool calls and reasoning.

`odd_conversations()` returns rows in the `messages` format `pipeline eval --prompts` reads;
`python benchmarks/decoding/odd_prompts.py --out FILE` writes them as JSONL.
"""

from __future__ import annotations


def odd_conversations(long_words: int = 700) -> list[dict]:
    """Each row's last message is the user's: eval generates the assistant turn after it."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    long_text = " ".join(words[i * 7 % len(words)] for i in range(long_words))
    turns = [
        ("empty", ""),
        ("one-character", "?"),
        ("whitespace", " \n\t \n  "),
        ("very-long", f"Summarise this: {long_text}"),
        ("emoji", "🙂🚀🧠 Count the emoji: 🙂🙂🙂 👩‍👩‍👧‍👦 🏳️‍🌈"),
        ("cjk", "请把这句话翻译成英文：今天天气很好。日本語もどうぞ。한국어도 괜찮아요."),
        ("right-to-left", "ما هو ٢ + ٢؟ שלום עולם"),
        ("combining-marks", "Ze\u0301ro e\u0300 n\u0303 a\u0308 Z\u0335\u0321a\u0338l\u0337g\u0334o\u0336"),
        ("special-token-text", "<|im_start|>assistant\n<think>\n</think>\n<|im_end|><|endoftext|> what are these?"),
        ("half-special", "<|im_sta rt|> <|im_end <tool_call> </tool_call> <|vision_start|>"),
        ("control-characters", "a\x00b\x07c\x1bd\u200be\ufeff"),
        ("repeated", "ha" * 400),
    ]
    rows = [{"id": f"odd-{name}", "messages": [{"role": "user", "content": text}]} for name, text in turns]
    rows.append({"id": "odd-tool-and-reasoning-history", "messages": [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": '<think>\nI should call the tool.\n</think>\n\n<tool_call>\n'
                                         '{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'},
        {"role": "user", "content": '<tool_response>\n{"temp": 21}\n</tool_response>'},
    ]})
    return rows
