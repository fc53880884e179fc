"""Byte-level BPE tokenizer for the tiny target, wrapped in transformers' real Qwen3.5 class.

Same pre-tokenization as Qwen (regex split, then byte-level), merges learned on the synthetic
corpus, and Qwen's chat special tokens appended after the learned vocabulary, as in Qwen's
own vocabulary layout; then the think and tool markers (`<think>`, `<tool_call>`, ...) as added
tokens that are not special (single tokens the model writes and decoding keeps, as in Qwen's
tokenizer). The markers are taken out of the merge-learning text, so no merge is spent on
spelling them. Training is deterministic for a given corpus.
"""

from __future__ import annotations

import json

from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers, trainers

from pipeline.toy.chat import CHAT_TEMPLATE, END_OF_TEXT, IM_END, MARKERS, SPECIAL_TOKENS
from pipeline.target_model.internals import qwen3_5_pretokenizer

PRETOKENIZE_REGEX, Qwen3_5Tokenizer = qwen3_5_pretokenizer()


def _byte_level_pretokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def train_tokenizer(texts: list[str], num_merged_tokens: int) -> Qwen3_5Tokenizer:
    """Learn `num_merged_tokens` BPE tokens (on top of the 256 bytes) from `texts`."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = _byte_level_pretokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + num_merged_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    def plain(text: str) -> str:
        for token in SPECIAL_TOKENS + MARKERS:
            text = text.replace(token, "\n")
        return text

    bpe.train_from_iterator([plain(t) for t in texts], trainer=trainer)
    state = json.loads(bpe.to_str())["model"]
    vocab: dict[str, int] = dict(sorted(state["vocab"].items(), key=lambda kv: kv[1]))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen3_5Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=END_OF_TEXT,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": [t for t in SPECIAL_TOKENS if t != END_OF_TEXT]})
    tokenizer.add_tokens([AddedToken(m, normalized=False, special=False) for m in MARKERS])
    tokenizer.model_max_length = 4096
    return tokenizer
