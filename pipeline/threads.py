"""How many CPU threads torch uses: `pipeline --threads N|auto`.

torch's default intra-op thread count is every core of the machine, whatever else runs there. On a
machine shared with other jobs that oversubscribes the cores, and torch's threads then wait on one
another at every operation (measured in BENCHMARKS.md, "CPU threads on a busy machine"). `auto`
(the default) keeps an explicit OMP_NUM_THREADS (torchrun sets 1 per rank when it starts several),
and otherwise takes the cores that are idle right now: a 0.2 s sample of /proc/stat, at least 1 and
at most torch's default. On an idle machine that is torch's default.
"""

from __future__ import annotations

import os
import time

from pipeline.errors import PipelineError


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)   # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def busy_cores(seconds: float = 0.2) -> float | None:
    """How many of the machine's cores other processes keep busy now (this one sleeps meanwhile)."""
    before = _cpu_times()
    time.sleep(seconds)
    after = _cpu_times()
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * (os.cpu_count() or 1)


_TORCH_DEFAULT: list[int] = []   # torch's own count, read before this module first changes it


def torch_default() -> int:
    """torch's default thread count in this process (a later `auto` in the same process, e.g. the
    CLI invoked in-process twice, starts from it again, not from the count an earlier call set)."""
    import torch

    if not _TORCH_DEFAULT:
        _TORCH_DEFAULT.append(torch.get_num_threads())
    return _TORCH_DEFAULT[0]


def choose_threads(option: str | int) -> tuple[int, str]:
    """(threads, why) for `--threads`: an integer >= 1, or 'auto'."""
    default = torch_default()
    if str(option) != "auto":
        try:
            count = int(option)
        except ValueError:
            count = 0
        if count < 1:
            raise PipelineError(f"--threads must be 'auto' or an integer >= 1, got {option!r}")
        return count, "--threads"
    if os.environ.get("OMP_NUM_THREADS"):
        return default, "OMP_NUM_THREADS"
    busy = busy_cores()
    if busy is None:
        return default, "torch's default (no /proc/stat)"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    idle = max(1, int(usable - busy + 0.5))
    if idle >= default:
        return default, "torch's default (the cores are idle)"
    return idle, f"{busy:.1f} of {os.cpu_count()} cores busy with other processes"


def apply_threads(option: str | int) -> tuple[int, str]:
    import torch

    torch_default()
    count, why = choose_threads(option)
    torch.set_num_threads(count)
    return count, why
