"""The one --device / --dtype resolver (eval, generate, verify-cache; extract and train use its
automatic choice), checked against the rule written out: auto is the GPU in bfloat16 where there
is one, else the CPU in float32; the dtype is checked first; a bare `cuda` is this process's GPU."""

from __future__ import annotations

import pytest
import torch

from harness.runs import cli_here
from pipeline.devices import resolve_device
from pipeline.errors import PipelineError

HAS_CUDA = torch.cuda.is_available()


def test_auto_and_explicit_choices():
    expected = (torch.device("cuda", 0), torch.bfloat16) if HAS_CUDA else (torch.device("cpu"), torch.float32)
    assert resolve_device("auto", "auto") == expected
    assert resolve_device("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)
    assert resolve_device("cpu", "auto") == (torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("device, dtype, message", [
    ("mps", "float16", "--dtype: must be auto, float32 or bfloat16, got 'float16'"),   # the dtype first
    ("meta", "auto", "--device: 'meta' is not supported"),
    ("nonsense:0", "auto", "--device: not a device"),
])
def test_refusals_name_the_option(device, dtype, message):
    with pytest.raises(PipelineError, match=message):
        resolve_device(device, dtype)


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only answer")
def test_a_gpu_asked_for_on_a_cpu_machine_is_one_line():
    for device in ("cuda", "cuda:1"):
        with pytest.raises(PipelineError, match=f"--device {device}: no CUDA device is available here"):
            resolve_device(device, "auto")
    # verify-cache takes the same resolver (cuda:N included) and answers before reading the cache
    result = cli_here("verify-cache", "no-such-cache", "--device", "cuda:1")
    assert result.returncode == 2 and "--device cuda:1: no CUDA device is available here" in result.stderr, result
