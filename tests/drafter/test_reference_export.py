"""The export with sliding-window layers (DESIGN 2, 8) as others read it: transformers' Qwen3Config,
the z-lab reference class `DFlashDraftModel`, and the flagship preset against DESIGN 2's numbers.

The reference class is not vendored: the test imports it from a checkout of github.com/z-lab/dflash
named by DFLASH_REFERENCE_SRC (or an installed `dflash` package) and skips without one. It loads
our export strictly; for its attention it is given the serving engines' rule (a sliding layer:
causal with the window; a full layer: bidirectional), written here from that rule, because the
class itself applies `sliding_window` only under flash-attention (and not causally) and ignores it
under SDPA. With that, its draft tokens must equal ours from `pipeline eval`'s drafting call."""

from __future__ import annotations

import importlib
import json
import os
import sys

import pytest
import torch

from pipeline.drafter.export import export_drafter, load_drafter, read_config
from pipeline.drafter.model import DFlashDrafter, DrafterConfig
from pipeline.errors import PipelineError
from pipeline.eval.speculative_decoding import draft_logits

H, V, TAPS = 32, 64, 3
KINDS = ["sliding_attention", "sliding_attention", "full_attention"]


def drafter(window=5, block=6, seed=0, tap_projection=None):
    torch.manual_seed(seed)
    config = DrafterConfig(tap_projection=tap_projection, hidden_size=H, intermediate_size=64, num_hidden_layers=len(KINDS), num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, vocab_size=V, target_layer_ids=[1, 3, 5], num_target_layers=8,
                           mask_token_id=V - 1, block_size=block, rope_theta=50000.0, max_position_embeddings=4096,
                           layer_types=KINDS, sliding_window=window)
    head = torch.nn.Linear(H, V, bias=False)
    torch.nn.init.normal_(head.weight, std=1.0)
    model = DFlashDrafter(config, embed=torch.nn.Embedding(V, H), lm_head=head).eval()
    for p in model.parameters():  # the RMSNorm weights too, so a swapped norm would show
        p.data.add_(0.1 * torch.randn_like(p))
    return model


