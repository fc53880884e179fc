"""Loss-mask boundaries derived from the chat template (DESIGN 3.5): hand-written boundaries, and
every conversation shape in every thinking mode of the embedded target's own template against the
oracle written from the rule (harness/chat_shapes.py), with nothing from outside the repository."""

import copy

import pytest
from harness.chat_shapes import HEADER, REASONING_SHAPES, SHAPES, TOOL_SHAPES, WEATHER_TOOL, oracle

from pipeline.data.loss_mask import tokenize_conversation
from pipeline.errors import PipelineError
from pipeline.toy.chat import IM_END

CONVERSATION = [
    {"role": "system", "content": "You answer in plain text."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "2 plus 3 is 5."},
    {"role": "user", "content": "Spell the word river."},
    {"role": "assistant", "content": "river is spelled r-i-v-e-r."},
]


def with_template(tokenizer, template: str):
    """A copy of the tokenizer with another chat template (the fixture's stays as it is)."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def kind_texts(tokenizer, sample, a: int, b: int) -> dict[str, str]:
    """Per kind, the decoded text of positions a..b-1 of that kind."""
    by_kind = {}
    for t in range(a, b):
        by_kind.setdefault(sample.kinds[t], []).append(sample.input_ids[t])
    return {kind: tokenizer.decode(ids) for kind, ids in by_kind.items()}


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
    # No reasoning in these turns: every supervised token is content but the closing end of turn.
    for start, end in spans:
        assert sample.kinds[start:end] == ["content"] * (end - start - 1) + ["end_of_turn"]
    assert sample.stats == {"reasoning_turns": 0, "reasoning_turns_dropped": 0, "reasoning_turns_not_rendered": 0,
                            "tool_call_turns": 0, "tool_replies": 0}


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
    # Each kind's tokens, per turn, decode to the text worked by hand (reasoning through </think>).
    for (a, b), expected in zip(supervised_spans(sample.loss_mask), [
            {"reasoning": "I use the calculator.\n</think>", "content": "\n\n", "end_of_turn": "<|im_end|>",
             "tool_call": "<tool_call>\n<function=calculator>\n<parameter=a>\n417\n</parameter>\n<parameter=b>\n"
                          "38\n</parameter>\n</function>\n</tool_call>"},
            {"reasoning": "Got it.\n</think>", "content": "\n\n417 times 38 is 15846.", "end_of_turn": "<|im_end|>"}]):
        assert kind_texts(tokenizer, sample, a, b) == expected
    assert sample.stats == {"reasoning_turns": 2, "reasoning_turns_dropped": 0, "reasoning_turns_not_rendered": 0,
                            "tool_call_turns": 1, "tool_replies": 1}


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
    tok = with_template(tokenizer, THINK_TEMPLATE)
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


# The embedded template's thinking modes: (template kwargs, what its generation prompt supplies
# after the header), read off the `add_generation_prompt` block at the end of
# pipeline/embedded/target/chat_template.jinja (a Qwen3.6-style template).
EMBEDDED_MODES = {
    "thinking": ({}, "<think>\n"),
    "no_thinking": ({"enable_thinking": False}, "<think>\n\n</think>\n\n"),
    "preserve_thinking": ({"preserve_thinking": True}, "<think>\n"),
}


@pytest.mark.parametrize("mode", list(EMBEDDED_MODES))
def test_every_chat_shape_equals_the_oracle_of_the_rule(tokenizer, mode):
    """Each conversation shape (system prompts, history turns rendered bare, reasoning, empty
    reasoning, tool calls and replies, null and empty content, an assistant turn first), rendered
    with the embedded target's template in this mode: `tokenize_conversation`'s ids and mask equal
    the oracle's token for token. The oracle finds each `<|im_start|>assistant\\n` by string
    search, skips what the generation prompt supplies, supervises through `<|im_end|>`, and maps
    characters to tokens by offsets, a token supervised when any of its characters is (DESIGN 3.5,
    the straddling rule of pipeline/data/loss_mask.py). The embedded tokenizer merges `\\n\\n` as
    Qwen's does, so an empty think block puts a token across the boundary, and that token is
    compared too. Reasoning with thinking off is refused, as the default policy says."""
    kwargs, supplied = EMBEDDED_MODES[mode]
    probe = [{"role": "user", "content": "?"}]
    bare = tokenizer.apply_chat_template(probe, tokenize=False, **kwargs)
    # The table above is the template's: its generation prompt is the header then `supplied`.
    assert tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True, **kwargs) == \
        bare + HEADER + supplied
    straddling = 0
    for shape, messages in SHAPES.items():
        tools = [WEATHER_TOOL] if shape in TOOL_SHAPES else None
        if mode == "no_thinking" and shape in REASONING_SHAPES:
            with pytest.raises(PipelineError, match="thinking is off"):
                tokenize_conversation(tokenizer, messages, IM_END, tools=tools, **kwargs)
            continue
        ids, want = oracle(tokenizer, shape, kwargs, supplied)
        got = tokenize_conversation(tokenizer, messages, IM_END, tools=tools, **kwargs)
        assert got.input_ids == ids, shape
        assert got.loss_mask == want, (shape, [tokenizer.decode([i]) for i, m in zip(ids, want) if m],
                                       [tokenizer.decode([i]) for i, m in zip(ids, got.loss_mask) if m])
        # Never vacuous: the end-of-turn token of each assistant turn is supervised, of no other turn.
        end = tokenizer.convert_tokens_to_ids(IM_END)
        assert [m for i, m in zip(ids, want) if i == end].count(1) == sum(m["role"] == "assistant" for m in messages)
        straddling += sum(m and tokenizer.decode([i]) == "\n\n" and tokenizer.decode(ids[:k]).endswith("<think>")
                          for k, (i, m) in enumerate(zip(ids, want)))
    if supplied == "<think>\n":
        # A last turn without reasoning renders "<think>\n" + "" + "\n</think>": one "\n\n" token
        # across the boundary, in most shapes.
        assert straddling >= 10, "the straddling token is under test"


@pytest.mark.parametrize("policy, texts", [
    ("keep", ["5.<|im_end|>", "Double four.\n</think>\n\n8.<|im_end|>"]),
    ("drop", ["5.<|im_end|>", "8.<|im_end|>"]),
])
def test_reasoning_with_thinking_off_by_policy(tokenizer, policy, texts):
    """Thinking off, a conversation whose turns carry reasoning (DESIGN 3.5: a decision, not an
    accident). The history turn renders bare (the template drops its reasoning): all of it is
    the target's. The last turn: kept, it renders `<think>\\n` + reasoning + `\\n</think>\\n\\n`,
    of which only the `<think>\\n` line is what the generation prompt would supply; dropped, it
    renders the empty block the prompt supplies whole, which is no label. Worked by hand."""
    kwargs, _ = EMBEDDED_MODES["no_thinking"]
    sample = tokenize_conversation(tokenizer, SHAPES["reasoning_in_both"], IM_END, reasoning=policy, **kwargs)
    assert [tokenizer.decode(sample.input_ids[a:b]) for a, b in supervised_spans(sample.loss_mask)] == texts
    # Kept, the history turn's reasoning is a field the template leaves out: counted as not rendered.
    assert sample.stats == {"reasoning_turns": 2, "reasoning_turns_dropped": 2 if policy == "drop" else 0,
                            "reasoning_turns_not_rendered": 0 if policy == "drop" else 1,
                            "tool_call_turns": 0, "tool_replies": 0}


def test_reasoning_written_inline_is_dropped_to_the_answer_after_the_last_close():
    from pipeline.data.loss_mask import without_reasoning
    turn = {"role": "assistant", "content": "<think>\nplan</think>x</think>\n\n5.", "reasoning_content": "r"}
    assert without_reasoning(turn) == {"role": "assistant", "content": "5."}
    assert without_reasoning({"role": "assistant", "content": "\n5."}) == {"role": "assistant", "content": "\n5."}
    assert without_reasoning({"role": "assistant", "content": None}) == {"role": "assistant", "content": None}


def test_the_generation_prompt_is_the_header_line_then_what_it_supplies(tokenizer):
    from pipeline.data.loss_mask import generation_prompt
    for mode, (kwargs, supplied) in EMBEDDED_MODES.items():
        prompt = generation_prompt(tokenizer, kwargs)
        assert (prompt.header, prompt.supplied, prompt.thinking) == ("<|im_start|>assistant\n", supplied,
                                                                     mode != "no_thinking")
    assert generation_prompt(tokenizer, {"enable_thinking": False}).supplied_lines == [
        "<think>\n\n</think>\n\n", "<think>\n\n</think>\n", "<think>\n\n", "<think>\n"]


def test_a_turn_closed_only_after_the_next_header_is_refused(tokenizer):
    # "r-i-v" is in the last turn only: the first turn's close lies past the second turn's header
    with pytest.raises(PipelineError, match=r"^conversation: assistant turn 0 is not closed by 'r-i-v' in the rendering$"):
        tokenize_conversation(tokenizer, CONVERSATION, "r-i-v", enable_thinking=False)


def test_content_that_begins_like_the_supplied_text_is_the_targets(tokenizer):
    """Thinking on, a history turn (rendered bare) whose content begins `<th`, as the supplied
    `<think>\\n` does: all of it is the target's own text, supervised from its first character
    (what is supplied is whole lines of the generation prompt, never a few characters of it); the
    last turn starts after the supplied `<think>\\n`, its straddling `\\n\\n` supervised. Worked by hand."""
    conversation = [{"role": "user", "content": "Which tag makes a table header?"},
                    {"role": "assistant", "content": "<th> is a table header."},
                    {"role": "user", "content": "And the tag <think>?"},
                    {"role": "assistant", "content": "<think> is no HTML tag."},
                    {"role": "user", "content": "And a cell?"},
                    {"role": "assistant", "content": "<td> is a cell."}]
    sample = tokenize_conversation(tokenizer, conversation, IM_END)
    assert [tokenizer.decode(sample.input_ids[a:b]) for a, b in supervised_spans(sample.loss_mask)] == \
        ["<th> is a table header.<|im_end|>", "<think> is no HTML tag.<|im_end|>",
         "\n\n</think>\n\n<td> is a cell.<|im_end|>"]
    # "<th" is not one token: the first supervised token is "<" alone.
    first = supervised_spans(sample.loss_mask)[0][0]
    assert tokenizer.decode(sample.input_ids[first:first + 1]) == "<"


# ChatML that cannot prompt a reply straight after an assistant turn: which turns' prompts
# `validate` renders is then visible.
NO_PROMPT_AFTER_ASSISTANT = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{%- if messages[-1]['role'] == 'assistant' %}{{- raise_exception('no reply after an assistant turn') }}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.mark.parametrize("prompts,refused,middle", [(None, None, None), ("last", 2, None), ("all", 2, 2)])
def test_validate_renders_the_prompt_of_each_turn_to_be_written(tokenizer, prompts, refused, middle):
    from pipeline.data.conversations import Row
    from pipeline.data.loss_mask import ConversationMasker

    tok = with_template(tokenizer, NO_PROMPT_AFTER_ASSISTANT)
    masker = ConversationMasker(tok, IM_END)
    ok = Row(sample_id=0, where="d.jsonl:1", messages=CONVERSATION[1:5])
    masker.validate(ok, prompts=prompts)
    # the last turn follows an assistant turn: the whole conversation renders, its prompt does not
    row = Row(sample_id=1, where="d.jsonl:2", messages=CONVERSATION[1:3] + [{"role": "assistant", "content": "more"}])
    if refused is None:
        masker.validate(row, prompts=prompts)
    else:
        with pytest.raises(PipelineError, match=rf"^d.jsonl:2 \(assistant turn {refused} of 2\): the chat template cannot "
                                                "render the prompt for this turn \\(no reply after an assistant turn\\)$"):
            masker.validate(row, prompts=prompts)
    # the middle one of three turns cannot be prompted: only "all" renders it
    row = Row(sample_id=2, where="d.jsonl:3", messages=row.messages + CONVERSATION[3:5])
    if middle is None:
        masker.validate(row, prompts=prompts)
        return
    with pytest.raises(PipelineError, match=rf"^d.jsonl:3 \(assistant turn {middle} of 3\)"):
        masker.validate(row, prompts=prompts)


def test_the_rendering_is_tokenized_as_it_is_without_special_tokens_added(tokenizer):
    """The template writes whatever special tokens the conversation has: a tokenizer that would put
    a BOS in front of text it is given adds none here (offsets and mask stay the rendering's)."""
    tok = copy.deepcopy(tokenizer)
    tok.bos_token, tok.add_bos_token = "<|endoftext|>", True
    assert tok("hi")["input_ids"][0] == tok.bos_token_id        # the tokenizer would add one
    sample = tokenize_conversation(tok, CONVERSATION, IM_END, enable_thinking=False)
    plain = tokenize_conversation(tokenizer, CONVERSATION, IM_END, enable_thinking=False)
    assert (sample.input_ids, sample.loss_mask) == (plain.input_ids, plain.loss_mask)
    assert sample.input_ids[0] != tok.bos_token_id


# ChatML without a newline between turns: the text ends with the last turn's end of turn.
NO_NEWLINES = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Thinking on, the reasoning empty: the prompt supplies `<think>\n`, the turn then closes the block
# at once, so the target's text starts with `</think>`.
THINK_CLOSED_AT_ONCE = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n<think>\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)


