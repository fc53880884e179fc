"""The DFlash drafter: its attention mask, batched anchors, frozen target modules and export
(DESIGN 2, 8). Its training blocks, loss and metrics: tests/training/test_blocks.py."""

import pytest
import torch

from pipeline.drafter.model import DFlashDrafter, DrafterConfig
from pipeline.training.blocks import block_inputs

H, V, B = 32, 50, 4


def tiny_drafter(seed=0):
    torch.manual_seed(seed)
    config = DrafterConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, vocab_size=V, target_layer_ids=[1, 3, 5],
                           num_target_layers=8, mask_token_id=V - 1, block_size=B)
    return DFlashDrafter(config, embed=torch.nn.Embedding(V, H), lm_head=torch.nn.Linear(H, V, bias=False)).eval()


def test_block_sees_only_earlier_context_and_itself():
    drafter = tiny_drafter()
    t = 12
    taps = torch.randn(1, t, 3, H)
    ids = torch.randint(0, V - 1, (t,))
    anchors = torch.tensor([3, 7])
    block_ids, pos, allowed = block_inputs(ids, anchors, B, drafter.config.mask_token_id)
    with torch.no_grad():
        base = drafter(taps, block_ids[None], pos[None], allowed[None])
        # Context at or after an anchor is invisible to its block (ctx_pos < a).
        later = taps.clone()
        later[:, 3:] += 5.0
        out = drafter(later, block_ids[None], pos[None], allowed[None])
        torch.testing.assert_close(out[:, :B], base[:, :B])
        assert not torch.allclose(out[:, B:], base[:, B:])
        # Context before the anchor matters.
        earlier = taps.clone()
        earlier[:, 2] += 5.0
        assert not torch.allclose(drafter(earlier, block_ids[None], pos[None], allowed[None])[:, :B], base[:, :B])
        # Blocks never see each other.
        other = block_ids.clone()
        other[B] = (other[B] + 1) % (V - 1)
        out = drafter(taps, other[None], pos[None], allowed[None])
        torch.testing.assert_close(out[:, :B], base[:, :B])


def test_batched_anchors_equal_one_anchor_at_a_time():
    drafter = tiny_drafter()
    t = 14
    taps, ids = torch.randn(1, t, 3, H), torch.randint(0, V - 1, (t,))
    anchors = torch.tensor([1, 5, 9])
    with torch.no_grad():
        block_ids, pos, allowed = block_inputs(ids, anchors, B, drafter.config.mask_token_id)
        together = drafter(taps, block_ids[None], pos[None], allowed[None])
        for j, a in enumerate(anchors):
            bi, p, al = block_inputs(ids, a[None], B, drafter.config.mask_token_id)
            alone = drafter(taps, bi[None], p[None], al[None])
            torch.testing.assert_close(together[:, j * B:(j + 1) * B], alone, atol=1e-5, rtol=1e-5)


def test_sequences_batched_together_equal_each_alone():
    drafter = tiny_drafter()
    t = 14
    taps, ids = torch.randn(2, t, 3, H), torch.randint(0, V - 1, (2, t))
    inputs = [block_inputs(ids[i], torch.tensor(anchors), B, drafter.config.mask_token_id)
              for i, anchors in enumerate(([2, 9], [5, 11]))]
    with torch.no_grad():
        together = drafter(taps, *(torch.stack([x[k] for x in inputs]) for k in range(3)))
        for i, (block_ids, pos, allowed) in enumerate(inputs):
            alone = drafter(taps[i:i + 1], block_ids[None], pos[None], allowed[None])
            torch.testing.assert_close(together[i:i + 1], alone, atol=1e-5, rtol=1e-5)


def test_frozen_embedding_and_head_are_not_parameters():
    drafter = tiny_drafter()
    names = {n for n, _ in drafter.named_parameters()}
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.1.mlp.down_proj.weight"} <= names
    # and frozen: no gradient is ever kept for the target's embedding or its (248k-row) head
    assert not drafter.lm_head_weight.requires_grad and not drafter._frozen["embed"].weight.requires_grad


def test_a_dtype_or_device_move_takes_the_frozen_modules_along():
    """`.double()` (as `.to(device)`) moves every trainable layer and the frozen, shared embedding
    and head too: they are kept out of the module tree, so `_apply` has to carry them."""
    drafter = tiny_drafter().double()
    assert {p.dtype for p in drafter.parameters()} == {torch.float64}
    assert drafter._frozen["embed"].weight.dtype == drafter.lm_head_weight.dtype == torch.float64


