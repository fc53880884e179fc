"""The kernel tier's gate, from the main suite's side (no triton, no fla here): the interpreter
patches refuse to go in without TRITON_INTERPRET=1, and tests/kernels is collected and skipped
with the tier's own command as the reason (the README's second test command)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_the_interpreter_patches_refuse_without_triton_interpret(monkeypatch):
    from harness import triton_interpreter

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        triton_interpreter.install()
    assert "triton" not in sys.modules and "fla" not in sys.modules   # refused before importing anything


def test_the_main_suite_skips_the_tier_naming_its_command():
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "-o", "addopts=", "tests/kernels/test_liger_loss.py"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:]
    assert "1 skipped" in run.stdout and "TRITON_INTERPRET=1 pytest -q -n 2 tests/kernels" in run.stdout, run.stdout[-2000:]
