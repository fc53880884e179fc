"""A training run's derived sizes (steps, warmup, per-rank and micro-batch sizes) and its optimizer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.config import TrainConfig
from pipeline.errors import PipelineError


@dataclass
class Plan:
    """Derived sizes of a run."""
    samples_per_epoch: int
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int
    per_rank: int
    micro: int


def make_plan(cfg: TrainConfig, samples: int, world: int) -> Plan:
    if cfg.batch_sequences % world:
        raise PipelineError(f"batch_sequences {cfg.batch_sequences} is not divisible by the world size {world}")
    per_rank = cfg.batch_sequences // world
    steps_per_epoch = samples // cfg.batch_sequences
    if steps_per_epoch == 0:
        raise PipelineError(f"the cache has {samples} samples, fewer than one global batch "
                            f"(batch_sequences {cfg.batch_sequences})")
    total = cfg.max_steps or steps_per_epoch * cfg.num_epochs
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else round(cfg.warmup_ratio * total)
    return Plan(samples, steps_per_epoch, total, min(warmup, total), per_rank, min(cfg.micro_batch_sequences, per_rank))


def make_optimizer(params: list, cfg: TrainConfig, world: int) -> torch.optim.Optimizer:
    """AdamW; with several ranks its state (8 bytes a parameter: 14 GB for the flagship drafter)
    is sharded across them by torch's ZeroRedundancyOptimizer instead of replicated. Each rank
    steps the parameters it owns and broadcasts them; the update equals plain AdamW's."""
    options = {"lr": cfg.lr, "betas": tuple(cfg.betas), "weight_decay": cfg.weight_decay}
    if world == 1:
        return torch.optim.AdamW(params, **options)
    # Imported here: torch.distributed.optim scripts its functional optimizers with torch.jit at
    # import (about a second and a warning each); only a run of several ranks needs it.
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **options)


def describe_optimizer(world: int) -> str:
    return "AdamW" if world == 1 else f"AdamW, state sharded over {world} ranks (torch ZeroRedundancyOptimizer)"
