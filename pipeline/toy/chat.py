"""Chat format of the tiny target: Qwen's special tokens and a Qwen-style chat template.

The template renders exactly what Qwen's serving template renders for plain text turns:

    <|im_start|>{role}\n{content}<|im_end|>\n        (for every message, in order)
    <|im_start|>assistant\n                         (only with add_generation_prompt)

The tiny target has no thinking switch; a real Qwen3.x template may, and the cache manifest
records which mode was used.
"""

from __future__ import annotations

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Reserved for the DFlash drafter's block slots 1..B-1; never produced by the template or data.
MASK = "<|MASK|>"

SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END, MASK]
ROLES = ("system", "user", "assistant")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def render(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """Pure-Python rendering of CHAT_TEMPLATE (the tests check both agree character for character)."""
    out = []
    for m in messages:
        if m["role"] not in ROLES:
            raise ValueError(f"unknown role: {m['role']}")
        out.append(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n")
    if add_generation_prompt:
        out.append(f"{IM_START}assistant\n")
    return "".join(out)
