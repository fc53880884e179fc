"""Who trains into a run directory: one process at a time (DESIGN 8).

`pipeline train --out R` claims R before it reads or writes anything there and gives the claim back
when it ends, by success or by error; under torchrun only rank 0 claims, for the whole job. Two
runs into one R at once would interleave their logs, checkpoints and run.json, and the first
would report success with nothing of its own left. The claim is two files:

- `R/.owner.lock`: an flock held for the whole run (`FileLock`, as extract's shard locks). The
  kernel drops it when its holder dies, even by kill -9, so on one machine (and on a shared
  filesystem whose flock spans machines) a second run is refused and a dead one never blocks.
  It stays after the run: removing a lock file races with a process that has just opened it.
- `R/owner.json`: who holds R (host, pid, since when, how to recognise the process), for the
  refusal's one line, and the claim itself where flock does not span machines (many cluster
  mounts) or does not work at all. The holder refreshes its modification time every HEARTBEAT_S
  seconds. Removed when the run ends.

Which machine made a claim: the kernel's boot id (/proc/sys/kernel/random/boot_id, a random UUID
drawn at every boot), never the host name: two containers with a fixed host name, or two VMs cloned
from one image, share a name but not a boot. Containers on one host share its kernel and boot id
and differ in their pid namespace. Where there is no boot id (not Linux, or /proc not mounted) the
machine is unknown: such a claim, and any claim seen from such a machine, is judged by its
heartbeat alone (rule 4), never by a pid or a lock.

A claim left behind (kill -9, a lost node, a reboot) is stale, and the next run into R (a resume)
takes it over, saying so in one line, when one of these holds:

1. it was made under this kernel (the same boot id) and pid namespace by a process that is gone:
   no process has its pid, or the one that has it started at another time (the pid was reused).
   One alive there, paused or not, holds R whatever its heartbeat;
2. it was made under this kernel in another pid namespace by a holder of `.owner.lock`, and this
   run now holds that flock: the kernel keeps a live process's flock whatever its namespace, so
   the holder has ended (a container restarted in a new pid namespace takes over at once);
3. it was made by an earlier round of this same torchrun job (the same TORCHELASTIC_RUN_ID, other
   than torchrun's default 'none', and a lower TORCHELASTIC_RESTART_COUNT): torchrun stops every
   worker of a round before it starts the next, wherever the new rank 0 lands;
4. its heartbeat (the file's modification time) is older than STALE_AFTER_S (10 minutes): made on
   another machine (another boot: a reboot of this one looks the same), whose processes this one
   cannot see. A holder that is alive refreshes it 20 times in that span.

Otherwise the run stops in one line naming the holder.

A holder can outlive its claim: paused past STALE_AFTER_S (SIGSTOP, a suspended job, a hung mount)
it sends no heartbeat, another machine's run takes the directory over, and then it wakes. So the
holder checks that the claim is still its own (`RunClaim.check`) before every write into R: each
log line, each checkpoint (before it starts and again before its rename makes it visible),
run.json, the export; on a claim that is no longer its own it stops in one line naming the new
owner, and gives back nothing that is not its own.

What this does not cover: on a filesystem whose flock does not span machines, two runs started on
two machines within the same second into a directory with no claim (or a stale one) can both
proceed; each reads its claim back after writing it, which narrows that window but cannot close it
without a lock the filesystem lacks. Likewise a pause that falls between a check and the write it
guards lets that one write through.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from pipeline.distributed import broadcast_from_rank0
from pipeline.errors import PipelineError
from pipeline.files import FileLock, describe_os_error, write_json_atomic
from pipeline.records.run_dir import RunDir

HEARTBEAT_S = 30.0
STALE_AFTER_S = 600.0
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _start_ticks(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat field 22); None without
    /proc. Two processes that share a pid over time never share this."""
    stat = _read_text(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # the command name, in parentheses, may hold spaces
    return fields[19] if len(fields) > 19 else None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _machine() -> dict:
    """Where this process runs: its host name (for people), kernel boot and pid namespace (what
    makes two claims' locks and pids comparable: the module docstring)."""
    return {"host": socket.gethostname(), "boot_id": _read_text(BOOT_ID), "pid_namespace": _pid_namespace()}


def _same_kernel(record: dict, here: dict) -> bool:
    return here["boot_id"] is not None and record.get("boot_id") == here["boot_id"]


def _process_state(pid: int, start: str | None) -> str | None:
    """Why process `pid` (started at `start`) is not running on this machine, or None if it is."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "no process has that pid any more"
    except PermissionError:
        pass  # it exists, owned by another user
    now = _start_ticks(pid)
    if start is not None and now is not None and now != start:
        return "its pid now belongs to a process started later"
    return None


def _job() -> tuple[str | None, int]:
    """(torchrun's job id, this round of it); (None, 0) outside torchrun or under its default id."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return (run_id if run_id and run_id != "none" else None), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"


class ClaimLost(PipelineError):
    """This run's directory was taken over (`RunClaim.check`): the run stops writing there at once,
    its trackers' closing writes included (`Trackers.abandon`)."""


class RunClaim:
    """This process's claim on a run directory; `release()` gives it back (idempotent)."""

    def __init__(self, out: Path, record: dict, lock: FileLock | None, created: bool):
        self.out, self.record, self._lock, self._created = out, record, lock, created
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="run-claim-heartbeat", daemon=True)
        self._beat.start()

    @property
    def path(self) -> Path:
        return RunDir(self.out).owner

    def _ours(self) -> bool:
        found = _read_record(self.path)
        return isinstance(found, dict) and found.get("claim_id") == self.record["claim_id"]

    def check(self, before: str) -> None:
        """Raise one line naming the directory's new owner if this claim is no longer ours: called
        before every write into the run directory (`before` says which)."""
        found = _read_record(self.path)
        if isinstance(found, dict) and found.get("claim_id") == self.record["claim_id"]:
            return
        if isinstance(found, dict):
            now = f"another training run holds it ({_holder(found)})"
        elif found is None:
            now = f"its {self.path.name} is gone"
        else:
            now = f"its {self.path.name} is unreadable ({found})"
        raise ClaimLost(
            f"{self.out}: this run no longer owns the directory: {now}; stopping before {before}. The claim "
            f"is taken over after {_minutes(STALE_AFTER_S)} without a heartbeat: was this process paused "
            "(SIGSTOP, a suspended job) or its mount hung?")

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if not self._ours():  # taken over (we looked dead to another machine): stop refreshing it
                    return
                os.utime(self.path)
            except OSError:
                pass  # a missed beat is harmless unless STALE_AFTER_S of them are missed

    def release(self) -> None:
        self._stop.set()
        try:
            if self._ours():
                self.path.unlink()
        except OSError:
            pass  # a claim left behind is recognised as stale by the next run
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if self._created:  # a run that failed before writing anything leaves no directory behind
            self._created = False
            try:
                if [p.name for p in self.out.iterdir()] == [RunDir(self.out).owner_lock.name]:
                    RunDir(self.out).owner_lock.unlink()
                    self.out.rmdir()
            except OSError:
                pass  # another run has just claimed it: the directory is theirs now


def _read_record(path: Path) -> dict | str | None:
    """The claim's record; None when there is none; a string saying why it cannot be read."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as e:
        return describe_os_error(e)
    try:
        record = json.loads(text)
    except ValueError:
        return "not JSON"
    if not isinstance(record, dict) or not isinstance(record.get("pid"), int):
        return "not a claim record"
    return record


def _holder(record: dict) -> str:
    return f"pid {record.get('pid')} on {record.get('host')}, since {record.get('since')}"


def _stale_because(record: dict | str, age_s: float, *, locked: bool) -> str | None:
    """Why a claim left in the directory no longer holds it (the module docstring's rules), or None.
    `locked`: this process holds `.owner.lock` now."""
    if isinstance(record, dict):
        here = _machine()
        if _same_kernel(record, here):
            if here["pid_namespace"] is not None and record.get("pid_namespace") == here["pid_namespace"]:
                # seen from here: gone, or alive (paused too) and holding, whatever its heartbeat
                return _process_state(int(record["pid"]), record.get("process_start"))
            if locked and record.get("locked") is True:
                return "its holder's flock is free, so the process has ended (this kernel keeps a live holder's flock)"
        job, restart = _job()
        if job is not None and record.get("job") == job and int(record.get("restart", 0)) < restart:
            return f"it was round {record.get('restart', 0)} of this torchrun job, which torchrun ended"
    if age_s > STALE_AFTER_S:
        return f"no heartbeat for {_minutes(age_s)} (a claim is stale after {_minutes(STALE_AFTER_S)} without one)"
    return None


def _refusal(out: Path, record: dict | str, age_s: float) -> PipelineError:
    if isinstance(record, str):
        who = f"{RunDir(out).owner} is unreadable ({record})"
    else:
        who = f"in use by another training run ({_holder(record)})"
    wait = ""
    if not isinstance(record, dict) or not _same_kernel(record, _machine()):  # judged by its heartbeat
        wait = f"; it is stale after {_minutes(STALE_AFTER_S)} without a heartbeat, the last {_minutes(age_s)} ago"
    return PipelineError(f"{out}: {who}{wait}; wait for it to end, or train into another --out")


def take(out: Path, warn) -> RunClaim:
    """Claim `out` for this process, or raise one line naming who holds it (module docstring)."""
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    lock: FileLock | None = FileLock(RunDir(out).owner_lock)
    try:
        if not lock.acquire(blocking=False):
            lock = None
            owner = RunDir(out).owner
            raise _refusal(out, _read_record(owner) or "being written", _age(owner))
    except OSError:  # no working flock on this mount (ENOLCK, EOPNOTSUPP): the record decides alone
        lock = None
    try:
        return _claim(out, lock, created, warn)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _age(path: Path) -> float:
    try:
        return max(0.0, time.time() - path.stat().st_mtime)
    except OSError:
        return 0.0


def _claim(out: Path, lock: FileLock | None, created: bool, warn) -> RunClaim:
    path = RunDir(out).owner
    found = _read_record(path)
    if found is not None:
        age = _age(path)
        reason = _stale_because(found, age, locked=lock is not None)
        if reason is None:
            raise _refusal(out, found, age)
        holder = _holder(found) if isinstance(found, dict) else f"an unreadable {path.name}"
        warn(f"{out}: taking over a stale claim ({holder}): {reason}")
    job, restart = _job()
    record = {**_machine(), "pid": os.getpid(), "process_start": _start_ticks(os.getpid()), "since": _now_utc(),
              "job": job, "restart": restart, "locked": lock is not None, "claim_id": uuid.uuid4().hex}
    write_json_atomic(path, record)
    mine = _read_record(path)  # another machine writing at the same moment: the last write holds
    if not isinstance(mine, dict) or mine.get("claim_id") != record["claim_id"]:
        raise _refusal(out, mine or "removed", _age(path))
    return RunClaim(out, record, lock, created)


def claim_for_job(out: Path, *, rank: int, world: int, warn) -> RunClaim | None:
    """Rank 0 claims `out` once for every rank; a refusal stops every rank with the same line."""
    claim, refusal = None, None
    if rank == 0:
        try:
            claim = take(out, warn)
        except PipelineError as e:
            refusal = str(e)
        except OSError as e:
            refusal = f"{out}: cannot claim the run directory ({describe_os_error(e)})"
    # the refusal only: the claim (its lock and heartbeat) stays with rank 0
    refusal = broadcast_from_rank0(refusal, world)
    if refusal is not None:
        raise PipelineError(refusal)
    return claim
