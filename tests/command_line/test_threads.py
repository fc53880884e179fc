"""`pipeline --threads`: an explicit count, OMP_NUM_THREADS, and `auto` on a machine whose cores
other processes keep busy (real busy processes, the real /proc/stat)."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from pipeline.errors import PipelineError
from pipeline.threads import apply_threads, choose_threads, torch_default
from harness.prerequisites import needs


def test_an_explicit_count_and_bad_values():
    assert choose_threads("3") == (3, "--threads")
    for bad in ("0", "-1", "many"):
        with pytest.raises(PipelineError, match="--threads must be 'auto' or an integer >= 1"):
            choose_threads(bad)


def test_auto_keeps_omp_num_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert choose_threads("auto") == (torch_default(), "OMP_NUM_THREADS")


def test_a_later_auto_starts_from_torchs_default_again(monkeypatch):
    """In one process (the CLI invoked in-process, tests), an explicit count does not become the
    next `auto`'s ceiling."""
    monkeypatch.setenv("OMP_NUM_THREADS", "4")      # auto keeps the default; no sampling needed
    before = torch.get_num_threads()
    try:
        assert apply_threads("1")[0] == 1 and torch.get_num_threads() == 1
        assert apply_threads("auto")[0] == torch_default() == before
    finally:
        torch.set_num_threads(before)


@needs(os.path.exists("/proc/stat"), "needs /proc/stat (Linux)")
@needs((os.cpu_count() or 1) >= 2, "one core: there is nothing fewer to choose")
def test_auto_takes_fewer_threads_when_other_processes_fill_the_cores():
    """In a fresh interpreter without OMP_NUM_THREADS, as a user runs the CLI: torch's default is
    then every core (this test process may run with fewer: pytest-xdist's workers share them)."""
    cores = os.cpu_count() or 1
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    probe = ("import json; from pipeline.threads import busy_cores, choose_threads, torch_default; "
             "default = torch_default(); busy = busy_cores(); print(json.dumps([default, busy, *choose_threads('auto')]))")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        time.sleep(0.5)
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert done.returncode == 0, done.stderr[-2000:]
    default, busy, threads, why = json.loads(done.stdout.splitlines()[-1])
    assert default >= 2, default                                 # the probe starts from more than one thread
    assert busy is not None and busy > cores - 0.75, busy       # every core spinning
    assert threads == 1 and "busy with other processes" in why, (threads, why)