def test_export_records_the_layer_kinds_as_qwen3config_reads_them(tmp_path):
    from transformers import Qwen3Config

    model = drafter()
    export_drafter(model, tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["layer_types"] == KINDS and raw["sliding_window"] == 5 and raw["use_sliding_window"] is True
    assert raw["torch_dtype"] == "float32" and raw["rope_parameters"]["rope_theta"] == 50000.0
    theirs = Qwen3Config.from_pretrained(tmp_path / "d")
    assert theirs.layer_types == KINDS and theirs.sliding_window == 5
    assert theirs.max_position_embeddings == 4096 and theirs.rope_parameters["rope_theta"] == 50000.0
    assert read_config(tmp_path / "d") == model.config

    export_drafter(model, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_drafter(tmp_path / "bf16", embed=model._frozen["embed"], lm_head=model._frozen["lm_head"])
    assert loaded.fc.weight.dtype == torch.float32
    torch.testing.assert_close(loaded.fc.weight, model.fc.weight.to(torch.bfloat16).float())


def test_a_drafter_without_sliding_layers_reads_back_as_its_config(tmp_path):
    """A run may set sliding_window (a preset does) with every layer full; the export writes no
    window then, so the config it reads back, which resume compares with the run's, must be the
    run's own (resuming such a run was refused)."""
    torch.manual_seed(0)
    config = DrafterConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, vocab_size=V, target_layer_ids=[1, 3, 5], num_target_layers=8,
                           mask_token_id=V - 1, block_size=6, layer_types=["full_attention"], sliding_window=2048)
    model = DFlashDrafter(config, embed=torch.nn.Embedding(V, H), lm_head=torch.nn.Linear(H, V, bias=False))
    export_drafter(model, tmp_path / "d")
    assert read_config(tmp_path / "d") == model.config
    assert model.config.window(0) is None


def embedded_drafter(mask_token: str | int, block_size: int = 6) -> DFlashDrafter:
    """A drafter of the embedded target with this mask token, its config resolved as train resolves it."""
    from pipeline import embedded
    from pipeline.config import TrainConfig
    from pipeline.target_model import read_target_facts
    from pipeline.training.geometry import drafter_config

    facts = read_target_facts(embedded.TARGET_DIR)
    cfg = TrainConfig(mask_token=mask_token, block_size=block_size, num_hidden_layers=1)
    config = drafter_config(cfg, facts, embedded.TARGET_DIR, taps=[1, 2])
    return DFlashDrafter(config, embed=torch.nn.Embedding(facts.vocab_size, facts.hidden_size),
                         lm_head=torch.nn.Linear(facts.hidden_size, facts.vocab_size, bias=False))


@pytest.mark.parametrize("given_as", ["text", "id"])
def test_dflash_config_gives_sglang_the_block_size_and_the_mask_token(tmp_path, given_as):
    """SGLang reads the block size and the mask token's text from dflash_config, and refuses a text
    whose id in the target's tokenizer is not mask_token_id: the text is checked here with that
    tokenizer itself, loaded as an engine loads it, whether --mask-token named the token or its id."""
    from transformers import AutoTokenizer

    from pipeline import embedded

    tokenizer = AutoTokenizer.from_pretrained(embedded.TARGET_DIR, local_files_only=True)
    mask = "<|MASK|>" if given_as == "text" else tokenizer.convert_tokens_to_ids("<|MASK|>")
    model = embedded_drafter(mask, block_size=6)
    export_drafter(model, tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    dflash = raw["dflash_config"]
    assert dflash["block_size"] == raw["block_size"] == 6
    assert tokenizer.convert_tokens_to_ids(dflash["mask_token"]) == dflash["mask_token_id"] == model.config.mask_token_id
    assert read_config(tmp_path / "d").mask_token == dflash["mask_token"]


def test_a_mask_row_past_the_tokenizer_is_exported_without_a_text(tmp_path):
    """A mask id past the tokenizer's vocabulary (an embedding row no text produces) has no token
    to name: dflash_config carries the id alone, and SGLang falls back to its own default text."""
    from pipeline import embedded
    from pipeline.target_model import load_tokenizer

    past = len(load_tokenizer(embedded.TARGET_DIR))
    export_drafter(embedded_drafter(past), tmp_path / "d")
    dflash = json.loads((tmp_path / "d" / "config.json").read_text())["dflash_config"]
    assert dflash["mask_token_id"] == past and "mask_token" not in dflash


def test_a_window_without_use_sliding_window_is_refused(tmp_path):
    """Qwen3Config drops `sliding_window` unless `use_sliding_window` is true; sliding layers
    without a window would run unwindowed in transformers and fail in vLLM: one-line error."""
    export_drafter(drafter(), tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    raw["use_sliding_window"] = False
    (tmp_path / "d" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(PipelineError, match=r"config.json: not a DFlash drafter config .*sliding_window"):
        read_config(tmp_path / "d")


def test_flagship_preset_is_the_reference_geometry():
    """DESIGN 2's reference drafter for Qwen3.6-27B, number by number."""
    from stages.train.run import resolve_config

    cfg, target = resolve_config(None, {"preset": "qwen3.6-27b", "cache": "nowhere"})
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (5, 32, 8, 128)
    assert (cfg.intermediate_size, cfg.rope_theta, cfg.max_position_embeddings) == (17408, 1e7, 262144)
    assert cfg.layer_types == ["sliding_attention"] * 4 + ["full_attention"] and cfg.sliding_window == 2048
    assert (cfg.block_size, cfg.mask_token, cfg.target_layer_ids) == (16, 248070, [1, 16, 31, 46, 61])
    assert (target["hidden_size"], target["vocab_size"]) == (5120, 248320)


def reference_class():
    src = os.environ.get("DFLASH_REFERENCE_SRC")
    if src and src not in sys.path:
        sys.path.insert(0, src)
    try:
        return importlib.import_module("dflash.model").DFlashDraftModel
    except ImportError as e:
        pytest.skip(f"the z-lab reference class is not importable ({e}); set DFLASH_REFERENCE_SRC to a checkout "
                    "of github.com/z-lab/dflash to run this check")


def engine_rule_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                          **kwargs):
    """The serving engines' DFlash attention, from their rule: a sliding layer is causal with a
    window (flash-attention window (W - 1, 0)); a full layer sees every key. Keys are [context ;
    block] at positions 0..K-1 and the queries are the last positions."""
    q_len, k_len = query.shape[2], key.shape[2]
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = (query @ key.transpose(-1, -2)) * (scaling or query.shape[-1] ** -0.5)
    if sliding_window is not None:
        q_pos = torch.arange(k_len - q_len, k_len)[:, None]
        k_pos = torch.arange(k_len)[None, :]
        scores = scores.masked_fill(~((k_pos <= q_pos) & (k_pos > q_pos - sliding_window)), float("-inf"))
    return (torch.softmax(scores, dim=-1) @ value).transpose(1, 2).contiguous(), None


@pytest.mark.parametrize("context_len", [3, 9, 20])
def test_reference_class_loads_the_export_strictly_and_drafts_the_same_tokens(tmp_path, context_len):
    from transformers import AttentionInterface

    cls = reference_class()
    AttentionInterface.register("serving_engine_rule", engine_rule_attention)
    ours = drafter()
    export_drafter(ours, tmp_path / "d")
    theirs, info = cls.from_pretrained(tmp_path / "d", attn_implementation="serving_engine_rule", use_kernels=False,
                                       output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    theirs.eval()

    torch.manual_seed(context_len)
    context = torch.randn(context_len, TAPS, H)
    anchor, block = 7, ours.config.block_size
    mine = draft_logits(ours, context, anchor, context_len)
    ids = torch.full((1, block), ours.config.mask_token_id)
    ids[0, 0] = anchor
    with torch.no_grad():
        final = theirs(position_ids=torch.arange(context_len + block)[None],
                       noise_embedding=ours._frozen["embed"](ids),
                       target_hidden=context.reshape(1, context_len, TAPS * H))
        reference = ours._frozen["lm_head"](final)[0, 1:]
    torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-4)
    assert mine.argmax(-1).tolist() == reference.argmax(-1).tolist()


@pytest.mark.parametrize("context_len", [3, 20])
def test_reference_class_drafts_from_the_full_taps_what_a_drafter_trained_on_a_projection_drafts(tmp_path, context_len):
    """Issue 68: a drafter whose fc reads R projected values, exported with its basis folded into
    fc; the reference class, given the full taps, drafts what ours drafts from their projection."""
    from transformers import AttentionInterface

    from pipeline.projection.basis import SecondMoment, fit_basis

    cls = reference_class()
    AttentionInterface.register("serving_engine_rule", engine_rule_attention)
    g = torch.Generator().manual_seed(3)
    pilot = torch.randn(400, TAPS * H, generator=g) @ (torch.randn(TAPS * H, TAPS * H, generator=g)
                                                       * torch.logspace(0, -2, TAPS * H)[:, None])
    moment = SecondMoment(TAPS * H)
    moment.add(pilot)
    basis = fit_basis(moment, 40)
    ours = drafter(tap_projection=40)
    export_drafter(ours, tmp_path / "d", basis=basis)
    theirs, info = cls.from_pretrained(tmp_path / "d", attn_implementation="serving_engine_rule", use_kernels=False,
                                       output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    theirs.eval()
    taps = pilot[:context_len].reshape(context_len, TAPS, H)
    mine = draft_logits(ours, basis.project_taps(taps), 7, context_len)      # fc' on [T, 1, R]
    ids = torch.full((1, ours.config.block_size), ours.config.mask_token_id)
    ids[0, 0] = 7
    with torch.no_grad():
        final = theirs(position_ids=torch.arange(context_len + ours.config.block_size)[None],
                       noise_embedding=ours._frozen["embed"](ids), target_hidden=taps.reshape(1, context_len, TAPS * H))
        reference = ours._frozen["lm_head"](final)[0, 1:]
    torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-4)
    assert mine.argmax(-1).tolist() == reference.argmax(-1).tolist()


def test_the_window_binds_in_the_reference_comparison():
    """The comparison above is not vacuous: with the window wide open, our drafts change."""
    torch.manual_seed(20)
    context = torch.randn(20, TAPS, H)
    narrow, wide = drafter(window=5), drafter(window=10_000)
    assert (draft_logits(narrow, context, 7, 20) - draft_logits(wide, context, 7, 20)).abs().max() > 1e-2
