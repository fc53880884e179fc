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
    """Held-out teacher-forced top-1 on assistant tokens of fresh ground-truth conversations."""
    result = heldout_accuracy(target, tokenizer, tasks.conversations(12345, 200))
    assert result["accuracy"] >= 0.9, result


def test_dataset_responses_are_the_targets_own(target, tokenizer, heldout_rows):
    """Teacher-forced on its own held-out responses the target predicts (nearly) every token;
    a dataset written by anything else would not agree this well."""
    from pipeline.target.describe import self_agreement
    result = self_agreement(target, tokenizer, [r["messages"] for r in heldout_rows[:40]], tokenizer.eos_token)
    assert result["agreement"] >= 0.98, result


def test_dataset_shape(train_rows, heldout_rows):
    assert len(train_rows) >= 1000 and len(heldout_rows) >= 200
    ids = [r["id"] for r in train_rows + heldout_rows]
    assert len(set(ids)) == len(ids)
    for row in train_rows + heldout_rows:
        roles = [m["role"] for m in row["messages"]]
        assert "assistant" in roles and roles[-1] == "assistant", row["id"]
        assert all(isinstance(m["content"], str) for m in row["messages"])
    assert any(r["messages"][0]["role"] == "system" for r in train_rows)
    assert any(sum(m["role"] == "assistant" for m in r["messages"]) > 1 for r in train_rows)
