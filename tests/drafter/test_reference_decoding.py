"""Speculative decoding with z-lab's reference against `pipeline eval`'s (DESIGN 2, 8): an export of
ours loaded by `DFlashDraftModel.from_pretrained` decodes greedily on the embedded target with the
reference's own `spec_generate` (its drafter forward under its own attention and KV cache, its
target cache and rollback, its acceptance rule), and our eval's block decoding decodes with the same
export on the same target: the same tokens, both plain greedy decoding's, and at every step where
both draft a whole block the same draft tokens and the same acceptance length.

What the reference needs to run here (a cache argument transformers 5.25 wants, its statistics
without CUDA timers) is harness/dflash_reference.py `observed_spec_generate`; the forward on random
contexts is tests/drafter/test_reference_export.py."""

from __future__ import annotations

import inspect

import pytest
import torch

from harness.dflash_reference import (
    needs_reference,
    observed_spec_generate,
    reference_module,
)
from pipeline.drafter.export import export_drafter, load_drafter
from pipeline.drafter.model import DFlashDrafter, DrafterConfig
from pipeline.eval.speculative_decoding import block_decode, greedy
from pipeline.target_model.live import LiveTarget

MAX_NEW = 16

pytestmark = needs_reference


@pytest.fixture(scope="module")
def reference():
    return reference_module()


@pytest.fixture(scope="module")
def prompts(embedded, tokenizer):
    """The first held-out prompts as eval renders them (245, 219 and 45 tokens)."""
    from pipeline.data.prompts import read_prompts

    return [p["ids"] for p in read_prompts(embedded.HELDOUT_DATA, tokenizer, 3)]


@pytest.fixture(scope="module")
def eos(tokenizer):
    from pipeline.target_model.facts import end_of_turn_ids

    return end_of_turn_ids(tokenizer)


def sliding_export(path, target, tokenizer):
    """An export with the flagship's layout (4 sliding layers then a full one; DESIGN 2) at the
    embedded target's width, random weights, a window (12) longer than the block (8), as the
    flagship's is, and shorter than the prompts."""
    torch.manual_seed(0)
    config = DrafterConfig(hidden_size=target.config.hidden_size, intermediate_size=256, num_hidden_layers=5,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=target.config.vocab_size,
                           target_layer_ids=[1, 3, 5], num_target_layers=target.config.num_hidden_layers,
                           mask_token_id=tokenizer.convert_tokens_to_ids("<|MASK|>"), mask_token="<|MASK|>", block_size=8,
                           layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=12)
    export_drafter(DFlashDrafter(config, embed=target.get_input_embeddings(), lm_head=target.lm_head), path)
    return path


def our_decoding(export, embedded, target, prompt, eos):
    """(block decoding, plain greedy decoding) as `pipeline eval` runs them: the export loaded by
    eval's own loader beside the target's frozen embedding and lm_head, drafting with its KV cache."""
    from stages.eval.run import fitting_drafter

    drafter = fitting_drafter(export, embedded.TARGET_DIR, None, torch.device("cpu"), torch.float32)
    live = LiveTarget(target, drafter.config.target_layer_ids)
    return (block_decode(live, drafter, prompt, max_new=MAX_NEW, eos=eos),
            greedy(live, prompt, max_new=MAX_NEW, eos=eos))


def capped(accepted: list[int], total: int) -> list[int]:
    """Our accepted drafts per step as the reference records a step: accepted + 1 (the target's own
    next token), cut where the output ends (max_new or an end of turn)."""
    left, lengths = total - 1, []   # the prefill gives the first token, before any step
    for n in accepted:
        lengths.append(min(n + 1, left))
        left -= lengths[-1]
    return lengths