def test_a_fresh_drafters_linear_layers_keep_the_scale_of_their_input():
    """Each trainable linear layer starts N(0, 1/fan_in), so a unit-scale input gives unit-scale
    features through every layer of an untrained drafter (torch's default would give a third of
    the variance per layer). 10% covers the sampling error of the smallest matrix (~2%)."""
    drafter = tiny_drafter()
    layers = [m for m in drafter.modules() if isinstance(m, torch.nn.Linear)]
    assert len(layers) == 1 + 2 * 7  # fc, and per layer q k v o gate up down
    for m in layers:
        std = m.weight.std().item() * m.in_features ** 0.5
        assert 0.9 < std < 1.1, (m, std)


def test_a_draft_vocabulary_size_without_its_ids_is_refused_saying_which():
    from dataclasses import replace

    from pipeline.drafter.vocab import DraftVocab

    config = tiny_drafter().config
    embed, head = torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False)
    with pytest.raises(ValueError, match="^draft_vocab_size 3 but no draft vocabulary given$"):
        DFlashDrafter(replace(config, draft_vocab_size=3), embed=embed, lm_head=head)
    with pytest.raises(ValueError, match="^draft_vocab_size None but 3 draft ids given$"):
        DFlashDrafter(config, embed=embed, lm_head=head, draft_vocab=DraftVocab(torch.tensor([1, 4, 6]), V))


def test_the_block_size_rule_is_the_configs_and_a_shorter_block_is_a_new_config():
    """DrafterConfig is the one place a block is checked: as built (and so by dataclasses.replace),
    and by `at_block`, which cuts a trained block short in a new config and never grows it; eval
    and its view of the drafter (drafting_blocks_of) leave the loaded drafter as trained."""
    from dataclasses import replace

    from pipeline.eval.speculative_decoding import drafting_blocks_of

    drafter = tiny_drafter()
    trained = drafter.config
    for bad in (1, 0, -3):
        with pytest.raises(ValueError, match=rf"^block_size must be >= 2 \(the anchor and a draft slot\), got {bad}$"):
            replace(trained, block_size=bad)
    for bad in (B + 1, 1, 0):
        with pytest.raises(ValueError, match=rf"^--block-size must be in 2..{B} \(the block this drafter was trained on\), got {bad}$"):
            trained.at_block(bad, name="--block-size")
    short = trained.at_block(2)
    assert short.block_size == 2 and trained.block_size == B and short is not trained
    assert replace(short, block_size=B) == trained      # nothing else differs
    view = drafting_blocks_of(drafter, 2)
    assert view.config == short and drafter.config is trained and trained.block_size == B
    assert view.fc.weight is drafter.fc.weight           # the same weights, not a copy
    assert drafting_blocks_of(drafter, B) is drafter     # at its own block: the drafter itself


def test_export_round_trip_and_names(tmp_path):
    import json

    from safetensors import safe_open

    from pipeline.drafter.export import export_drafter, load_drafter
    from pipeline.errors import PipelineError

    drafter = tiny_drafter(seed=3)
    out = tmp_path / "drafter"
    export_drafter(drafter, out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    # No mask_token: a config built without the target's tokenizer has no text for its mask id.
    assert config["dflash_config"] == {"target_layer_ids": [1, 3, 5], "mask_token_id": V - 1, "block_size": B}
    assert config["block_size"] == B and config["num_target_layers"] == 8
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    want = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(2):
        want |= {f"layers.{i}.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        want |= {f"layers.{i}.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
        want |= {f"layers.{i}.{p}.weight" for p in ("input_layernorm", "post_attention_layernorm")}
    assert names == want
    loaded = load_drafter(out, embed=drafter._frozen["embed"], lm_head=drafter._frozen["lm_head"]).eval()
    ids, anchors = torch.randint(0, V - 1, (10,)), torch.tensor([2, 5])
    block_ids, pos, allowed = block_inputs(ids, anchors, B, V - 1)
    taps = torch.randn(1, 10, 3, H)
    with torch.no_grad():
        torch.testing.assert_close(loaded(taps, block_ids[None], pos[None], allowed[None]),
                                   drafter(taps, block_ids[None], pos[None], allowed[None]))
    config["num_hidden_layers"] = 3
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(PipelineError, match="config.json: not a DFlash drafter config .*layer_types has 2 entries for 3"):
        load_drafter(out, embed=drafter._frozen["embed"], lm_head=drafter._frozen["lm_head"])
    config["layer_types"] = ["full_attention"] * 3  # a consistent config that the weights do not match
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(PipelineError, match="does not match its config"):
        load_drafter(out, embed=drafter._frozen["embed"], lm_head=drafter._frozen["lm_head"])


def test_the_attention_path_follows_the_request_and_the_device():
    from pipeline.drafter.attention_rule import attention_path

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert [attention_path("auto", cpu), attention_path("auto", cuda)] == ["split", "flex"]
    assert [attention_path(p, d) for p in ("flex", "split") for d in (cpu, cuda)] == ["flex", "flex", "split", "split"]
    with pytest.raises(ValueError, match=r"^attention path must be one of \('auto', 'flex', 'split'\), got 'dense'$"):
        attention_path("dense", cpu)
