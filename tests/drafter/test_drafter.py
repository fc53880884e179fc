"""The DFlash drafter's blocks, mask, loss and metrics (DESIGN 2, 3.3, 3.4, 4)."""

import math

import pytest
import torch

from pipeline.drafter.model import DFlashDrafter, DrafterConfig
from pipeline.training.blocks import (block_inputs, block_targets, decay_weights, default_gamma, sample_anchors,
                                      valid_anchors)
from pipeline.training.metrics import block_metrics
from pipeline.training.objectives import weighted_ce

H, V, B = 32, 50, 4


def tiny_drafter(seed=0):
    torch.manual_seed(seed)
    config = DrafterConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, vocab_size=V, target_layer_ids=[1, 3, 5],
                           num_target_layers=8, mask_token_id=V - 1, block_size=B)
    return DFlashDrafter(config, embed=torch.nn.Embedding(V, H), lm_head=torch.nn.Linear(H, V, bias=False)).eval()


def test_anchors_need_two_supervised_positions_and_are_sorted():
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0, 1])
    assert valid_anchors(mask).tolist() == [1, 2, 5]
    g = torch.Generator().manual_seed(0)
    picked = sample_anchors(mask, 2, g)
    assert len(picked) == 2 and picked.tolist() == sorted(picked.tolist()) and set(picked.tolist()) <= {1, 2, 5}
    assert sample_anchors(mask, 10, g).tolist() == [1, 2, 5]


def test_block_inputs_and_mask():
    ids = torch.arange(10, 20)
    anchors = torch.tensor([2, 6])
    block_ids, pos, allowed = block_inputs(ids, anchors, B, mask_token_id=99)
    assert block_ids.tolist() == [12, 99, 99, 99, 16, 99, 99, 99]
    assert pos.tolist() == [2, 3, 4, 5, 6, 7, 8, 9]
    ctx, blk = allowed[:, :10], allowed[:, 10:]
    assert ctx[0].tolist() == [True, True] + [False] * 8        # strictly before anchor 2
    assert ctx[4].tolist() == [True] * 6 + [False] * 4          # strictly before anchor 6
    assert blk[0].tolist() == [True] * 4 + [False] * 4          # own block only, bidirectional
    assert blk[5].tolist() == [False] * 4 + [True] * 4


def test_targets_and_weights():
    argmax = torch.arange(100, 110)
    mask = torch.tensor([0, 1, 1, 1, 1, 0, 1, 1, 1, 1])
    labels, weights = block_targets(argmax, mask, torch.tensor([1, 8]), B, gamma=2.0)
    # anchor 1: slot k predicts position 1+k with label argmax[k]
    assert labels[0].tolist() == [0, 101, 102, 103]
    assert weights[0].tolist() == pytest.approx([0, 1, math.exp(-0.5), math.exp(-1.0)])
    # anchor 8: slot 1 -> position 9 (supervised), slots 2-3 run past the end
    assert labels[1].tolist() == [0, 108, 0, 0] and weights[1].tolist() == pytest.approx([0, 1, 0, 0])
    # a masked target position is weighted 0
    _, w = block_targets(argmax, mask, torch.tensor([3]), B, gamma=2.0)
    assert w[0].tolist() == pytest.approx([0, 1, 0, math.exp(-1.0)])
    assert decay_weights(16, 7)[1] == 1.0 and default_gamma(16) == 7 and default_gamma(8) == 4


def test_weighted_ce_matches_the_formula():
    logits = torch.randn(2, B, V)
    labels = torch.randint(0, V, (2, B))
    weights = torch.tensor([[0, 1.0, 0.5, 0.25], [0, 1.0, 0, 0]])
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none").view(2, B)
    assert weighted_ce(logits, labels, weights).item() == pytest.approx(float((ce * weights).sum() / weights.sum()), rel=1e-6)


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


def test_frozen_embedding_and_head_are_not_parameters():
    drafter = tiny_drafter()
    names = {n for n, _ in drafter.named_parameters()}
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.1.mlp.down_proj.weight"} <= names


def test_metrics_on_known_logits():
    labels = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])
    weights = torch.tensor([[0, 1.0, 1.0, 1.0], [0, 1.0, 1.0, 0.0]])
    logits = torch.zeros(2, B, V)
    logits[0, 1, 1] = logits[0, 2, 2] = 10      # block 0: slots 1, 2 right, slot 3 wrong...
    logits[0, 3, 7] = 10
    logits[0, 3, 3] = 5                          # ...but its label is second best (inside top-4)
    logits[1, 1, 9] = 10                         # block 1: slot 1 wrong
    logits[1, 2, 2] = 10
    m = block_metrics(logits, labels, weights)
    assert m["accuracy"] == pytest.approx(3 / 5)
    assert m["avg_streak"] == pytest.approx((2 + 0) / 2)
    assert m["pos_acc"] == pytest.approx([0.5, 1.0, 0.0])
    assert m["top4_acc"] >= 4 / 5 and m["ddtree_streak4"] >= (3 + 0) / 2


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
    assert config["dflash_config"] == {"target_layer_ids": [1, 3, 5], "mask_token_id": V - 1}
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