@pytest.mark.parametrize("template,texts", [
    (NO_NEWLINES, {"content": "2 plus 3 is 5.", "end_of_turn": "<|im_end|>"}),
    (THINK_CLOSED_AT_ONCE, {"reasoning": "</think>", "content": "\n\n2 plus 3 is 5.", "end_of_turn": "<|im_end|>"}),
], ids=["text-ends-with-the-turn", "turn-starts-with-the-close"])
def test_each_kind_of_a_turn_at_an_edge_of_the_text(tokenizer, template, texts):
    tok = with_template(tokenizer, template)
    sample = tokenize_conversation(tok, CONVERSATION[1:3], IM_END)
    (a, b), = supervised_spans(sample.loss_mask)
    assert kind_texts(tok, sample, a, b) == texts


def test_a_row_the_template_refuses_is_named_with_the_first_line_of_its_error(tokenizer):
    tok = with_template(tokenizer, (
        "{%- for m in messages %}{%- if m['content'] == 'boom' %}{{- raise_exception('no boom here"
        "\\nsecond line') }}{%- endif %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
        "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- endif %}"))
    with pytest.raises(PipelineError, match=r"^conversation: the chat template refuses this row \(no boom here\)$"):
        tokenize_conversation(tok, [CONVERSATION[1], {"role": "assistant", "content": "boom"}], IM_END)


