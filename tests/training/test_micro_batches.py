"""A step's sequences cut into micro-batches of like size (pipeline/training/micro_batches.py):
the cut is the least padded work over every way to cut the sorted sequences (an oracle that
enumerates them all), under either rule: the CPU's (padded work plus a cost a forward) and an
accelerator's (the fewest forwards, then the least padded work); a step cut by size computes the
gradient that the stream's order computes (the same sum in another order), and a step on the
simulated accelerator, in one forward, the gradient of the CPU's several."""

from __future__ import annotations

import functools
import itertools
import math
import random

import pytest
import torch

from harness import loss_batches as lb
from harness.simulated_device import host, simulated_accelerator
from pipeline.config import Data, Objective, Optimizer
from pipeline.training.batch import anchor_generator, prepare
from pipeline.training.micro_batches import FORWARD_COST, Sizes, cut, forward_cost_on
from pipeline.training.plan import Plan
from pipeline.training.step import StepRunner


def oracle_cost(groups: list[list[Sizes]], per_query: int, forward_cost: int) -> int:
    """The rule, written out: each micro-batch pads every sequence to its most anchors and its
    longest context, and costs a forward besides."""
    return sum(len(g) * max(s.anchors for s in g) * (max(s.tokens for s in g) + per_query) + forward_cost for g in groups)


def every_cut(sequence: list, cap: int):
    """Every way to cut `sequence` into consecutive runs of at most `cap`."""
    n = len(sequence)
    for mask in itertools.product((False, True), repeat=n - 1):
        bounds = [0, *(i + 1 for i, c in enumerate(mask) if c), n]
        runs = [sequence[a:b] for a, b in zip(bounds, bounds[1:])]
        if all(len(r) <= cap for r in runs):
            yield runs


@pytest.mark.parametrize("seed", range(12))
def test_the_cut_is_the_least_work_of_every_cut_of_the_sorted_sequences(seed):
    rng = random.Random(seed)
    n, cap = rng.randint(1, 8), rng.randint(1, 8)
    sizes = [Sizes(anchors=rng.randint(1, 64), tokens=rng.randint(8, 512)) for _ in range(n)]
    per_query, forward_cost = rng.choice([0, 50, 550]), rng.choice([0, 5_000, 70_000])
    runs = cut(sizes, cap, per_query=per_query, forward_cost=forward_cost)
    assert sorted(i for run in runs for i in run) == list(range(n))           # every sequence once
    assert all(1 <= len(run) <= cap for run in runs)
    ranked = sorted(sizes, key=lambda s: (s.anchors, s.tokens), reverse=True)
    best = min(oracle_cost(c, per_query, forward_cost) for c in every_cut(ranked, cap))
    assert oracle_cost([[sizes[i] for i in run] for run in runs], per_query, forward_cost) == best
    if cap >= n:  # one micro-batch of all of them, as the stream's order would run, is one of the cuts
        assert best <= oracle_cost([sizes], per_query, forward_cost)


def test_equal_sizes_stay_together_and_unequal_ones_part():
    same = [Sizes(10, 100)] * 4
    assert cut(same, 8, per_query=10, forward_cost=1) == [[0, 1, 2, 3]]
    apart = [Sizes(1, 10), Sizes(100, 500)]   # padding the short one would cost more than a forward
    assert cut(apart, 8, per_query=10, forward_cost=1) == [[1], [0]]
    assert cut(apart, 8, per_query=10, forward_cost=10**9) == [[1, 0]]


def random_share(rng: random.Random, n_max: int) -> tuple[list[Sizes], int, int]:
    n, cap = rng.randint(1, n_max), rng.randint(1, n_max)
    sizes = [Sizes(anchors=rng.randint(1, 64), tokens=rng.randint(8, 512)) for _ in range(n)]
    return sizes, cap, rng.choice([0, 50, 550])


def padded(groups: list[list[Sizes]], per_query: int) -> int:
    return oracle_cost(groups, per_query, 0)


@pytest.mark.parametrize("seed", range(12))
def test_the_accelerators_cut_is_the_fewest_forwards_then_the_least_padding(seed):
    """The oracle, written from the rule: of every cut of the sorted sequences into runs of at
    most `cap`, those with the fewest runs, and of those the least padded work."""
    rng = random.Random(100 + seed)
    sizes, cap, per_query = random_share(rng, 9)
    runs = cut(sizes, cap, per_query=per_query, forward_cost=None)
    assert sorted(i for run in runs for i in run) == list(range(len(sizes)))
    assert all(1 <= len(run) <= cap for run in runs)
    assert len(runs) == math.ceil(len(sizes) / cap)                               # the memory bound's fewest
    ranked = sorted(sizes, key=lambda s: (s.anchors, s.tokens), reverse=True)
    fewest, least = min((len(c), padded(c, per_query)) for c in every_cut(ranked, cap))
    assert (len(runs), padded([[sizes[i] for i in run] for run in runs], per_query)) == (fewest, least)


def least_cost(ranked: list[Sizes], cap: int, per_query: int, forward_cost: int) -> int:
    """The least cost of cutting `ranked` into runs of at most `cap`, by plain recursion over the
    last run (an independent reference where enumerating every cut is too slow)."""
    @functools.cache
    def upto(i: int) -> int:
        if i == 0:
            return 0
        return min(upto(j) + oracle_cost([ranked[j:i]], per_query, forward_cost) for j in range(max(0, i - cap), i))
    return upto(len(ranked))


