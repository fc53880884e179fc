"""A run directory has one owner at a time (DESIGN 8): a second `pipeline train` into a directory
that a live run holds stops in one line naming the holder; a holder that died (kill -9, a lost
node) is recognised as stale and the next run takes over, saying so. Real processes throughout:
trainings, and a plain process that holds a claim the way train does."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from harness.runs import REPO, cli, cli_here, torchrun

RUN = ["--max-steps", "12", "--log-every", "1", "--checkpoint-every", "6", "--num-anchors", "32",
       "--batch-sequences", "2", "--micro-batch-sequences", "2", "--json"]
TWO_RANKS = [*RUN[:-2], "1", "--json"]  # one sequence a rank


@pytest.fixture(scope="module")
def cache(twelve_rows_cache):
    return twelve_rows_cache["cache"]


def lines(stream: str, kind: str) -> list[str]:
    return [x for x in stream.splitlines() if x.startswith(f"{kind}:")]


def wait_for(condition, proc, what: str, seconds: float = 300) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert proc.poll() is None, f"the process ended before {what}"
        assert time.time() < deadline, f"no {what} within {seconds} s"
        time.sleep(0.05)


def stopped(pid: int) -> bool:
    """The process is frozen (SIGSTOP: state T in /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def holder(run) -> subprocess.Popen:
    """A real process that claims `run` as train does and holds it until killed."""
    code = ("import sys, time; from pathlib import Path; from pipeline.training.run_claim import take; "
            "take(Path(sys.argv[1]), print); print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_training_is_refused_and_a_killed_holder_is_taken_over(cache, tmp_path):
    """The issue's case: two trainings into one --out at once. The first is frozen at its first
    checkpoint (alive, holding the directory); the second, with another learning rate, stops in
    one line naming the first and changes nothing; after kill -9 of the first, the same command
    resumes, naming the stale claim it takes over."""
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "cli", "train", "--cache", str(cache), "--out", str(run), *RUN],
                             cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1",
                                  "PIPELINE_FAILPOINT": "checkpoint.written@1:stop"})
    try:
        wait_for(lambda: stopped(first.pid), first, "freeze at the first checkpoint")
        before = {p.relative_to(run).as_posix(): p.stat().st_mtime_ns for p in run.rglob("*")}

        second = cli("train", "--cache", str(cache), "--out", str(run), *RUN[:-1], "--lr", "1e-2")
        assert second.returncode == 1, second.stderr
        errors = lines(second.stderr, "error")
        assert len(errors) == 1, second.stderr
        assert f"in use by another training run (pid {first.pid} on {socket.gethostname()}, since 20" in errors[0]
        assert "Traceback" not in second.stderr
        assert {p.relative_to(run).as_posix(): p.stat().st_mtime_ns for p in run.rglob("*")} == before
        assert json.loads((run / "run.json").read_text())["config"]["lr"] == 3e-3
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert (run / "owner.json").exists()  # kill -9 runs no cleanup: the claim stays behind

    resumed = cli("train", "--cache", str(cache), "--out", str(run), *RUN)
    assert resumed.returncode == 0, resumed.stderr
    warnings = [x for x in lines(resumed.stderr, "warning") if "stale claim" in x]
    assert len(warnings) == 1, resumed.stderr
    assert f"taking over a stale claim (pid {first.pid} on {socket.gethostname()}" in warnings[0]
    assert "no process has that pid any more" in warnings[0]
    assert json.loads(resumed.stdout)["steps"] == 12
    assert not (run / "owner.json").exists()  # given back at the end


def write_claim(run, **fields) -> None:
    run.mkdir(parents=True, exist_ok=True)
    record = {"host": socket.gethostname(), "pid": 1, "since": "2026-01-01T00:00:00Z", **fields}
    (run / "owner.json").write_text(json.dumps(record))


