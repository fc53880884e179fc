"""What a test needs from the machine, and what happens where it is missing.

On a developer's machine a missing prerequisite (user namespaces, a C compiler, the project's
shared fixtures, an installed test extra) skips the test with the reason. Under CI (CI=true) the
machine is the project's own and must have every one of them: there the same test fails with the
reason, so a machine that silently lost one (e.g. Ubuntu 24.04's AppArmor default, which denies
unprivileged user namespaces) cannot turn a guard into a skip. Opt-in tiers (DFLASH_SLOW,
DFLASH_VLLM, the kernel tier's TRITON_INTERPRET) and hardware a CPU machine never has (CUDA) are
choices, not prerequisites: they keep plain skips, which `pytest -rs` lists."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def missing(reason: str) -> NoReturn:
    """Skip for `reason`, or fail with it under CI. At a module's top level too (a whole file that
    needs it: there CI's failure is the file's collection error)."""
    if in_ci():
        pytest.fail(f"CI=true and a prerequisite is missing: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def needs(available: bool, reason: str) -> pytest.MarkDecorator:
    """A mark: the test runs where `available`, else `missing(reason)` at setup (the hook below)."""
    return pytest.mark.prerequisite(available=bool(available), reason=reason)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The hook that reads `needs` marks: tests/conftest.py takes it from here (one definition;
    also loadable alone with `-p harness.prerequisites`)."""
    for mark in item.iter_markers("prerequisite"):
        if not mark.kwargs["available"]:
            missing(mark.kwargs["reason"])


def importable(module: str, reason: str):
    """pytest.importorskip, but `missing` where the import fails."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as e:
        why = f"{reason} ({e})"
    missing(why)   # outside the except: the report shows the reason, not a chained traceback