@pytest.mark.parametrize("seed", range(4))
def test_long_shares_are_cut_at_the_least_cost_under_both_rules(seed):
    """Shares too long to enumerate (40-80 sequences, runs of up to 24): the same least cost as
    the recursion, on the CPU's rule and on the accelerator's (its forwards priced above any
    padding: the work of every sequence padded to the largest, plus one)."""
    rng = random.Random(200 + seed)
    n, cap = rng.randint(40, 80), rng.randint(2, 24)
    sizes = [Sizes(anchors=rng.randint(1, 512), tokens=rng.randint(8, 3072)) for _ in range(n)]
    ranked = sorted(sizes, key=lambda s: (s.anchors, s.tokens), reverse=True)
    per_query = 550
    runs = cut(sizes, cap, per_query=per_query, forward_cost=FORWARD_COST)
    groups = [[sizes[i] for i in run] for run in runs]
    assert oracle_cost(groups, per_query, FORWARD_COST) == least_cost(ranked, cap, per_query, FORWARD_COST)
    above_any_padding = n * max(s.anchors for s in sizes) * (max(s.tokens for s in sizes) + per_query) + 1
    runs = cut(sizes, cap, per_query=per_query, forward_cost=None)
    groups = [[sizes[i] for i in run] for run in runs]
    assert len(runs) == math.ceil(n / cap)
    assert oracle_cost(groups, per_query, above_any_padding) == least_cost(ranked, cap, per_query, above_any_padding)


def test_the_rule_follows_the_device():
    assert forward_cost_on(torch.device("cpu")) == FORWARD_COST
    assert forward_cost_on(torch.device("cuda", 0)) is None
    with simulated_accelerator() as sim:
        assert forward_cost_on(sim.device) is None


def test_a_step_cut_by_size_computes_the_stream_orders_gradient():
    """Sequences of very different lengths in one step of up to 4 a micro-batch: the same loss and
    the same gradient whether they run in the stream's order or cut by size (which here does cut)."""
    settings = dict(objective=Objective(), optimization=Optimizer(lr=1e-3), data=Data(num_anchors=9), seed=0, dtype="auto")
    lengths = (300, 20, 280, 25, 60)

    def run(stream_order: bool):
        drafter = lb.drafter(seed=0)
        params = [p for p in drafter.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(params, lr=0.0)   # no update: the gradient is what is compared
        plan = Plan(samples_per_epoch=5, steps_per_epoch=1, total_steps=1, warmup_steps=0, per_rank=5, micro=4)
        runner = StepRunner(plan, drafter, optimizer, params, torch.device("cpu"), 0, 1, gamma=4.0, **settings)
        runner.stream_order = stream_order
        batch = [(s, prepare(lb.sample(n, s), block_size=lb.B, num_anchors=9, max_length=4096, mask_token_id=lb.V - 1,
                             gamma=4.0, generator=anchor_generator(0, 0, s))) for s, n in enumerate(lengths)]
        groups = runner.micro_batches([(sid, seq) for sid, seq in batch])
        result = runner.step(batch, 0, with_metrics=True)
        return result, [p.grad.clone() for p in params], [[sid for sid, _ in g] for g in groups]

    ordered, ordered_grads, ordered_groups = run(True)
    by_size, by_size_grads, by_size_groups = run(False)
    assert ordered_groups == [[0, 1, 2, 3], [4]]
    assert len(by_size_groups) >= 2 and by_size_groups != ordered_groups
    assert by_size["loss"] == pytest.approx(ordered["loss"], rel=1e-6)
    assert by_size["metrics"] == ordered["metrics"]        # hits and counts: exact sums
    for a, b in zip(by_size_grads, ordered_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_step_on_the_accelerator_makes_one_forward_and_the_cpus_gradient():
    """The same five sequences, up to 5 a micro-batch: the CPU cuts them by size into several
    forwards, the simulated accelerator runs one; the loss and the gradient are the same."""
    settings = dict(objective=Objective(), optimization=Optimizer(lr=1e-3), data=Data(num_anchors=32), seed=0, dtype="auto")
    lengths = (1000, 20, 900, 25, 60)   # padding a short one to a long one costs more than a forward

    def run(device):
        drafter = lb.drafter(seed=0).to(device)
        params = [p for p in drafter.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(params, lr=0.0)   # no update: the gradient is what is compared
        plan = Plan(samples_per_epoch=5, steps_per_epoch=1, total_steps=1, warmup_steps=0, per_rank=5, micro=5)
        runner = StepRunner(plan, drafter, optimizer, params, device, 0, 1, gamma=4.0, **settings)
        batch = [(s, prepare(lb.sample(n, s), block_size=lb.B, num_anchors=32, max_length=4096, mask_token_id=lb.V - 1,
                             gamma=4.0, generator=anchor_generator(0, 0, s))) for s, n in enumerate(lengths)]
        forwards = len(runner.micro_batches(batch))
        result = runner.step(batch, 0, with_metrics=True)
        return result, [host(p.grad).clone() for p in params], forwards

    on_cpu, cpu_grads, cpu_forwards = run(torch.device("cpu"))
    with simulated_accelerator() as sim:
        on_device, device_grads, device_forwards = run(sim.device)
    assert cpu_forwards >= 2 and device_forwards == 1
    assert on_device["loss"] == pytest.approx(on_cpu["loss"], rel=1e-6)
    assert on_device["metrics"] == on_cpu["metrics"]
    for a, b in zip(device_grads, cpu_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
