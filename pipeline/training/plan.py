"""A training run's derived sizes (steps, warmup, per-rank and micro-batch sizes) and its optimizer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.config import Optimizer, Schedule
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


def make_plan(schedule: Schedule, optimization: Optimizer, samples: int, world: int) -> Plan:
    """The run's sizes from its schedule, the warmup from the optimizer's settings."""
    if schedule.batch_sequences % world:
        raise PipelineError(f"batch_sequences {schedule.batch_sequences} is not divisible by the world size {world}")
    per_rank = schedule.batch_sequences // world
    steps_per_epoch = samples // schedule.batch_sequences
    if steps_per_epoch == 0:
        raise PipelineError(f"the cache has {samples} samples, fewer than one global batch "
                            f"(batch_sequences {schedule.batch_sequences})")
    total = schedule.max_steps or steps_per_epoch * schedule.num_epochs
    warmup = (optimization.warmup_steps if optimization.warmup_steps is not None
              else round(optimization.warmup_ratio * total))
    return Plan(samples, steps_per_epoch, total, min(warmup, total), per_rank,
                min(schedule.micro_batch_sequences, per_rank))


def make_optimizer(params: list, optimization: Optimizer, world: int) -> torch.optim.Optimizer:
    """AdamW; with several ranks its state (8 bytes a parameter: 14 GB for the flagship drafter)
    is sharded across them by torch's ZeroRedundancyOptimizer instead of replicated. Each rank
    steps the parameters it owns and broadcasts them; the update equals plain AdamW's."""
    options = {"lr": optimization.lr, "betas": tuple(optimization.betas), "weight_decay": optimization.weight_decay}
    if world == 1:
        return torch.optim.AdamW(params, **options)
    # Imported here: torch.distributed.optim scripts its functional optimizers with torch.jit at
    # import (about a second and a warning each); only a run of several ranks needs it.
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **options)


def describe_optimizer(world: int) -> str:
    return "AdamW" if world == 1 else f"AdamW, state sharded over {world} ranks (torch ZeroRedundancyOptimizer)"


def gathered_state(optimizer: torch.optim.Optimizer, rank: int, world: int, device) -> dict | None:
    """The whole optimizer state as plain AdamW's `state_dict()` (what a checkpoint
    holds, and what AdamW and ZeroRedundancyOptimizer both load, on any number of ranks), on
    rank 0; None on the others. A collective: every rank calls it.

    Not torch's `consolidate_state_dict`: that pickles each rank's state and broadcasts it to
    every rank (its own code calls this wasteful), so each sender holds three serialized copies of
    its state at once and every rank receives every other's: 5.4 GB more on a rank of a one-layer
    drafter at hidden 5120, enough for the OOM killer on a node that trains fine between
    checkpoints (issue 40). Here each tensor goes once, point to point, to rank 0, into a buffer
    of its own shape; the other ranks hold nothing extra."""
    if world == 1:
        return optimizer.state_dict()
    import torch.distributed as dist

    # Parameters are numbered as every torch optimizer numbers them in its state_dict: in order,
    # group after group (ZeroRedundancyOptimizer's param_groups are the global ones).
    params = [p for group in optimizer.param_groups for p in group["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    local = optimizer.optim  # this rank's AdamW over the parameters ZeroRedundancyOptimizer gave it
    mine = {index[id(p)]: local.state[p] for group in local.param_groups for p in group["params"] if local.state.get(p)}
    owner = torch.zeros(len(params), dtype=torch.long, device=device)
    for i in mine:
        owner[i] = rank + 1
    dist.all_reduce(owner)  # 1 + the rank holding each parameter's state; 0: none yet (no step taken)
    amsgrad = any(g.get("amsgrad") for g in optimizer.param_groups)
    keys = ("step", "exp_avg", "exp_avg_sq", *(("max_exp_avg_sq",) if amsgrad else ()))
    state = {}
    for i, p in enumerate(params):
        src = int(owner[i]) - 1
        if src < 0:
            continue
        if src == 0:
            if rank == 0:
                state[i] = {k: v.detach().cpu() for k, v in mine[i].items()}
            continue
        if rank == src:
            for k in keys:
                value = mine[i][k].detach()
                dist.send((value.float() if k == "step" else value).to(device).contiguous(), dst=0)
        elif rank == 0:
            received = {}
            for k in keys:
                buffer = torch.empty((), dtype=torch.float32, device=device) if k == "step" else torch.empty_like(p)
                dist.recv(buffer, src=src)
                received[k] = buffer.cpu()
            state[i] = received
    if rank != 0:
        return None
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}
