"""Peak memory of a process tree, sampled from /proc: for benchmarks whose stages are subprocesses
(benchmarks/flagship/rehearsal.py, benchmarks/flagship/real_vocab.py). Linux only."""

from __future__ import annotations

import threading
from pathlib import Path


class ProcessMemory:
    """Peak memory of every process under `pid`, sampled from /proc every 0.2 s: the kernel's
    own high-water mark of resident memory (VmHWM: anonymous plus mapped file pages, what GNU
    time reports) and the largest anonymous share seen (RssAnon: what the ranks of one node
    cannot share; the frozen embedding and lm_head are mapped from the target's file, so two
    training ranks hold them once in the page cache). Workers are the `-m cli` processes (for
    torchrun: its ranks, not the launcher)."""

    def __init__(self, pid: int):
        self.root, self.seen, self._stop = pid, {}, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @staticmethod
    def _parents() -> dict[int, int]:
        """{pid: parent pid} of every process (this kernel may lack /proc/PID/task/TID/children)."""
        parents = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                parents[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
        return parents

    def _sample(self, pid: int) -> None:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        kb = {k: int(fields[k].split()[0]) for k in ("VmHWM", "RssAnon") if k in fields}
        entry = self.seen.setdefault(pid, {"cmd": [a.decode(errors="replace") for a in cmdline], "hwm": 0, "anon": 0})
        entry["hwm"] = max(entry["hwm"], kb.get("VmHWM", 0))
        entry["anon"] = max(entry["anon"], kb.get("RssAnon", 0))

    def _poll(self) -> None:
        while True:
            children: dict[int, list[int]] = {}
            for pid, parent in self._parents().items():
                children.setdefault(parent, []).append(pid)
            stack = [self.root]
            while stack:
                pid = stack.pop()
                self._sample(pid)
                stack.extend(children.get(pid, ()))
            if self._stop.wait(0.2):
                return

    def workers(self) -> list[dict]:
        """[{pid, peak_rss_gb, peak_anon_gb}] of the processes doing the stage's work."""
        def is_worker(cmd: list[str]) -> bool:
            return "torch.distributed.run" not in cmd and ("cli" in cmd or "pipeline.toy.random_target" in cmd)
        chosen = [(pid, e) for pid, e in sorted(self.seen.items()) if is_worker(e["cmd"])] or list(self.seen.items())[:1]
        return [{"pid": pid, "peak_rss_gb": round(e["hwm"] / 2**20, 2), "peak_anon_gb": round(e["anon"] / 2**20, 2)}
                for pid, e in chosen]
