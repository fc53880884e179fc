"""The export with sliding-window layers (DESIGN 2, 8) as others read it: transformers' Qwen3Config,
z-lab's reference class `DFlashDraftModel` with its own attention, and the flagship preset against
DESIGN 2's numbers.

The reference is the installed package `dflash==0.1.0` (CI installs it with --no-deps; without it
a skip on a developer's machine, a failure under CI=true: harness/dflash_reference.py), never a copy.
Its attention is SDPA under its own mask (`dflash.model._attention_mask`): a `sliding_attention`
layer is causal with the window `sliding_window`, within the block too; a `full_attention` layer
sees the whole context and the whole block. That is the serving engines' rule, which ours follows
(pipeline/drafter/model.py's docstring), so the reference's forward through the frozen lm_head
must give our draft logits, with a context shorter and longer than the window, for a drafter laid
out as the flagship is (4 sliding layers, then a full one). A config key `is_causal` (the
reference) or `dflash_config.causal` (vLLM) would override every layer's kind, the full layer's
too: the export writes neither.

Decoding (tests/drafter/test_reference_decoding.py): the reference's own `spec_generate` on the
embedded target against our eval's block decoding."""

from __future__ import annotations

import json

import pytest
import torch

from harness.dflash_reference import needs_reference, reference_module
from pipeline.drafter.export import export_drafter, load_drafter, read_config
from pipeline.drafter.model import DFlashDrafter, DrafterConfig
from pipeline.errors import PipelineError
from pipeline.eval.speculative_decoding import draft_logits

H, V, TAPS = 32, 64, 3
# The flagship's layout (DESIGN 2: 4 x sliding_attention, then full_attention) at a small width.
KINDS = ["sliding_attention"] * 4 + ["full_attention"]
WINDOW, BLOCK = 5, 6


@pytest.fixture(scope="module")
def reference():
    return reference_module()


def drafter(window=WINDOW, block=BLOCK, seed=0, projected_rank=None):
    torch.manual_seed(seed)
    config = DrafterConfig(projected_rank=projected_rank, hidden_size=H, intermediate_size=64, num_hidden_layers=len(KINDS),
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=V, target_layer_ids=[1, 3, 5],
                           num_target_layers=8, mask_token_id=V - 1, block_size=block, rope_theta=50000.0,
                           max_position_embeddings=4096, layer_types=KINDS, sliding_window=window)
    head = torch.nn.Linear(H, V, bias=False)
    torch.nn.init.normal_(head.weight, std=1.0)
    model = DFlashDrafter(config, embed=torch.nn.Embedding(V, H), lm_head=head).eval()
    for p in model.parameters():  # the RMSNorm weights too, so a swapped norm would show
        p.data.add_(0.1 * torch.randn_like(p))
    return model


