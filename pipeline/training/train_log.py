"""The training log (RUN/train_log.jsonl, one JSON line per logged step, DESIGN 4) and its
companion RUN/verdicts.jsonl: building a line, reading them back (a torn last line from a killed
run left out) and trimming them to the step a run resumes from."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.training.step import StepRunner, all_sum


@dataclass
class Interval:
    """What happened since the last log line: tokens trained and time spent waiting for data."""
    tokens: int = 0
    data_wait: float = 0.0
    t0: float = 0.0

    def __post_init__(self):
        self.t0 = time.perf_counter()


def log_record(result: dict, trainer: StepRunner, interval: Interval, *, step, epoch, position, plan, elapsed) -> dict:
    seconds = max(time.perf_counter() - interval.t0, 1e-9)
    tokens = float(all_sum(torch.tensor(float(interval.tokens), dtype=torch.float64), trainer.world, trainer.device))
    m = result["metrics"]
    return {
        "step": step, "epoch": epoch, "loss": result["loss"], "accuracy": m["accuracy"], "top4_acc": m["top4_acc"],
        "top8_acc": m["top8_acc"], "avg_streak": m["avg_streak"], "ddtree_streak4": m["ddtree_streak4"],
        "ddtree_streak8": m["ddtree_streak8"], "pos_acc": m["pos_acc"], "lr": result["lr"],
        "grad_norm": result["grad_norm"], "noise_std": result["noise_std"], "tok_per_sec": tokens / seconds,
        "elapsed_s": elapsed,
        # Beyond DESIGN 4: where in the data, and how long this rank waited for it.
        "epoch_progress": epoch + position / plan.samples_per_epoch, "steps_per_epoch": plan.steps_per_epoch,
        "supervised_slots": m["supervised_slots"], "data_wait_frac": interval.data_wait / seconds,
        # Another objective than the first recipe's: each term's share of the loss on its own.
        **({f"loss_{name}": value for name, value in result["loss_terms"].items()}
           if trainer.cfg.loss != "ce" else {}),
    }


def read_log(path: Path) -> list[dict]:
    """The log's records (a torn last line left out)."""
    records = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records


def append_json(path: Path, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def trim_log(path: Path, step: int) -> None:
    """Keep the log lines up to `step` (the checkpoint resumed from): the resumed run re-logs the rest."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line).get("step", math.inf) <= step:
                kept.append(line)
        except json.JSONDecodeError:
            break  # a torn last line from a killed run
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(x + "\n" for x in kept), encoding="utf-8")
    os.replace(tmp, path)
