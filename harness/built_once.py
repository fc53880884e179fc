"""A session fixture's files built once per test run, however many pytest-xdist workers need them.

Each worker is its own process with its own session, so a plain session fixture (the trained
drafter: two minutes of training) would be built once a worker. Here the first worker to ask
builds into a folder beside every worker's temporary root, under a file lock (`filelock`, which
torch and huggingface_hub already depend on); the others wait on the lock and then read what it
built. A marker written last says the build finished: a worker that died mid-build leaves no
marker, and the next one starts the folder over. Without xdist it is the session's own folder.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from filelock import FileLock

DONE = ".built"


def shared_root(tmp_path_factory) -> Path:
    """The folder every worker of this run sees: the parent of a worker's base temporary folder
    (pytest-xdist gives each worker `<run>/popen-gwN`), the session's own without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """`root/name`, built by `build(folder)` by the first worker of this run that asks."""
    root = shared_root(tmp_path_factory)
    folder = root / name
    with FileLock(str(root / f"{name}.lock")):
        if not (folder / DONE).exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            build(folder)
            (folder / DONE).touch()
    return folder
