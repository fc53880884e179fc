"""The shipped tokenizer: byte-level BPE in transformers' Qwen3.5 class, Qwen chat tokens and template."""

import pytest

from pipeline.toy import chat

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


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_byte_level_has_no_unknown(tokenizer):
    text = "".join(chr(c) for c in range(32, 0x250)) + "\x00\x01\x7f"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


SYSTEM_MULTI_TURN = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Count from 1 to 3."},
    {"role": "assistant", "content": "1, 2, 3."},
    {"role": "user", "content": "Repeat the word stone 2 times."},
    {"role": "assistant", "content": "stone stone"},
]


def test_chat_template_renders_exactly(tokenizer):
    expected = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nCount from 1 to 3.<|im_end|>\n"
        "<|im_start|>assistant\n1, 2, 3.<|im_end|>\n"
        "<|im_start|>user\nRepeat the word stone 2 times.<|im_end|>\n"
        "<|im_start|>assistant\nstone stone<|im_end|>\n"
    )
    assert tokenizer.apply_chat_template(SYSTEM_MULTI_TURN, tokenize=False) == expected
    assert chat.render(SYSTEM_MULTI_TURN) == expected


def test_generation_prompt_is_the_assistant_header(tokenizer):
    prompt = SYSTEM_MULTI_TURN[:2]
    rendered = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nCount from 1 to 3.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert rendered == chat.render(prompt, add_generation_prompt=True)


def test_template_agrees_with_python_render_on_the_dataset(tokenizer, train_rows):
    for row in train_rows[:200]:
        assert tokenizer.apply_chat_template(row["messages"], tokenize=False) == chat.render(row["messages"])


def test_unknown_role_is_refused(tokenizer):
    bad = [{"role": "tool", "content": "x"}]
    with pytest.raises(Exception, match="unknown role: tool"):
        tokenizer.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ValueError, match="unknown role: tool"):
        chat.render(bad)


def test_mask_token_never_occurs_in_data(tokenizer, train_rows, heldout_rows):
    mask_id = tokenizer.convert_tokens_to_ids(chat.MASK)
    for row in train_rows + heldout_rows:
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        assert mask_id not in tokenizer(text, add_special_tokens=False)["input_ids"], row["id"]
