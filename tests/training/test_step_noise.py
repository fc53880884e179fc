"""--noise-std (DESIGN 3.6): the training step adds Gaussian noise of that std to the context
features it trains on and to nothing else. The labels, weights and block tokens stay those the
stored target outputs give, and the sample as read from the cache is untouched. Checked through
the step itself (StepRunner.step), where training adds it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness import loss_batches as lb
from pipeline.cache.schema import HIDDEN
from pipeline.config import Data, Objective, Optimizer
from pipeline.training.batch import anchor_generator, prepare
from pipeline.training.plan import Plan
from pipeline.training.step import StepRunner

STD = 0.5


@pytest.mark.parametrize("schedule, expected_std", [("constant", STD), ("linear", STD * (1 - 1 / 4))])
def test_the_steps_noise_touches_the_context_features_only(schedule, expected_std):
    objective = Objective(noise_std=STD, noise_schedule=schedule)
    drafter = lb.drafter(seed=0)
    params = [p for p in drafter.parameters() if p.requires_grad]
    plan = Plan(samples_per_epoch=2, steps_per_epoch=4, total_steps=4, warmup_steps=0, per_rank=2, micro=2)
    runner = StepRunner(plan, drafter, torch.optim.SGD(params, lr=0.0), params, torch.device("cpu"), 0, 1,
                        objective=objective, optimization=Optimizer(lr=1e-3), data=Data(num_anchors=9), seed=0,
                        dtype="auto", gamma=4.0)
    samples = [lb.sample(n, s) for s, n in enumerate((300, 120))]
    stored = [sample[HIDDEN].copy() for sample in samples]

    def prepared():
        return [(s, prepare(sample, block_size=lb.B, num_anchors=9, max_length=4096, mask_token_id=lb.V - 1,
                            gamma=4.0, generator=anchor_generator(0, 0, s))) for s, sample in enumerate(samples)]

    clean, noisy = prepared(), prepared()
    result = runner.step(noisy, 1, with_metrics=False)
    assert result["noise_std"] == pytest.approx(expected_std)
    for (_, c), (_, n) in zip(clean, noisy):
        added = (n.hidden - c.hidden).double()
        assert added.std().item() == pytest.approx(expected_std, rel=0.03)
        assert abs(added.mean().item()) < 0.02
        assert torch.equal(n.labels, c.labels) and torch.equal(n.weights, c.weights)
        assert torch.equal(n.block_ids, c.block_ids) and torch.equal(n.anchors, c.anchors)
    for sample, before in zip(samples, stored):
        np.testing.assert_array_equal(sample[HIDDEN], before)