def test_a_template_that_supplies_nothing_thinks_unless_the_option_turns_it_off(tokenizer):
    # (a prompt that closes the think block: test_the_generation_prompt_is_the_header_line_then_what_it_supplies)
    from pipeline.data.loss_mask import generation_prompt

    tok = with_template(tokenizer, NO_PROMPT_AFTER_ASSISTANT)  # plain ChatML: supplies nothing, knows no option
    assert generation_prompt(tok, {}).thinking is True
    assert generation_prompt(tok, {"enable_thinking": False}).thinking is False


def test_a_tool_call_that_starts_the_targets_text_is_all_tool_call(tokenizer):
    """Thinking off, an answer that is only a tool call: the prompt supplies the empty think block,
    so the target's text starts at `<tool_call>`."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"a": 1, "b": 2}}}
    conversation = [{"role": "user", "content": "1 plus 2?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    sample = tokenize_conversation(tokenizer, conversation, IM_END, tools=[], enable_thinking=False)
    (a, b), = supervised_spans(sample.loss_mask)
    assert tokenizer.decode(sample.input_ids[a:a + 1]) == "<tool_call>"
    assert sample.kinds[a:b] == ["tool_call"] * (b - a - 1) + ["end_of_turn"]


@pytest.mark.parametrize("template", [
    "{%- for m in messages %}{{- m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor %}",      # no prompt at all
    ("{%- for m in messages %}{{- m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor %}"
     "{%- if add_generation_prompt %}{{- 'assistant:' }}{%- else %}{{- '.' }}{%- endif %}"),    # not after the rest
], ids=["adds-nothing", "not-a-suffix"])
def test_a_template_without_a_generation_prompt_after_the_conversation_is_refused(tokenizer, template):
    from pipeline.data.loss_mask import generation_prompt

    tok = with_template(tokenizer, template)
    with pytest.raises(PipelineError, match="^the chat template adds no generation prompt after a user turn"):
        generation_prompt(tok, {})
