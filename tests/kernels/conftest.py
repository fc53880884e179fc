"""The kernel tier: fla's and liger's Triton kernels on the CPU under Triton's interpreter, compared
with the torch path. It runs in its own venv (the `kernels` extra) as the README's second test
command, `TRITON_INTERPRET=1 pytest -q tests/kernels`.

In the main suite (no TRITON_INTERPRET, no triton: transformers must keep binding the torch path
there, DESIGN 6) every test here is collected and skipped with that command as the reason, rather
than left out silently: the main run's summary shows the tier exists and where it runs. The test
modules import fla, triton and liger only inside tests and fixtures, so collecting them costs
nothing there. With TRITON_INTERPRET=1 the interpreter patches go in before anything imports fla;
a missing kernel package then fails the tier instead of skipping it."""

import os
from pathlib import Path

import pytest

IN_TIER = os.environ.get("TRITON_INTERPRET") == "1"
HERE = Path(__file__).resolve().parent
SKIP_REASON = ("kernel tier: runs in its own venv (pip install '.[kernels]') as "
               "`TRITON_INTERPRET=1 pytest -q -n 2 tests/kernels` (README: Run the tests)")

if IN_TIER:
    from harness import triton_interpreter

    triton_interpreter.install()


def pytest_collection_modifyitems(config, items):
    if IN_TIER:
        return
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))
