"""The shipped tiny target: the real transformers class, both layer kinds, the tap convention,
and a model that has actually learned its tasks."""

import torch

from pipeline.toy import tasks
from pipeline.toy.train import heldout_accuracy


def test_loads_as_qwen3_5_for_causal_lm(target):
    assert type(target).__name__ == "Qwen3_5ForCausalLM"
    assert type(target).__module__ == "transformers.models.qwen3_5.modeling_qwen3_5"
    kinds = target.config.layer_types
    assert {"linear_attention", "full_attention"} <= set(kinds)
    assert len(kinds) == target.config.num_hidden_layers == 8
    # Both kinds are really instantiated, not just named in the config.
    assert hasattr(target.model.layers[0], "linear_attn")
    assert hasattr(target.model.layers[3], "self_attn")
    assert 1_000_000 <= sum(p.numel() for p in target.parameters()) <= 3_000_000


def test_hidden_states_convention(target, tokenizer):
    """hidden_states has L+1 entries; [i+1] is the output of decoder layer i; the last one is
    after the final norm and is what lm_head reads (why the last layer is never a tap)."""
    ids = tokenizer("Count from 3 to 9.", return_tensors="pt")["input_ids"]
    captured = {}
    hooks = [layer.register_forward_hook(lambda m, a, out, i=i: captured.__setitem__(i, out[0] if isinstance(out, tuple) else out))
             for i, layer in enumerate(target.model.layers)]
    try:
        with torch.no_grad():
            out = target(input_ids=ids, output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    num_layers = target.config.num_hidden_layers
    assert len(out.hidden_states) == num_layers + 1
    torch.testing.assert_close(out.hidden_states[0], target.model.embed_tokens(ids))
    for i in range(num_layers - 1):
        torch.testing.assert_close(out.hidden_states[i + 1], captured[i])
    last = out.hidden_states[num_layers]
    torch.testing.assert_close(last, target.model.norm(captured[num_layers - 1]))
    torch.testing.assert_close(out.logits, target.lm_head(last))


def test_learned_its_tasks(target, tokenizer):
    """Held-out teacher-forced top-1 on the supervised tokens of fresh ground-truth conversations,
    overall and for each kind of token the target writes."""
    result = heldout_accuracy(target, tokenizer, tasks.conversations(12345, 200))
    assert result["accuracy"] >= 0.9, result
    assert set(result["by_kind"]) == {"reasoning", "content", "tool_call", "end_of_turn"}, result
    assert min(result["by_kind"].values()) >= 0.8, result


def _answer(target, tokenizer, messages, tools=None, **kwargs) -> str:
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True, **kwargs)["input_ids"]
    out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=80, do_sample=False,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:])


def test_thinks_in_thinking_mode_only(target, tokenizer):
    """Thinking on: the generation prompt opens `<think>` and the target writes one sentence of
    reasoning, closes the block and answers; thinking off: it answers at once."""
    ask = [{"role": "user", "content": "Spell the word river."}]
    thinking = _answer(target, tokenizer, ask)
    assert thinking == "I spell river letter by letter.\n</think>\n\nriver is spelled r-i-v-e-r.<|im_end|>", thinking
    plain = _answer(target, tokenizer, ask, enable_thinking=False)
    assert plain == "river is spelled r-i-v-e-r.<|im_end|>", plain


def test_calls_a_tool_reads_the_reply_and_answers(target, tokenizer):
    """Given the tools, a product it cannot compute goes to the calculator in the template's call
    format; the reply (whatever it says) comes back in the answer. Without a task that needs a
    tool, it answers directly though tools are given."""
    from pipeline.generate.assistant import parse_assistant

    tools = tasks.TOOL_SCHEMAS
    ask = [{"role": "user", "content": "What is 417 times 38?"}]
    call = parse_assistant(_answer(target, tokenizer, ask, tools, enable_thinking=False).removesuffix("<|im_end|>"),
                           "<think>\n\n</think>\n\n").message
    assert call.get("tool_calls") == [{"type": "function", "function": {"name": "calculator",
                                                                        "arguments": {"a": 417, "b": 38}}}], call
    reply = ask + [call, {"role": "tool", "content": "12345"}]      # not the true product: it must read it
    assert _answer(target, tokenizer, reply, tools, enable_thinking=False) == "417 times 38 is 12345.<|im_end|>"
    direct = _answer(target, tokenizer, [{"role": "user", "content": "Spell the word lemon."}], tools, enable_thinking=False)
    assert direct == "lemon is spelled l-e-m-o-n.<|im_end|>", direct


def test_dataset_responses_are_the_targets_own(target, tokenizer, heldout_rows):
    """Teacher-forced on its own held-out responses the target predicts (nearly) every token;
    a dataset written by anything else would not agree this well."""
    from pipeline.data.conversations import parse_row
    from pipeline.data.self_agreement import self_agreement
    rows = [parse_row(i, f"heldout.jsonl:{i + 1}", r) for i, r in enumerate(heldout_rows[:40])]
    result = self_agreement(target, tokenizer, rows, tokenizer.eos_token)
    assert result["agreement"] >= 0.98, result


def test_dataset_shape(train_rows, heldout_rows):
    """1,000 / 200 rows of every kind: thinking on and off, tools given and called, replies
    answered, a call left pending, several user turns, a system prompt."""
    assert len(train_rows) == 1000 and len(heldout_rows) == 200
    ids = [r["id"] for r in train_rows + heldout_rows]
    assert len(set(ids)) == len(ids)
    for row in train_rows + heldout_rows:
        roles = [m["role"] for m in row["messages"]]
        assert roles[-1] == "assistant" and set(roles) <= {"system", "user", "assistant", "tool"}, row["id"]
        assert isinstance(row["chat_template_kwargs"]["enable_thinking"], bool), row["id"]
        assert all(isinstance(m["content"], str) for m in row["messages"])
    for rows in (train_rows, heldout_rows):
        kinds = {"thinking": any(r["chat_template_kwargs"]["enable_thinking"] for r in rows),
                 "not thinking": any(not r["chat_template_kwargs"]["enable_thinking"] for r in rows),
                 "tools": any(r.get("tools") for r in rows),
                 "tool reply": any(m["role"] == "tool" for r in rows for m in r["messages"]),
                 "pending call": any(r["messages"][-1].get("tool_calls") for r in rows),
                 "multi-turn": any(sum(m["role"] == "user" for m in r["messages"]) > 1 for r in rows),
                 "system": any(r["messages"][0]["role"] == "system" for r in rows)}
        assert all(kinds.values()), kinds
