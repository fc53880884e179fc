"""No silent skips in CI (issue 81): a test whose prerequisite the machine should have (user
namespaces, a C compiler, the shared fixtures, an installed test extra) skips with its reason on a
developer's machine and fails with that reason under CI=true. Checked by running pytest on a small
test file in a child process, as CI runs the suite."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness.runs import REPO

PROBE = '''
from harness.prerequisites import importable, missing, needs

@needs(False, "the probe machine lacks a widget")
def test_marked():
    pass

def test_called():
    missing("the probe machine lacks a gadget")

def test_import():
    importable("no_such_module_for_the_probe", "the probe extra is not installed")

@needs(True, "never shown")
def test_present():
    pass
'''


def run_probe(tmp_path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT")}
    if ci is not None:
        env["CI"] = ci
    # harness/ from the repository, and its hook that reads the marks loaded as tests/conftest.py loads it.
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-p", "harness.prerequisites", "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path),
                           "-o", "addopts=", "-o", "testpaths=", str(tmp_path / "test_probe.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("ci", [None, "false"])
def test_a_missing_prerequisite_skips_with_its_reason_off_ci(tmp_path, ci):
    out = run_probe(tmp_path, ci)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed, 3 skipped" in out.stdout, out.stdout
    for reason in ("lacks a widget", "lacks a gadget", "the probe extra is not installed"):
        assert reason in out.stdout, out.stdout   # -rs names each reason


def test_under_ci_a_missing_prerequisite_fails_naming_it(tmp_path):
    out = run_probe(tmp_path, "true")
    assert out.returncode == 1, out.stdout + out.stderr
    # A mark fails the test at setup (pytest counts an error), a call fails it in the body.
    assert "2 failed, 1 passed, 1 error" in out.stdout, out.stdout
    for reason in ("the probe machine lacks a widget", "the probe machine lacks a gadget", "the probe extra is not installed"):
        assert f"CI=true and a prerequisite is missing: {reason}" in out.stdout, out.stdout
