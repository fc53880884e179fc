"""Where a command runs the target and the drafter: the one resolver of `--device` / `--dtype`
(eval, generate, verify-cache) and of extract's and train's automatic choice."""

from __future__ import annotations

import torch

from pipeline.distributed import local_rank
from pipeline.errors import PipelineError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# The test kit's simulated accelerator (harness/simulated_device.py: a device that is not the
# host, on a machine without a GPU), set only while a test runs under it.
_simulated: torch.device | None = None
# Its autocast: torch has none for a device that is not compiled in, so the kit brings its own.
_simulated_autocast = None


def simulate_accelerator(device: torch.device | None, autocast=None) -> None:
    """Make `auto` (where no GPU is) and `sim` resolve to `device`, whose autocast context is
    `autocast(dtype)`; None ends it."""
    global _simulated, _simulated_autocast
    _simulated, _simulated_autocast = device, autocast


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision on `device` (`torch.autocast`), the simulated accelerator's own under the kit."""
    if _simulated is not None and device == _simulated:
        return _simulated_autocast(dtype)
    return torch.autocast(device.type, dtype=dtype)


def simulated() -> torch.device | None:
    return _simulated


def resolve_device(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """--device / --dtype: auto = the GPU in bf16 when there is one, else the CPU in float32.
    A bare `cuda` is this process's GPU (LOCAL_RANK under torchrun)."""
    if dtype not in ("auto", *DTYPES):
        raise PipelineError(f"--dtype: must be auto, float32 or bfloat16, got {dtype!r}")
    if device == "auto" and _simulated is not None and not torch.cuda.is_available():
        device = "sim"
    if device == "sim":
        if _simulated is None:
            raise PipelineError("--device sim: the simulated accelerator exists only under the test kit")
        # float32 under auto: results then equal the host's bit for bit, which the tests compare.
        return _simulated, torch.float32 if dtype == "auto" else DTYPES[dtype]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise PipelineError(f"--device: not a device: {device!r} (auto, cpu, cuda, cuda:N)") from None
    if resolved.type not in ("cpu", "cuda"):
        raise PipelineError(f"--device: {device!r} is not supported (auto, cpu, cuda, cuda:N)")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise PipelineError(f"--device {device}: no CUDA device is available here")
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", local_rank())
    if resolved.type == "cuda" and resolved.index >= torch.cuda.device_count():
        raise PipelineError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if dtype == "auto":
        return resolved, torch.bfloat16 if resolved.type == "cuda" else torch.float32
    return resolved, DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
