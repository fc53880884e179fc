"""Running the pipeline as a user does: the real CLI in a subprocess (or in this process for
commands that end early), under torchrun, in a private namespace or under a file-size limit; and
small caches of the shipped conversations."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

from harness.ports import free_port

REPO = Path(__file__).resolve().parent.parent


def write_rows(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def small_cache(root: Path, rows: list[dict], num_shards: int) -> Path:
    """A cache at root/cache of the given conversations, extracted in-process with defaults."""
    from pipeline.config import ExtractConfig
    from stages.extract.run import run_extract

    data = write_rows(root / "convs.jsonl", rows)
    run_extract(ExtractConfig(cache=str(root / "cache"), data=[str(data)], num_shards=num_shards), None, progress=False)
    return root / "cache"


def cli(*args: str, env: dict | None = None, timeout: int = 600, preexec_fn=None) -> subprocess.CompletedProcess:
    """Run `python -m cli ...` in a subprocess, as a user would run `pipeline ...`."""
    full_env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}  # None in `env`: unset it
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=REPO, preexec_fn=preexec_fn)


def cli_here(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The same command run in this process by typer's test runner: the same app, options,
    stdout, stderr and exit code as `cli`, without the seconds a new process spends importing
    torch. For commands whose process is not what the test is about (usage and input errors,
    refusals, a report or eval whose output is checked); process-level behaviour (kills, signals,
    stray library output, the console script) stays with `cli`, and each family of such tests
    keeps at least one case there. An unexpected exception becomes exit code 1 with its traceback
    on stderr, as in a process."""
    import traceback

    import torch
    from typer.testing import CliRunner

    from cli import app

    from pipeline import ui

    threads = torch.get_num_threads()  # the CLI sets torch's threads for its process
    # rich reads COLUMNS once, when a console is made: the width a process would start with, set for the
    # invocation (whichever test first imported pipeline.ui, and under which COLUMNS, does not matter)
    widths = [(c, c._width) for c in (ui.console, ui.err_console)]
    try:
        for c, _ in widths:
            c.width = 200
        result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1", **(env or {})})
    finally:
        torch.set_num_threads(threads)
        for c, width in widths:
            c._width = width
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess(["pipeline", *args], result.exit_code, result.stdout, stderr)


def torchrun(nproc: int, *args: str, timeout: int = 600, preexec_fn=None, env: dict | None = None
             ) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           "--master-port", str(free_port()), "-m", "cli", *args],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO, preexec_fn=preexec_fn)


def two_nodes(*args: str, env: dict | None = None, max_restarts: int = 0, timeout: int = 600) -> list[subprocess.CompletedProcess]:
    """Run `pipeline ARGS` under two torchrun launchers (one process each) that meet at one
    rendezvous endpoint, as two nodes would."""
    endpoint = f"127.0.0.1:{free_port()}"
    full_env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
         "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "dflash-test",
         "--max-restarts", str(max_restarts), "-m", "cli", *args],
        cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    results = []
    for launcher in launchers:
        out, err = launcher.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(launcher.args, launcher.returncode, out, err))
    return results


def file_size_limit(nbytes: int):
    """A preexec_fn: writes past `nbytes` fail with EFBIG (SIGXFSZ ignored, so they do not kill)."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return limit


def in_namespace(script: str, out: Path) -> None:
    """Run a shell script in a private user + mount namespace, where it may mount a tmpfs; the
    script leaves its evidence in `out` (outside the mount). Fails showing the *.err files."""
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    done = subprocess.run(["unshare", "-rm", "sh", "-c", "set -u\n" + script], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.returncode, done.stderr, *(p.read_text() for p in out.glob("*.err")))


def stopped(pid: int) -> bool:
    """The process is frozen (SIGSTOP, as a failpoint's `:stop` does: state T in /proc/PID/stat);
    False once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except FileNotFoundError:
        return False