def test_a_claim_from_another_machine_blocks_until_its_heartbeat_is_stale(cache, tmp_path):
    """Another machine's process cannot be seen from here: its claim holds while its heartbeat
    (the file's modification time) is younger than 10 minutes. A run that fails after taking a
    claim over gives it back."""
    run = tmp_path / "run"
    write_claim(run, host="node-7", pid=4242, boot_id="another-boot")
    refused = cli_here("train", "--cache", str(cache), "--out", str(run), *RUN)
    assert refused.returncode == 1
    errors = lines(refused.stderr, "error")
    assert len(errors) == 1 and "in use by another training run (pid 4242 on node-7, since 2026-01-01T00:00:00Z)" in errors[0]
    assert "stale after 10 min without a heartbeat" in errors[0], errors

    eleven_minutes_ago = time.time() - 11 * 60
    os.utime(run / "owner.json", (eleven_minutes_ago, eleven_minutes_ago))
    missing = tmp_path / "no-cache"
    taken = cli_here("train", "--cache", str(missing), "--out", str(run), *RUN)
    assert taken.returncode == 1  # it took the claim over, then met the missing cache
    warnings = lines(taken.stderr, "warning")
    assert any("taking over a stale claim (pid 4242 on node-7" in x and "no heartbeat for 11 min" in x for x in warnings), taken.stderr
    assert len(lines(taken.stderr, "error")) == 1 and str(missing) in taken.stderr
    assert not (run / "owner.json").exists()


def test_a_reused_pid_does_not_hold_the_directory(cache, tmp_path):
    """A claim made on this machine whose pid now belongs to a process that started later (this
    test's own process, at another start time) is stale: pids are reused."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    run = tmp_path / "run"
    write_claim(run, pid=os.getpid(), boot_id=boot, pid_namespace=os.readlink("/proc/self/ns/pid"), process_start="1")
    taken = cli_here("train", "--cache", str(tmp_path / "no-cache"), "--out", str(run), *RUN)
    assert taken.returncode == 1
    assert any(f"stale claim (pid {os.getpid()} on" in x and "started later" in x for x in lines(taken.stderr, "warning")), taken.stderr


def test_an_earlier_round_of_the_same_torchrun_job_does_not_hold_the_directory(cache, tmp_path):
    """torchrun --max-restarts stops a round's workers before the next round, whose rank 0 may be
    on another node: a claim of an earlier round of the same job is stale at once; one of another
    job, or of this round, holds."""
    run = tmp_path / "run"
    write_claim(run, host="node-7", pid=4242, job="q27b-train", restart=0)
    for job, restart in [("another-job", "1"), ("q27b-train", "0")]:
        held = cli_here("train", "--cache", str(cache), "--out", str(run), *RUN,
                        env={"TORCHELASTIC_RUN_ID": job, "TORCHELASTIC_RESTART_COUNT": restart})
        assert held.returncode == 1 and "in use by another training run (pid 4242 on node-7" in held.stderr, held.stderr
    taken = cli_here("train", "--cache", str(tmp_path / "no-cache"), "--out", str(run), *RUN,
                     env={"TORCHELASTIC_RUN_ID": "q27b-train", "TORCHELASTIC_RESTART_COUNT": "1"})
    assert any("stale claim (pid 4242 on node-7" in x and "round 0 of this torchrun job" in x
               for x in lines(taken.stderr, "warning")), taken.stderr


def test_every_rank_of_a_torchrun_job_refuses_a_held_directory(cache, tmp_path):
    """Rank 0 claims for the job; its refusal reaches every rank (none waits for a partner that
    has stopped), and the holder is left untouched."""
    run = tmp_path / "run"
    proc = holder(run)
    try:
        result = torchrun(2, "train", "--cache", str(cache), "--out", str(run), *TWO_RANKS, timeout=300)
        assert result.returncode != 0
        errors = lines(result.stderr, "error")
        assert len(errors) == 2 and all(f"(pid {proc.pid} on {socket.gethostname()}" in x for x in errors), result.stderr
        assert json.loads((run / "owner.json").read_text())["pid"] == proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_a_torchrun_job_claims_once_and_gives_the_directory_back(cache, tmp_path):
    """Two ranks, one claim: rank 0's (a second claim by rank 1 would be refused by rank 0's)."""
    run = tmp_path / "run"
    result = torchrun(2, "train", "--cache", str(cache), "--out", str(run), *TWO_RANKS, timeout=300)
    assert result.returncode == 0, result.stderr
    assert not (run / "owner.json").exists() and (run / "drafter").is_dir()
