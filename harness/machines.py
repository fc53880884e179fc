"""Real processes that look, to the run-directory claim (pipeline/training/run_claim.py), as if
they ran on another machine or in another container, or on a mount without working locks:

- another machine: its own kernel boot id (a file bind-mounted over
  /proc/sys/kernel/random/boot_id in a private user + mount namespace, `unshare`), or none at all
  (an empty file: a system without one);
- another container: its own pid namespace (its processes are numbered from 1) and host name;
- a cluster mount whose flock does not work: `flock(2)` failing with ENOLCK, as on such mounts,
  by a one-function C library preloaded into the process (LD_PRELOAD), compiled once a test run.

Test scaffolding: nothing in the pipeline knows of it. The processes are real Pythons running the
pipeline's own code; only what they can learn of their machine is changed, the way a container
runtime or another node changes it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


from harness.built_once import built_once
from harness.runs import REPO
from harness.prerequisites import missing

BOOT_ID = "/proc/sys/kernel/random/boot_id"
_NO_FLOCK_C = """#include <errno.h>
/* flock(2) as on a mount without working locks (many cluster filesystems): ENOLCK. */
int flock(int fd, int operation) { (void)fd; (void)operation; errno = ENOLCK; return -1; }
"""


@dataclass(frozen=True)
class Machine:
    """Where a process seems to run. `boot_id`: its kernel's ('' for none; None: this machine's);
    `pid_namespace`: a private one, its processes numbered from 1; `hostname`: its host name (None:
    this machine's); `flock`: whether flock(2) works on its mounts."""
    boot_id: str | None = None
    pid_namespace: bool = False
    hostname: str | None = None
    flock: bool = True


def no_flock_library(tmp_path_factory) -> Path:
    """The preloadable library whose flock(2) fails with ENOLCK, built once a test run."""
    if shutil.which("cc") is None:
        missing("needs a C compiler (cc) to build the no-flock test library")

    def build(folder: Path) -> None:
        (folder / "no_flock.c").write_text(_NO_FLOCK_C)
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(folder / "no_flock.so"), str(folder / "no_flock.c")],
                       check=True, capture_output=True)

    return built_once(tmp_path_factory, "no-flock", build) / "no_flock.so"


def check_namespaces() -> None:
    """Skip (fail under CI), saying why, where unprivileged namespaces are not allowed."""
    probe = subprocess.run(["unshare", "-r", "-m", "-p", "-f", "-u", "--mount-proc", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        missing(f"needs user, mount, pid and UTS namespaces (unshare): {probe.stderr.strip()}")


def command(argv: list[str], machine: Machine, folder: Path, library: Path | None = None) -> tuple[list[str], dict]:
    """(the command line, the environment) that runs `argv` as if on `machine`; `folder` holds the
    boot id file; `library` is `no_flock_library`'s, needed when machine.flock is False."""
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "PYTHONUNBUFFERED": "1"}
    if not machine.flock:
        assert library is not None, "a machine without flock needs no_flock_library"
        env["LD_PRELOAD"] = str(library)
    steps = []
    if machine.boot_id is not None:
        boot = folder / f"boot-id-{machine.boot_id or 'none'}"
        boot.write_text(f"{machine.boot_id}\n" if machine.boot_id else "")
        steps.append(f"mount --bind {shlex.quote(str(boot))} {BOOT_ID}")
    if machine.hostname is not None:
        steps.append(f"hostname {shlex.quote(machine.hostname)}")
    if machine.boot_id is None and machine.hostname is None and not machine.pid_namespace:
        return argv, env
    flags = ["-r", "-m", "-u", "--kill-child"] + (["-p", "-f", "--mount-proc"] if machine.pid_namespace else [])
    # sh stays the namespace's first process (pid 1 ignores signals it has no handler for), the
    # command its child; --kill-child takes them down with `unshare`.
    script = " && ".join(steps + ['"$@"']) if steps else '"$@"'
    return ["unshare", *flags, "sh", "-c", script, "sh", *argv], env


def python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


def start(argv: list[str], machine: Machine, folder: Path, library: Path | None = None, *, env: dict | None = None,
          **popen) -> subprocess.Popen:
    """`argv` started on `machine` (`command`), with `env` added to its environment."""
    line, full_env = command(argv, machine, folder, library)
    return subprocess.Popen(line, cwd=REPO, env={**full_env, **(env or {})}, text=True, **popen)
