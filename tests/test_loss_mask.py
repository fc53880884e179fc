"""Loss-mask boundaries derived from the chat template (DESIGN 3.5)."""

from pipeline.data.loss_mask import tokenize_conversation
from pipeline.toy.chat import IM_END

CONVERSATION = [
    {"role": "system", "content": "You answer in plain text."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "2 plus 3 is 5."},
    {"role": "user", "content": "Spell the word river."},
    {"role": "assistant", "content": "river is spelled r-i-v-e-r."},
]


def supervised_spans(mask):
    spans, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_boundaries_system_and_multi_turn(tokenizer):
    sample = tokenize_conversation(tokenizer, CONVERSATION, IM_END)
    assert len(sample.input_ids) == len(sample.loss_mask)
    spans = supervised_spans(sample.loss_mask)
    assert len(spans) == 2, "one supervised span per assistant turn"
    for (start, end), turn in zip(spans, [CONVERSATION[2], CONVERSATION[4]]):
        # The span decodes to exactly the assistant content plus the closing end-of-turn token.
        assert tokenizer.decode(sample.input_ids[start:end]) == turn["content"] + IM_END
        # Just before it: the assistant header, unsupervised.
        assert tokenizer.decode(sample.input_ids[start - 3:start]) == "<|im_start|>assistant\n"
        # Just after it: the newline that follows <|im_end|>, unsupervised.
        assert tokenizer.decode(sample.input_ids[end:end + 1]) == "\n"
    header_and_prompts = [i for i, m in zip(sample.input_ids, sample.loss_mask) if not m]
    assert "You answer" in tokenizer.decode(header_and_prompts)


def test_no_assistant_turn_means_no_supervision(tokenizer):
    sample = tokenize_conversation(tokenizer, CONVERSATION[:2], IM_END)
    assert sum(sample.loss_mask) == 0
