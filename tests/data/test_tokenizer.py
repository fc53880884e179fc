"""The shipped tokenizer: byte-level BPE in transformers' Qwen3.5 class, Qwen chat tokens, and a
chat template that renders as the real Qwen3.6 template does."""

from pathlib import Path

import pytest

from pipeline.toy import chat, tasks
from harness.prerequisites import missing

REAL_TEMPLATE = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "chat_templates" / "qwen3.6.jinja"

TEXTS = [
    "Count from 12 to 19.",
    "Hello, world!  Two spaces, a tab\tand\nnewlines\n\n",
    "unicode: héllo wörld, 世界, emoji 🚀, math ∑x²",
    "   leading and trailing spaces   ",
    "",
    "<|im_start|> inside text is a special token",
]


def test_class_and_special_tokens(tokenizer):
    assert type(tokenizer).__name__ == "Qwen3_5Tokenizer"
    for token in chat.SPECIAL_TOKENS:
        ids = tokenizer(token, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, f"{token} must be a single token, got {ids}"
        assert tokenizer.convert_ids_to_tokens(ids[0]) == token
    assert tokenizer.eos_token == chat.IM_END
    assert tokenizer.pad_token == chat.END_OF_TEXT
    # Qwen's layout: specials sit after the learned byte-level vocabulary.
    assert min(tokenizer.convert_tokens_to_ids(chat.SPECIAL_TOKENS)) >= 256


def test_think_and_tool_markers_are_single_tokens_the_model_writes(tokenizer):
    """As in Qwen's tokenizer: one token each, not special, so decoding keeps them even when asked
    to skip special tokens (a server's output keeps the model's <think> and <tool_call>)."""
    for marker in chat.MARKERS:
        ids = tokenizer(f"a{marker}b", add_special_tokens=False)["input_ids"]
        assert tokenizer.convert_tokens_to_ids(marker) in ids and len(ids) == 3, (marker, ids)
        assert tokenizer.decode(ids, skip_special_tokens=True) == f"a{marker}b"
        assert marker not in tokenizer.all_special_tokens


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_byte_level_has_no_unknown(tokenizer):
    text = "".join(chr(c) for c in range(32, 0x250)) + "\x00\x01\x7f"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text



TOOLS = [tasks.CALCULATOR, tasks.LOOKUP_ORDER]
CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"a": 417, "b": 38}}}
SHAPES = {
    "plain": [{"role": "user", "content": "Count from 1 to 3."}, {"role": "assistant", "content": "1, 2, 3."}],
    "system, multi-turn, reasoning as a field": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Count from 1 to 3."},
        {"role": "assistant", "content": "1, 2, 3.", "reasoning_content": "Counting up."},
        {"role": "user", "content": "Repeat the word stone 2 times."},
        {"role": "assistant", "content": "stone stone", "reasoning_content": "Twice."}],
    "reasoning inline in the content": [
        {"role": "user", "content": "Spell the word bread."},
        {"role": "assistant", "content": "<think>\nLetter by letter.\n</think>\n\nb-r-e-a-d."}],
    "tool call, replies, answer": [
        {"role": "user", "content": "What is 417 times 38?"},
        {"role": "assistant", "content": "", "reasoning_content": "Use the calculator.", "tool_calls": [CALL]},
        {"role": "tool", "content": "15846"}, {"role": "tool", "content": "15846"},
        {"role": "assistant", "content": "417 times 38 is 15846."}],
    "content before two calls, null content": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Two products?"},
        {"role": "assistant", "content": "Computing.", "tool_calls": [CALL, {"function": CALL["function"]}]},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": None}],
    "multi-part text": [
        {"role": "user", "content": [{"type": "text", "text": "Count "}, {"type": "text", "text": "to 2."}]},
        {"role": "assistant", "content": "1, 2."}],
}
KWARGS = [{}, {"enable_thinking": False}, {"enable_thinking": True}, {"preserve_thinking": True}]


@pytest.fixture(scope="module")
def real_template() -> str:
    """The real Qwen3.6 template with its long tool-use instructions replaced by ours (the one
    declared difference)."""
    if not REAL_TEMPLATE.is_file():
        missing(f"the real Qwen3.6 chat template is not at {REAL_TEMPLATE} (the project's shared fixtures)")
    text = REAL_TEMPLATE.read_text()
    start = text.index("\\n\\nIf you choose to call a function")
    end = text.index("</IMPORTANT>", start) + len("</IMPORTANT>")
    return text[:start] + chat.TOOLS_INSTRUCTIONS.replace("\n", "\\n") + text[end:]


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("with_tools", [False, True])
def test_template_renders_as_the_real_qwen3_6_template(tokenizer, real_template, shape, with_tools):
    """Every shape, with and without tools, under every thinking setting, whole and as the prompt
    of its last turn: the shipped template, the pure-Python render and the real Qwen3.6 template
    agree character for character."""
    from transformers.utils.chat_template_utils import render_jinja_template

    messages, tools = SHAPES[shape], TOOLS if with_tools else None
    for kwargs in KWARGS:
        for prompt in (False, True):
            shown = messages[:-1] if prompt else messages
            real = render_jinja_template(conversations=[shown], tools=tools, chat_template=real_template,
                                         add_generation_prompt=prompt, **kwargs)[0][0]
            assert tokenizer.apply_chat_template(shown, tools=tools, tokenize=False, add_generation_prompt=prompt,
                                                 **kwargs) == real, (shape, kwargs, prompt)
            assert chat.render(shown, tools=tools, add_generation_prompt=prompt, **kwargs) == real


def test_generation_prompt_supplies_the_think_block(tokenizer):
    prompt = SHAPES["plain"][:1]
    head = "<|im_start|>user\nCount from 1 to 3.<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) == head + "<think>\n"
    assert tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=False) == head + "<think>\n\n</think>\n\n"


def test_template_agrees_with_python_render_on_the_dataset(tokenizer, train_rows):
    for row in train_rows[:200]:
        kwargs = row.get("chat_template_kwargs", {})
        assert tokenizer.apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=False, **kwargs) \
            == chat.render(row["messages"], tools=row.get("tools"), **kwargs)


def test_unknown_role_is_refused(tokenizer):
    bad = [{"role": "user", "content": "x"}, {"role": "robot", "content": "x"}]
    with pytest.raises(Exception, match="Unexpected message role"):
        tokenizer.apply_chat_template(bad, tokenize=False)
    with pytest.raises(Exception, match="Unexpected message role"):
        chat.render(bad)


def test_mask_token_never_occurs_in_data(tokenizer, train_rows, heldout_rows):
    mask_id = tokenizer.convert_tokens_to_ids(chat.MASK)
    for row in train_rows + heldout_rows:
        text = tokenizer.apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=False,
                                             **row.get("chat_template_kwargs", {}))
        assert mask_id not in tokenizer(text, add_special_tokens=False)["input_ids"], row["id"]