def assert_same_decoding(reference, monkeypatch, export, embedded, target, prompt, eos):
    """The reference's tokens equal ours and greedy's; at every step where it drafted a whole block,
    its draft tokens and its acceptance length equal ours. Once fewer than B tokens are left it
    drafts a shorter block (as many slots as are left), which its full-attention layer reads
    otherwise than our whole block: those last steps' drafts are its own, and only the tokens they
    end in are compared. Returns (ours, the number of whole-block steps)."""
    theirs = reference.DFlashDraftModel.from_pretrained(export, dtype=torch.float32, use_kernels=False).eval()
    mine, plain = our_decoding(export, embedded, target, prompt, eos)
    got = observed_spec_generate(reference, monkeypatch, theirs, target, prompt, max_new=MAX_NEW, eos=eos)
    assert mine.tokens == plain.tokens, "our speculative decoding left greedy decoding"
    assert got.tokens == mine.tokens, "the reference's speculative decoding differs from ours"
    whole = theirs.block_size - 1
    steps = next((i for i, d in enumerate(got.drafts) if len(d) < whole), len(got.drafts))
    assert all(len(d) < whole for d in got.drafts[steps:])
    assert got.drafts[:steps] == mine.drafts[:steps], "the drafts differ"
    assert got.acceptance[:steps] == capped(mine.accepted, len(mine.tokens))[:steps]
    return mine, steps


def test_the_reference_decodes_with_a_sliding_window_drafter_as_eval_does(reference, monkeypatch, tmp_path, embedded,
                                                                          tokenizer, target, prompts, eos):
    """Random weights in the flagship's layout: random drafts are (nearly) all rejected, so each step
    commits about one token, and the drafts are compared step by step as both caches grow and the sliding
    layers' window moves over the context (a 45-token prompt, window 12)."""
    export = sliding_export(tmp_path / "d", target, tokenizer)
    _, steps = assert_same_decoding(reference, monkeypatch, export, embedded, target, prompts[2], eos)
    assert steps >= 8, steps


def test_the_reference_decodes_with_the_trained_drafter_as_eval_does(reference, monkeypatch, tmp_path, embedded,
                                                                      target, trained_run, prompts, eos):
    """The shared trained drafter (tests/conftest.py `trained_run`: the tiny preset, 2 full layers),
    then its weights with the first layer made sliding (window 24, a tenth of the 245-token prompt;
    not how it was trained, but its drafts are still accepted): steps accept different numbers of
    drafts, so both sides roll the target's cache and the drafter's back by different amounts."""
    from pipeline.target_model.loading import frozen_target_modules

    drafter = trained_run["run"] / "drafter"
    mine, steps = assert_same_decoding(reference, monkeypatch, drafter, embedded, target, prompts[1], eos)
    assert len(set(mine.accepted[:steps])) > 1, mine.accepted   # rollbacks of more than one size

    embed, head = frozen_target_modules(embedded.TARGET_DIR)
    trained = load_drafter(drafter, embed=embed, lm_head=head)
    config = trained.config
    config.layer_types, config.sliding_window = ["sliding_attention"] + config.layer_types[1:], 24
    sliding = DFlashDrafter(config, embed=embed, lm_head=head)
    sliding.load_state_dict(trained.state_dict())
    export_drafter(sliding, tmp_path / "sliding")
    mine, steps = assert_same_decoding(reference, monkeypatch, tmp_path / "sliding", embedded, target, prompts[0], eos)
    assert len(set(mine.accepted[:steps])) > 1, mine.accepted


def test_without_the_argument_the_reference_fails_on_this_transformers_linear_attention(reference, tmp_path, tokenizer,
                                                                                         target, prompts, eos):
    """Why `observed_spec_generate` asks the cache for `recurrent_states_to_keep`: where the target's
    linear-attention cache layers take that argument (transformers 5.25), the reference's own
    `activate_past_recording()` leaves it None and the target's first forward fails. A release
    where this passes no longer needs the adaptation: drop it there."""
    from transformers import DynamicCache

    linear = [layer for layer in DynamicCache(config=target.config).layers if hasattr(layer, "recurrent_states")]
    assert linear, "the embedded target has linear-attention layers (DESIGN 9)"
    if "recurrent_states_to_keep" not in inspect.signature(linear[0].activate_past_recording).parameters:
        pytest.skip("this transformers' linear-attention cache takes no recurrent_states_to_keep (before 5.25)")
    theirs = reference.DFlashDraftModel.from_pretrained(sliding_export(tmp_path / "d", target, tokenizer),
                                                        dtype=torch.float32, use_kernels=False)
    with pytest.raises(TypeError, match="NoneType"):
        theirs.spec_generate(target, torch.tensor([prompts[2]]), max_new_tokens=2, stop_token_ids=sorted(eos))
