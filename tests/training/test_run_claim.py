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

from harness import machines
from harness.runs import REPO, cli, cli_here, stopped, torchrun

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
        assert json.loads((run / "run.json").read_text())["config"]["optimizer"]["lr"] == 3e-3
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


# --------------------------------------------------------------------------- across machines
# Real processes that see another kernel boot, pid namespace or host name, or a mount whose flock
# fails (harness/machines.py), each claiming a directory as train does.

CLAIMANT = """
import sys
from pathlib import Path
from pipeline.errors import PipelineError
from pipeline.training.run_claim import take
try:
    claim = take(Path(sys.argv[1]), lambda line: print("warning:", line, flush=True))
except PipelineError as e:
    print("refused:", e, flush=True)
    sys.exit(1)
print("held", flush=True)
for command in sys.stdin:  # 'check': the test of a write; end of input: give the claim back
    try:
        claim.check("writing a test line")
        print("ok", flush=True)
    except PipelineError as e:
        print("stopped:", e, flush=True)
claim.release()
"""


@pytest.fixture(scope="module")
def no_flock(tmp_path_factory):
    machines.check_namespaces()
    return machines.no_flock_library(tmp_path_factory)


def claimant(run, machine, folder, library) -> tuple[subprocess.Popen, list[str]]:
    """A real process claiming `run` on `machine`; (the process, what it printed up to 'held' or
    its refusal). It holds the claim until its stdin closes."""
    proc = machines.start(machines.python(CLAIMANT, str(run)), machine, folder, library,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    said = []
    while not said or not said[-1].startswith(("held", "refused:")):
        line = proc.stdout.readline()
        assert line, f"the claimant ended early: {said}"
        said.append(line.strip())
    return proc, said


def ended(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def record(run) -> dict:
    return json.loads((run / "owner.json").read_text())


def files(run) -> dict[str, int]:
    """Every file of a run directory but its claim, with its modification time."""
    return {p.relative_to(run).as_posix(): p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file() and p.name != "owner.json"}


def age_claim(run, seconds: float) -> None:
    """The claim's heartbeat `seconds` old, as another machine's clock sees it after a long pause."""
    then = time.time() - seconds
    os.utime(run / "owner.json", (then, then))


def test_a_holder_paused_past_the_stale_limit_stops_before_writing_into_a_directory_taken_over(cache, tmp_path, no_flock):
    """Issue 69.1. On a cluster mount without flock, a training paused (SIGSTOP) mid-checkpoint
    for longer than the stale limit is taken over by a run on another machine (another boot id);
    when it wakes it writes nothing more into the directory and stops in one line naming the new
    owner, whose claim it leaves in place. Its trackers' files are in the directory too (issue 77.8):
    TensorBoard's event file and MLflow's store are left as they were, not flushed or closed into it."""
    run = tmp_path / "run"
    first = machines.start([sys.executable, "-m", "cli", "train", "--cache", str(cache), "--out", str(run), *RUN,
                            "--report-to", "tensorboard,mlflow"],
                           machines.Machine(flock=False), tmp_path, no_flock,
                           env={"PIPELINE_FAILPOINT": "checkpoint.written@1:stop", "HOME": str(tmp_path / "home")},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    second = None
    try:
        wait_for(lambda: stopped(first.pid), first, "freeze in the first checkpoint")
        assert record(run)["locked"] is False  # flock failed: the claim file decides alone
        age_claim(run, 11 * 60)
        before = files(run)

        second, said = claimant(run, machines.Machine(boot_id="node-b", hostname="node-b", flock=False), tmp_path, no_flock)
        assert said[-1] == "held", said
        assert any(f"taking over a stale claim (pid {first.pid} on {socket.gethostname()}" in x and "no heartbeat for 11 min" in x
                   for x in said), said
        new_owner = record(run)
        assert new_owner["host"] == "node-b" and new_owner["boot_id"] == "node-b"

        first.send_signal(signal.SIGCONT)
        out, err = first.communicate(timeout=300)
        assert first.returncode == 1, err
        errors = lines(err, "error")
        assert len(errors) == 1, err
        assert "this run no longer owns the directory: another training run holds it " \
               f"(pid {new_owner['pid']} on node-b, since {new_owner['since']})" in errors[0]
        assert "stopping before making checkpoint step 6 visible" in errors[0]
        assert "Traceback" not in err and out == ""
        temporary = [k for k in before if ".tmp-" in k]
        assert temporary, before  # frozen between writing the checkpoint and making it visible
        assert "mlflow.db" in before and any(k.startswith("tensorboard/") for k in before), before
        assert files(run) == {k: v for k, v in before.items() if ".tmp-" not in k}  # only its own temporary removed
        assert not (run / "checkpoints" / "step-00000006").exists() and not (run / "drafter").exists()
        assert record(run) == new_owner  # the old holder's release left the new owner's claim alone

        second.stdin.write("check\n")
        second.stdin.flush()
        assert second.stdout.readline().strip() == "ok"
    finally:
        ended(first)
        if second is not None:
            ended(second)


def test_a_taken_over_holder_stops_at_its_next_write(tmp_path, no_flock):
    """RunClaim.check, between two real processes on two machines: the first holder, alive but
    silent past the stale limit, is taken over; its next check names the new owner; its release
    leaves the new owner's claim."""
    run = tmp_path / "run"
    first, _ = claimant(run, machines.Machine(boot_id="node-a", hostname="node-a", flock=False), tmp_path, no_flock)
    second = None
    try:
        first.stdin.write("check\n")
        first.stdin.flush()
        assert first.stdout.readline().strip() == "ok"
        age_claim(run, 11 * 60)
        second, said = claimant(run, machines.Machine(boot_id="node-b", hostname="node-b", flock=False), tmp_path, no_flock)
        assert said[-1] == "held", said
        taken = record(run)
        first.stdin.write("check\n")
        first.stdin.flush()
        stopped_line = first.stdout.readline().strip()
        assert stopped_line.startswith("stopped: ") and stopped_line.count("\n") == 0
        assert f"another training run holds it (pid {taken['pid']} on node-b, since {taken['since']}); " \
               "stopping before writing a test line" in stopped_line
        first.stdin.close()
        first.wait(timeout=60)
        assert record(run) == taken
    finally:
        ended(first)
        if second is not None:
            ended(second)


def test_a_host_name_shared_by_two_machines_does_not_make_a_live_claim_stale(tmp_path, no_flock):
    """Issue 69.2. Two containers with one fixed host name on two machines (cloned VMs: two boot
    ids) and a mount without flock: the second is refused while the first's heartbeat is fresh,
    naming it and when its claim would be stale; the host name is not taken as a reboot."""
    run = tmp_path / "run"
    first, _ = claimant(run, machines.Machine(boot_id="clone-1", pid_namespace=True, hostname="trainer", flock=False),
                        tmp_path, no_flock)
    try:
        held = record(run)
        assert held["host"] == "trainer" and held["boot_id"] == "clone-1"
        second, said = claimant(run, machines.Machine(boot_id="clone-2", pid_namespace=True, hostname="trainer", flock=False),
                                tmp_path, no_flock)
        second.wait(timeout=60)
        assert second.returncode == 1 and said[-1].startswith("refused: "), said
        assert f"in use by another training run (pid {held['pid']} on trainer, since {held['since']})" in said[-1]
        assert "stale after 10 min without a heartbeat" in said[-1]
        assert record(run) == held
    finally:
        ended(first)


def test_a_container_restarted_in_a_new_pid_namespace_takes_over_its_dead_claim_at_once(tmp_path, no_flock):
    """Issue 69.3. On one kernel a free flock proves the holder dead: a container killed (-9) and
    restarted (a new pid namespace, the same boot id and host name) takes its directory over at
    once. While the holder lives, its flock refuses the newcomer."""
    run = tmp_path / "run"
    container = machines.Machine(pid_namespace=True, hostname="trainer")
    first, _ = claimant(run, container, tmp_path, None)
    try:
        held = record(run)
        assert held["locked"] is True
        refused, said = claimant(run, container, tmp_path, None)
        refused.wait(timeout=60)
        assert refused.returncode == 1 and f"(pid {held['pid']} on trainer" in said[-1], said
    finally:
        ended(first)  # kill -9 of the container's processes
    second, said = claimant(run, container, tmp_path, None)
    try:
        assert said[-1] == "held", said
        assert any(f"taking over a stale claim (pid {held['pid']} on trainer" in x and "flock is free" in x for x in said), said
    finally:
        ended(second)


def test_without_a_boot_id_a_claim_is_judged_by_its_heartbeat_alone(tmp_path, no_flock):
    """Where a system has no boot id, nothing says two claims were made under one kernel: a dead
    holder's free flock is not proof (the flock may not span the machines), so its claim holds
    until its heartbeat is stale."""
    run = tmp_path / "run"
    unknown = machines.Machine(boot_id="", pid_namespace=True, hostname="trainer")
    first, _ = claimant(run, unknown, tmp_path, None)
    held = record(run)
    ended(first)
    assert held["boot_id"] is None
    refused, said = claimant(run, unknown, tmp_path, None)
    refused.wait(timeout=60)
    assert refused.returncode == 1 and "stale after 10 min without a heartbeat" in said[-1], said
    age_claim(run, 11 * 60)
    taken, said = claimant(run, unknown, tmp_path, None)
    ended(taken)
    assert said[-1] == "held" and any("no heartbeat for 11 min" in x for x in said), said


def test_a_lock_that_fails_leaves_no_descriptor_open(tmp_path, no_flock):
    """Issue 69.3: FileLock.acquire on a mount whose flock fails (ENOLCK) raises and closes the file
    it opened; 200 tries leave the process's open descriptors as they were."""
    code = """
import os, sys
from pathlib import Path
from pipeline.files import FileLock
before = len(os.listdir("/proc/self/fd"))
errors = 0
for _ in range(200):
    try:
        FileLock(Path(sys.argv[1])).acquire(blocking=False)
    except OSError:
        errors += 1
print(errors, len(os.listdir("/proc/self/fd")) - before)
"""
    proc = machines.start(machines.python(code, str(tmp_path / "x.lock")), machines.Machine(flock=False), tmp_path, no_flock,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.split() == ["200", "0"]
