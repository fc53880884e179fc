"""Flex attention in training (issue 67), checked on the CPU against the split path.

A GPU trains with flex attention and a BlockMask (pipeline/drafter/attention_rule.py); the CPU suite runs
`split_block_attention`, which tests/drafter/test_attention_rule.py checks against the rule query
by query. Here a whole training step (the drafter's loss over micro-batches of sequences of several
lengths and anchor counts, backward, every parameter's gradient) with attention "flex" equals the
same step with attention "split", in full and sliding-window layers: flex's eager backward, which
torch 2.13 refuses on the CPU, runs through harness/flex_cpu_backward.py.

And the compiled path: compiled for every shape at once (`dynamic=True`), flex attention compiles
a bounded number of graphs however many shapes the steps bring, with the split path's outputs and
gradients. Inductor cannot compile flex attention with dynamic shapes on the CPU (a C++ compile
error in torch 2.13) nor its backward at all (pytorch issue #148752): these tests compile with the
"aot_eager" backend, whose dynamo guards (what decides a recompile) are the ones inductor starts
from (BENCHMARKS.md "Flex attention on the CPU (issue 67)").
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

from harness import loss_batches as lb
from harness.flex_cpu_backward import flex_backward_on_cpu
from pipeline.config import Data, Objective, Optimizer
from pipeline.drafter.attention_rule import _compiled_flex, flex_attention, split_block_attention
from pipeline.drafter.model import DFlashDrafter, DrafterConfig
from pipeline.training.batch import anchor_generator, prepare
from pipeline.training.plan import Plan
from pipeline.training.step import StepRunner

B = lb.B  # block size 8


def drafter(window: int | None) -> DFlashDrafter:
    """lb.drafter's sizes, with a sliding-window layer before a full one when `window` is given."""
    torch.manual_seed(0)
    kinds = ["full_attention"] * 2 if window is None else ["sliding_attention", "full_attention"]
    config = DrafterConfig(hidden_size=lb.H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=lb.V, target_layer_ids=[1, 3, 5],
                           num_target_layers=8, mask_token_id=lb.V - 1, block_size=B, layer_types=kinds,
                           sliding_window=window)
    head = torch.nn.Linear(lb.H, lb.V, bias=False)
    torch.nn.init.normal_(head.weight, std=0.5)
    return DFlashDrafter(config, embed=torch.nn.Embedding(lb.V, lb.H), lm_head=head)


def step(attention: str, window: int | None, lengths: tuple[int, ...], anchors: int, micro: int):
    """One optimizer step (no update: SGD at lr 0) over sequences of `lengths`: (result, {name: grad})."""
    model = drafter(window)
    model.attention = attention
    params = [p for p in model.parameters() if p.requires_grad]
    plan = Plan(samples_per_epoch=len(lengths), steps_per_epoch=1, total_steps=1, warmup_steps=0, per_rank=len(lengths),
                micro=micro)
    runner = StepRunner(plan, model, torch.optim.SGD(params, lr=0.0), params, torch.device("cpu"), 0, 1,
                        objective=Objective(), optimization=Optimizer(lr=1e-3), data=Data(num_anchors=anchors), seed=0,
                        dtype="auto", gamma=4.0)
    batch = [(s, prepare(lb.sample(n, s), block_size=B, num_anchors=anchors, max_length=4096, mask_token_id=lb.V - 1,
                         gamma=4.0, generator=anchor_generator(0, 0, s))) for s, n in enumerate(lengths)]
    result = runner.step(batch, 0, with_metrics=True)
    return result, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("window", [None, 3, 20])
@pytest.mark.parametrize("lengths, anchors, micro", [((57, 90, 33), 9, 4), ((300, 20, 140, 25), 24, 2), ((12,), 3, 1)])
def test_a_training_step_with_flex_attention_equals_the_split_step(window, lengths, anchors, micro):
    """Loss, metrics and every parameter's gradient of the step, flex (eager) against split: the
    same within fp32 rounding. Windows 3 (narrower than a block of 8: the window cuts inside
    blocks) and 20 (across the context), full layers alone; one to four sequences of 12 to 300
    tokens, 3 to 24 anchors, cut into micro-batches of several shapes."""
    split, split_grads = step("split", window, lengths, anchors, micro)
    with flex_backward_on_cpu():
        flex, flex_grads = step("flex", window, lengths, anchors, micro)
    assert flex["loss"] == pytest.approx(split["loss"], rel=1e-6)
    assert flex["metrics"] == split["metrics"]
    for name, want in split_grads.items():
        scale = want.abs().max()
        assert scale > 0, name  # every parameter gets a gradient: the comparison is not vacuous
        assert float((flex_grads[name] - want).abs().max() / scale) < 1e-5, name