def load_reference(reference, path):
    """The reference class on an export, loaded strictly: every tensor used, none missing."""
    theirs, info = reference.DFlashDraftModel.from_pretrained(path, use_kernels=False, output_loading_info=True,
                                                              dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return theirs.eval()


def reference_logits(theirs, ours, taps_TNH, anchor, anchor_pos):
    """The reference's draft logits [B-1, V] for one block after the context: its forward (its own
    attention, no mask given), then its `compute_logits` through the target's frozen lm_head."""
    block = ours.config.block_size
    ids = torch.full((1, block), ours.config.mask_token_id)
    ids[0, 0] = anchor
    with torch.no_grad():
        final = theirs(position_ids=torch.arange(anchor_pos + block)[None], noise_embedding=ours._frozen["embed"](ids),
                       target_hidden=taps_TNH.reshape(1, anchor_pos, -1))
        return theirs.compute_logits(final, ours._frozen["lm_head"])[0, 1:]


def with_config(path, out, **changes):
    """A copy of the export at `path` in `out` with config.json's keys changed."""
    out.mkdir()
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (out / "config.json").write_text(json.dumps(raw))
    (out / "model.safetensors").symlink_to(path / "model.safetensors")
    return out


def test_export_records_the_layer_kinds_as_qwen3config_reads_them(tmp_path):
    from transformers import Qwen3Config

    model = drafter()
    export_drafter(model, tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["layer_types"] == KINDS and raw["sliding_window"] == WINDOW and raw["use_sliding_window"] is True
    assert raw["torch_dtype"] == "float32" and raw["rope_parameters"]["rope_theta"] == 50000.0
    theirs = Qwen3Config.from_pretrained(tmp_path / "d")
    assert theirs.layer_types == KINDS and theirs.sliding_window == WINDOW
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
    from pipeline.config import DrafterShape
    from pipeline.target_model import read_target_facts
    from pipeline.training.drafter_shape import drafter_config

    facts = read_target_facts(embedded.TARGET_DIR)
    shape = DrafterShape(mask_token=mask_token, block_size=block_size, num_hidden_layers=1)
    config = drafter_config(shape, facts, embedded.TARGET_DIR, taps=[1, 2])
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
    shape = cfg.drafter
    assert (shape.num_hidden_layers, shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim) == (5, 32, 8, 128)
    assert (shape.intermediate_size, shape.rope_theta, shape.max_position_embeddings) == (17408, 1e7, 262144)
    assert shape.layer_types == ["sliding_attention"] * 4 + ["full_attention"] and shape.sliding_window == 2048
    assert (shape.block_size, shape.mask_token, shape.target_layer_ids) == (16, 248070, [1, 16, 31, 46, 61])
    assert (target["hidden_size"], target["vocab_size"]) == (5120, 248320)


# Context lengths: shorter than the window, about the block plus the window, and well past both.
CONTEXTS = [3, 9, 20]


@needs_reference
@pytest.mark.parametrize("context_len", CONTEXTS)
def test_reference_class_loads_the_export_strictly_and_drafts_the_same_tokens(reference, tmp_path, context_len):
    """DESIGN 2, 8: the reference class loads our export strictly, reads each layer's kind from it
    as we mean it (sliding: causal with the window; full: neither), and its forward with its own
    attention gives our draft logits (from `pipeline eval`'s drafting call) and tokens."""
    ours = drafter()
    export_drafter(ours, tmp_path / "d")
    theirs = load_reference(reference, tmp_path / "d")
    assert [layer.self_attn.is_causal for layer in theirs.layers] == [k == "sliding_attention" for k in KINDS]
    assert [layer.self_attn.sliding_window for layer in theirs.layers] == [WINDOW if k == "sliding_attention" else None
                                                                          for k in KINDS]
    torch.manual_seed(context_len)
    context = torch.randn(context_len, TAPS, H)
    mine = draft_logits(ours, context, 7, context_len)
    theirs_logits = reference_logits(theirs, ours, context, 7, context_len)
    torch.testing.assert_close(mine, theirs_logits, rtol=1e-4, atol=1e-4)
    assert mine.argmax(-1).tolist() == theirs_logits.argmax(-1).tolist()


@needs_reference
@pytest.mark.parametrize("context_len", [3, 20])
def test_reference_class_drafts_from_the_full_taps_what_a_drafter_trained_on_a_projection_drafts(reference, tmp_path,
                                                                                                 context_len):
    """Issue 68: a drafter whose fc reads R projected values, exported with its basis folded into
    fc; the reference class, given the full taps, drafts what ours drafts from their projection."""
    from pipeline.projection.basis import SecondMoment, fit_basis

    g = torch.Generator().manual_seed(3)
    pilot = torch.randn(400, TAPS * H, generator=g) @ (torch.randn(TAPS * H, TAPS * H, generator=g)
                                                       * torch.logspace(0, -2, TAPS * H)[:, None])
    moment = SecondMoment(TAPS * H)
    moment.add(pilot)
    basis = fit_basis(moment, 40)
    ours = drafter(projected_rank=40)
    export_drafter(ours, tmp_path / "d", basis=basis)
    theirs = load_reference(reference, tmp_path / "d")
    taps = pilot[:context_len].reshape(context_len, TAPS, H)
    mine = draft_logits(ours, basis.project_taps(taps), 7, context_len)      # fc' on [T, 1, R]
    theirs_logits = reference_logits(theirs, ours, taps, 7, context_len)
    torch.testing.assert_close(mine, theirs_logits, rtol=1e-4, atol=1e-4)
    assert mine.argmax(-1).tolist() == theirs_logits.argmax(-1).tolist()


@needs_reference
def test_the_window_binds_in_the_reference_comparison(reference, tmp_path):
    """The comparison above is not vacuous: with the window wide open our drafts change, and so do
    the reference's on the same weights, away from ours."""
    torch.manual_seed(20)
    context = torch.randn(20, TAPS, H)
    narrow, wide = drafter(window=WINDOW), drafter(window=10_000)
    mine = draft_logits(narrow, context, 7, 20)
    assert (mine - draft_logits(wide, context, 7, 20)).abs().max() > 1e-2
    export_drafter(narrow, tmp_path / "d")
    opened = load_reference(reference, with_config(tmp_path / "d", tmp_path / "wide", sliding_window=10_000))
    assert (mine - reference_logits(opened, narrow, context, 7, 20)).abs().max() > 1e-2


def test_the_export_writes_no_causality_override(tmp_path):
    """Each layer's causality follows its kind only while config.json has neither `is_causal` (the
    reference reads it for every layer) nor `dflash_config.causal` (vLLM's DFlash reads it for every
    layer): the export writes neither, whatever the layer kinds."""
    export_drafter(drafter(), tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert "is_causal" not in raw and "causal" not in raw["dflash_config"]


@needs_reference
@pytest.mark.parametrize("is_causal", [True, False])
def test_a_causality_override_would_move_the_reference_off_ours(reference, tmp_path, is_causal):
    """Why the export writes no `is_causal`: with it set either way, the reference runs a layer
    other than we trained it (True: the full layer causal; False: the sliding ones not) and its
    drafts leave ours. The equality above rests on the key's absence."""
    ours = drafter()
    export_drafter(ours, tmp_path / "d")
    overridden = load_reference(reference, with_config(tmp_path / "d", tmp_path / "o", is_causal=is_causal))
    assert [layer.self_attn.is_causal for layer in overridden.layers] == [is_causal] * len(KINDS)
    torch.manual_seed(20)
    context = torch.randn(20, TAPS, H)
    mine = draft_logits(ours, context, 7, 20)
    assert (mine - reference_logits(overridden, ours, context, 7, 20)).abs().max() > 1e-2
