"""The order in which pytest-xdist hands test files to its workers (`--dist loadfile`).

The shared trained drafter (tests/conftest.py `trained_run`) takes about two minutes to build and
is built once per run (harness/built_once.py): the first worker to ask builds it, and any other
worker that asks meanwhile waits on its lock doing nothing. xdist's own order (files by number
of tests, most first) handed test_sampling and test_eval out together, so one of the two workers
sat idle for those two minutes (125 s of the main suite's 1,225 s). This order starts one file
that needs the drafter first, so it is built at once; gives the other worker the files that do
not need it; and keeps the other files that need it for last, when it is there. The first is
test_eval: in the transformers range tier (.ci/run) its work after the build about equals the
other worker's (the target-model and extract files, then test_sampling), so both end together.

pyproject's addopts pass `--no-loadscope-reorder`, so xdist keeps this order instead of its own.
"""

from __future__ import annotations

from typing import Iterable, Protocol


class Item(Protocol):
    nodeid: str
    fixturenames: Iterable[str]


def file_of(item: Item) -> str:
    return item.nodeid.split("::", 1)[0]


def ordered(items: list, shared: str, builder: str) -> list:
    """`items` with each file's tests kept together and in their order, the files in three groups:
    the file `builder` if it was collected and uses the fixture `shared` (else the first file that
    uses it), then the files that do not use it, then the other files that use it; within a
    group, files with more tests first (xdist's own order), then as collected. Deterministic, so
    every worker collects the same order (xdist requires it)."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(file_of(item), []).append(item)
    uses = {name: any(shared in item.fixturenames for item in tests) for name, tests in files.items()}
    by_count = sorted(files, key=lambda name: -len(files[name]))   # stable: ties stay as collected
    users = [name for name in by_count if uses[name]]
    if builder in users:
        users.remove(builder)
        users.insert(0, builder)
    order = users[:1] + [name for name in by_count if not uses[name]] + users[1:]
    return [item for name in order for item in files[name]]
