"""Building a line of the training log (its schema, reader and writer: pipeline/records/
train_log.py) from a step's results."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pipeline.records.train_log import LogLine
from pipeline.training.step import StepRunner, all_sum


@dataclass
class Interval:
    """What happened since the last log line: tokens trained and time spent waiting for data."""
    tokens: int = 0
    data_wait: float = 0.0
    t0: float = 0.0

    def __post_init__(self):
        self.t0 = time.perf_counter()


def log_record(result: dict, trainer: StepRunner, interval: Interval, *, step, epoch, position, plan, elapsed) -> LogLine:
    seconds = max(time.perf_counter() - interval.t0, 1e-9)
    tokens = float(all_sum(torch.tensor(float(interval.tokens), dtype=torch.float64), trainer.world, trainer.device))
    m = result["metrics"]
    return LogLine(
        step=step, epoch=epoch, loss=result["loss"], ce=result["ce"], accuracy=m["accuracy"], top4_acc=m["top4_acc"],
        top8_acc=m["top8_acc"], avg_streak=m["avg_streak"], ddtree_streak4=m["ddtree_streak4"],
        ddtree_streak8=m["ddtree_streak8"], pos_acc=m["pos_acc"], lr=result["lr"], grad_norm=result["grad_norm"],
        noise_std=result["noise_std"], tok_per_sec=tokens / seconds, elapsed_s=elapsed,
        epoch_progress=epoch + position / plan.samples_per_epoch, steps_per_epoch=plan.steps_per_epoch,
        supervised_slots=m["supervised_slots"], outside_vocab=m.get("outside_vocab"), data_wait_frac=interval.data_wait / seconds,
        loss_terms=dict(result["loss_terms"]) if trainer.objective.loss != "ce" else {},
    )