def test_without_the_scaffold_torch_refuses_the_flex_step():
    """What the scaffold works around, and proof that attention "flex" runs flex attention: torch
    refuses its backward on the CPU. If this fails, torch supports it now: drop the scaffold."""
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        step("flex", 3, (57, 33), 9, 2)


def test_the_scaffold_leaves_torch_as_it_was():
    from torch.nn.attention import flex_attention as fa
    before = fa._validate_device
    with flex_backward_on_cpu():
        assert fa._validate_device is not before
        q = torch.zeros(1, 1, 16, 8, device="meta")  # the other checks still run: meta is no flex device
        with pytest.raises(ValueError, match="only supported on"):
            fa._validate_device(q, q, q)
    assert fa._validate_device is before


# Shapes of a run's micro-batches: (sequences, context tokens, anchors). Every one at least 2
# sequences and 2 tiles of 128 queries and keys, as a GPU step's are: dynamo specialises sizes 0
# and 1, so a micro-batch of one sequence (or one tile) compiles once more (BENCHMARKS.md).
# The first has as many sequences as the head size (8): unless both the heads and the head size
# are marked static, duck sizing ties the micro-batch size to one of them and every later size recompiles.
SHAPES = [(8, 150, 9), (3, 201, 12), (2, 260, 10), (4, 175, 17), (2, 300, 20), (3, 133, 9)]
HEADS, KV_HEADS, DIM, ATTN_BLOCK = 4, 2, 8, 16


def attention_inputs(seed: int, s: int, t: int, a: int):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.sort(torch.randint(1, t + 1, (s, a), generator=g), dim=1).values
    q = torch.randn(s, HEADS, a * ATTN_BLOCK, DIM, generator=g, requires_grad=True)
    k = torch.randn(s, KV_HEADS, t + a * ATTN_BLOCK, DIM, generator=g, requires_grad=True)
    v = torch.randn(s, KV_HEADS, t + a * ATTN_BLOCK, DIM, generator=g, requires_grad=True)
    return q, k, v, anchors


def test_compiled_flex_compiles_once_for_every_shape():
    """Six micro-batch shapes through the compiled flex path (mask and kernel, both window kinds,
    forward and backward): one mask graph and one kernel graph per window kind, all at the first
    shape, and every output and gradient is the split path's."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    windows = {None, 24}
    frames = []
    with flex_backward_on_cpu():
        for i, (s, t, a) in enumerate(SHAPES):
            q, k, v, anchors = attention_inputs(i, s, t, a)
            attend = flex_attention(anchors, t, a * ATTN_BLOCK, windows, compiled=True, backend=counter)
            for window in sorted(windows, key=str):
                got = attend(q, k, v, window)
                want = split_block_attention(q, k, v, t, anchors, window)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
                upstream = torch.randn_like(want)
                for g, e in zip(torch.autograd.grad(got, (q, k, v), upstream),
                                torch.autograd.grad(want, (q, k, v), upstream)):
                    torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
            frames.append(counter.frame_count)
    _compiled_flex.cache_clear()  # the counter's compiled functions: not for later tests
    torch._dynamo.reset()
    # The mask and the kernel once per window kind (the mask rule differs), at the first shape;
    # nothing after it.
    assert frames == [2 * len(windows)] * len(SHAPES), frames


def test_a_static_compile_compiles_once_a_shape(monkeypatch):
    """What the dynamic compile replaces, and proof that the counter counts: the kernel compiled for
    static shapes (`dynamic=False`, the code before issue 67) is one more graph for each new shape
    (the masks made eagerly here, to count the kernel alone)."""
    from torch.nn.attention import flex_attention as fa
    from pipeline.drafter import attention_rule
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    static = (fa.create_block_mask, torch.compile(fa.flex_attention, dynamic=False, backend=counter))
    monkeypatch.setattr(attention_rule, "_compiled_flex", lambda backend: static)
    torch._dynamo.reset()
    frames = []
    with torch.no_grad():
        for i, (s, t, a) in enumerate(SHAPES[:3]):
            q, k, v, anchors = attention_inputs(i, s, t, a)
            q, k, v = q.detach(), k.detach(), v.detach()
            got = flex_attention(anchors, t, a * ATTN_BLOCK, {None}, compiled=True)(q, k, v, None)
            torch.testing.assert_close(got, split_block_attention(q, k, v, t, anchors), rtol=1e-5, atol=1e-6)
            frames.append(counter.frame_count)
    torch._dynamo.reset()
    assert frames == [1, 2, 3]
