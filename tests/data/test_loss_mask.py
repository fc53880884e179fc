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
    """Thinking off: the history turn renders bare, the last turn after the empty think block the
    generation prompt supplies; neither header nor block is a label."""
    sample = tokenize_conversation(tokenizer, CONVERSATION, IM_END, enable_thinking=False)
    assert len(sample.input_ids) == len(sample.loss_mask)
    spans = supervised_spans(sample.loss_mask)
    assert len(spans) == 2, "one supervised span per assistant turn"
    for (start, end), turn, before in zip(spans, [CONVERSATION[2], CONVERSATION[4]],
                                          ["<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n"]):
        # The span decodes to exactly the assistant content plus the closing end-of-turn token.
        assert tokenizer.decode(sample.input_ids[start:end]) == turn["content"] + IM_END
        # Just before it: the assistant header (and the supplied block), unsupervised.
        assert tokenizer.decode(sample.input_ids[:start]).endswith(before)
        # Just after it: the newline that follows <|im_end|>, unsupervised.
        assert tokenizer.decode(sample.input_ids[end:end + 1]) == "\n"
    header_and_prompts = [i for i, m in zip(sample.input_ids, sample.loss_mask) if not m]
    assert "You answer" in tokenizer.decode(header_and_prompts)


def test_boundaries_of_reasoning_and_a_tool_call(tokenizer):
    """Thinking on: the target writes its reasoning after the supplied `<think>\\n`, closes the
    block and calls the tool; the tool's reply is not a label, the answer after it is."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"a": 417, "b": 38}}}
    conversation = [{"role": "user", "content": "What is 417 times 38?"},
                    {"role": "assistant", "content": "", "reasoning_content": "I use the calculator.", "tool_calls": [call]},
                    {"role": "tool", "content": "15846"},
                    {"role": "assistant", "content": "417 times 38 is 15846.", "reasoning_content": "Got it."}]
    sample = tokenize_conversation(tokenizer, conversation, IM_END, tools=[], enable_thinking=True)
    texts = [tokenizer.decode(sample.input_ids[a:b]) for a, b in supervised_spans(sample.loss_mask)]
    assert texts == ["I use the calculator.\n</think>\n\n<tool_call>\n<function=calculator>\n<parameter=a>\n417\n"
                     "</parameter>\n<parameter=b>\n38\n</parameter>\n</function>\n</tool_call><|im_end|>",
                     "Got it.\n</think>\n\n417 times 38 is 15846.<|im_end|>"]
    kinds = [k for k in sample.kinds if k]
    assert kinds[0] == "reasoning" and "tool_call" in kinds and kinds[-1] == "end_of_turn"


def test_no_assistant_turn_means_no_supervision(tokenizer):
    sample = tokenize_conversation(tokenizer, CONVERSATION[:2], IM_END)
    assert sum(sample.loss_mask) == 0


# A template written for this test with Qwen3.x's awkward habit: the last assistant turn carries a
# <think> block, earlier ones do not, and with thinking off the generation prompt supplies an
# empty one. Rendering prefixes is then not stable, so the scan fallback must take over.
THINK_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def test_template_that_rerenders_history(tokenizer):
    import copy
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = THINK_TEMPLATE
    for thinking in (False, True):
        sample = tokenize_conversation(tok, CONVERSATION, IM_END, enable_thinking=thinking)
        spans = supervised_spans(sample.loss_mask)
        texts = [tok.decode(sample.input_ids[a:b]) for a, b in spans]
        assert len(spans) == 2
        assert texts[0] == CONVERSATION[2]["content"] + IM_END
        # With thinking off the generation prompt supplies the empty think block: not a label.
        # With thinking on the model writes it itself: supervised.
        think = "" if not thinking else "<think>\n\n</think>\n\n"
        assert texts[1] == think + CONVERSATION[4]["content"] + IM_END, (thinking, texts[1])
