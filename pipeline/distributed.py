"""Process layout under torchrun, and the one place that reads torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, TORCHELASTIC_*). Single process without torchrun.

Extract: world = dp groups x tp ranks (`init_layout`); ranks r = g * tp + t: group g (data
parallel) splits the shards; the tp ranks of one group run one tensor-parallel model together,
and only the group's first rank writes. Train: every rank is data parallel (`init_data_parallel`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeline.errors import PipelineError


@dataclass(frozen=True, kw_only=True)
class Layout:
    world_size: int = 1
    rank: int = 0
    tp: int = 1
    tp_group: object = None

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def is_writer(self) -> bool:
        return self.rank % self.tp == 0

    @property
    def group_ranks(self) -> list[int]:
        first = self.dp_rank * self.tp
        return list(range(first, first + self.tp))

    def record(self) -> dict:
        return {"world_size": self.world_size, "tp": self.tp, "dp": self.dp}

    def broadcast_from_writer(self, value):
        """The writer's value on every rank of its tensor-parallel group."""
        if self.tp == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=self.group_ranks[0], group=self.tp_group)
        return box[0]


def launched_rank() -> int:
    """This process's global rank as torchrun set it (0 without torchrun)."""
    return int(os.environ.get("RANK", "0"))


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    """This process's rank on its node (its GPU index)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def _init_process_group() -> None:
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")


def init_data_parallel() -> tuple[int, int]:
    """(rank, world size) of a data-parallel run; the process group is started when world > 1."""
    world = launched_world_size()
    if world == 1:
        return 0, 1
    _init_process_group()
    return dist.get_rank(), world


def init_layout(tp: int) -> Layout:
    world_size = launched_world_size()
    if world_size == 1:
        if tp != 1:
            raise PipelineError(f"--tp {tp} needs {tp} processes: launch with torchrun --nproc-per-node {tp}")
        return Layout()
    if world_size % tp:
        raise PipelineError(f"world size {world_size} is not a multiple of --tp {tp}")
    _init_process_group()
    rank = dist.get_rank()
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank())
    tp_group = None
    if tp > 1:
        for g in range(world_size // tp):
            group = dist.new_group(list(range(g * tp, (g + 1) * tp)))
            if rank // tp == g:
                tp_group = group
    return Layout(world_size=world_size, rank=rank, tp=tp, tp_group=tp_group)


def broadcast_from_rank0(value, world: int):
    """Rank 0's `value` (any picklable object) on every rank of the default group; `value` itself
    when world is 1."""
    if world == 1:
        return value
    # NCCL carries the object through a GPU: this rank's own, named here so that no rank falls
    # back to GPU 0 whatever device the caller has set (the run's claim comes before any is set)
    device = torch.device("cuda", local_rank()) if dist.get_backend() == "nccl" else None
    box = [value]
    dist.broadcast_object_list(box, src=0, device=device)
    return box[0]


def decided_on_rank0(decide, *, rank: int, world: int, what: str):
    """`decide()` run on rank 0 alone and its result on every rank: for work every rank would
    otherwise repeat (reading the whole cache). A PipelineError it raises stops every rank with
    the same line; any other error stops rank 0 with its traceback and the others with one line
    naming it, so no rank waits on a broadcast that rank 0 never sends."""
    result, refusal = None, None
    if rank == 0:
        try:
            result = decide()
        except PipelineError as e:
            refusal = str(e)
        except Exception as e:  # noqa: BLE001 - told to the other ranks, then raised here as it is
            first_line = next(iter(str(e).splitlines()), "")
            broadcast_from_rank0((None, f"rank 0 failed while {what} ({type(e).__name__}: {first_line})"), world)
            raise
    result, refusal = broadcast_from_rank0((result, refusal), world)
    if refusal is not None:
        raise PipelineError(refusal)
    return result


SHARED_STORE_OPT_OUT = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def first_launch() -> bool:
    """False in a worker that torchrun restarted (--max-restarts): one-time warnings stay quiet."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0


def elastic_restart_hazard() -> str | None:
    """A warning when torchrun may restart workers (--max-restarts > 0) while its rendezvous shares
    one TCP store across rounds (torch's default): that store keeps the previous round's
    process-group keys, so a restarted worker can read its peer's old address and hang or fail in
    gloo's connect (measured: 3 of 7 two-node restarts hung, 10 of 10 completed with the opt-out)."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) < 1 or os.environ.get(SHARED_STORE_OPT_OUT) == "1":
        return None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return (f"torchrun --max-restarts with a shared rendezvous store: set {SHARED_STORE_OPT_OUT}=1 in the "
            "launcher's environment, or a restarted worker can hang connecting to its peers (README, several nodes)")


def finish_distributed() -> None:
    """Destroy the process group after a command that succeeded. A process that exits with gloo's
    process group alive can die at interpreter teardown ("terminate called without an active
    exception", SIGABRT: gloo's worker threads outlive the interpreter; pytorch/pytorch#179291 says
    why), which a torchrun job then reports as a failed rank though all its work was done: seen
    twice here, once after a two-node training and once after a TP 2 extraction. Only on success:
    after an error another rank may still be inside a collective, and tearing down could hang."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
