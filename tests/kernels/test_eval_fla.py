"""`pipeline eval`'s speculative decoding with fla bound (Triton's interpreter, fp32) decodes the
torch path's tokens: block verification (the recording rule steps fla's fused recurrent kernel
per position and commits the kept state), DDTree verification (the tree rule steps it depth by
depth; the kept path's state is re-derived by fla's chunked kernel), and plain greedy decoding
(fla's chunked prefill and one-token recurrent decode).

The drafts come from a noisy oracle built on the torch path's greedy answer, so the walk goes
deep, rejects mid-block and mid-tree, and takes a second-best child: every commit path runs.
The interpreter costs about 0.45 s per kernel call (32 programs of Python), and a verify pass makes
one per layer per position (block) or per tree depth: blocks of 4 and 12 new tokens keep the file
to about two minutes on one core."""

import pytest
import torch

from harness.kernel_binding import torch_bound
from pipeline.eval.speculative_decoding import block_decode, greedy, tree_decode
from pipeline.target_model.internals import KernelCallCounter

NEW = 12
BLOCK = 4       # the bonus token and 3 drafts a verify pass
EOS = {498}


@pytest.fixture(scope="module")
def live(target):
    from pipeline.target_model.internals import bound_kernels, modeling_module_of
    from pipeline.target_model.live import LiveTarget

    bound = bound_kernels(modeling_module_of(target))   # else every test here compares torch with torch
    assert bound["chunk_gated_delta_rule"]["kind"] == bound["fused_recurrent_gated_delta_rule"]["kind"] == "fla", bound
    return LiveTarget(target, [1, 3, 5])


@pytest.fixture(scope="module")
def prompt(tokenizer):
    messages = [{"role": "user", "content": "Count up from 3 to 9."}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         enable_thinking=False)


@pytest.fixture(scope="module")
def ids(prompt, tokenizer):
    return tokenizer(prompt)["input_ids"]


@pytest.fixture(scope="module")
def reference(live, ids):
    """The torch path's greedy answer: what every decoder below must reproduce."""
    with torch_bound():
        tokens = greedy(live, ids, max_new=NEW, eos=EOS).tokens
    assert len(tokens) == NEW, tokens   # an answer long enough to need several verify passes
    return tokens


def _noisy_oracle(reference, start, vocab, *, logits: bool):
    """Draft the reference's next tokens, except at every fifth position (a wrong token: a
    rejection) and, for trees, with the right token second-best at depth 1 (the walk takes a
    sibling)."""
    generator = torch.Generator().manual_seed(0)

    def draft(anchor, pos):
        ahead = reference[pos - start + 1:pos - start + BLOCK]
        ahead = ahead + [0] * (BLOCK - 1 - len(ahead))
        if not logits:
            return [t if (pos + d) % 5 else (t + 1) % vocab for d, t in enumerate(ahead)]
        out = torch.randn(BLOCK - 1, vocab, generator=generator)
        for d, t in enumerate(ahead):
            out[d, t] += 8.0 if d != 1 else 4.0
            if d == 1:
                out[d, (t + 1) % vocab] += 6.0
            if (pos + d) % 5 == 0:
                out[d, t] -= 20.0
        return out

    return draft


def test_plain_greedy_with_fla_is_the_torch_paths(live, ids, reference):
    with KernelCallCounter(live.model) as counter:
        tokens = greedy(live, ids, max_new=NEW, eos=EOS).tokens
    assert counter.counts["chunk_gated_delta_rule"] > 0 and counter.counts["fused_recurrent_gated_delta_rule"] > 0
    assert tokens == reference


def test_block_verification_with_fla_decodes_the_torch_paths_tokens(live, ids, reference):
    draft = _noisy_oracle(reference, len(ids), live.model.config.vocab_size, logits=False)
    with KernelCallCounter(live.model) as counter:
        run = block_decode(live, None, ids, max_new=NEW, eos=EOS, draft=draft)
    assert run.tokens == reference
    assert max(run.accepted) == BLOCK - 1 and min(run.accepted) < BLOCK - 1, run.accepted   # whole and cut blocks
    # every position of every verify pass stepped by the bound (fla) recurrent kernel, per layer
    assert counter.counts["fused_recurrent_gated_delta_rule"] == _linear_layers(live) * BLOCK * run.verify_passes


@pytest.mark.parametrize("budget", [8])
def test_tree_verification_with_fla_decodes_the_torch_paths_tokens(live, ids, reference, budget):
    draft = _noisy_oracle(reference, len(ids), live.model.config.vocab_size, logits=True)
    with KernelCallCounter(live.model) as counter:
        run = tree_decode(live, None, ids, max_new=NEW, eos=EOS, budget=budget, draft=draft)
    assert run.tokens == reference
    assert max(run.accepted) == BLOCK - 1 and min(run.accepted) < BLOCK - 1, run.accepted
    # The tree rule steps the bound fused recurrent kernel depth by depth; keep_path re-derives the
    # kept path's state with the bound chunked one, once a layer a pass (after the prefill's).
    assert counter.counts["fused_recurrent_gated_delta_rule"] >= _linear_layers(live) * run.verify_passes
    assert counter.counts["chunk_gated_delta_rule"] == _linear_layers(live) * (1 + run.verify_passes)


def _linear_layers(live):
    return sum(kind == "linear_attention" for kind in live.model.config.layer_types)
