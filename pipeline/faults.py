"""Named failpoints, so fault-injection tests can kill a real run at an exact phase.

`PIPELINE_FAILPOINT=writer.chunk@3` makes the process send itself SIGKILL the third time it
reaches `failpoint("writer.chunk")`: what the OOM killer or a node reboot does at that instant,
with no handler, `finally` or flush running. `writer.fsynced@1:stop` sends SIGSTOP instead (the
process freezes there until a test, having changed the world around it, sends SIGCONT);
`checkpoint.renamed@1:once` kills only if the file named by PIPELINE_FAILPOINT_MARKER does not
exist yet, creating it first (a worker that torchrun restarts with the same environment then
runs through). `pilot.forward@1:raise` raises a RuntimeError there instead, as an error the
code does not expect would (CUDA out of memory, say): the handlers and `finally`s run. Several
are separated by commas. Outside tests the
variable is unset and a failpoint costs one lookup. `HITS` counts every point reached, so a test
can first run uninterrupted and then aim at any hit of any phase.
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter

ENV = "PIPELINE_FAILPOINT"
MARKER_ENV = "PIPELINE_FAILPOINT_MARKER"
HITS: Counter = Counter()
_armed: dict[str, tuple[int, str]] | None = None
_lock = threading.Lock()


def _parse(spec: str) -> dict[str, tuple[int, str]]:
    armed = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, rest = item.partition("@")
        nth, _, action = rest.partition(":")
        armed[name] = (int(nth or 1), action or "kill")
    return armed


def failpoint(name: str) -> None:
    global _armed
    with _lock:
        if _armed is None:  # parsed on first use, so a process forked after import reads its own env
            _armed = _parse(os.environ.get(ENV, ""))
        HITS[name] += 1
        nth, action = _armed.get(name, (0, ""))
        if nth == HITS[name]:
            if action == "once":
                marker = os.environ[MARKER_ENV]
                try:
                    os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    return
            if action == "raise":
                raise RuntimeError(f"failpoint {name}: a planted failure")
            os.kill(os.getpid(), signal.SIGSTOP if action == "stop" else signal.SIGKILL)


# Planted training faults, so tests can show that the live verdicts (pipeline/report/live.py)
# fire on a real run. `PIPELINE_PLANT=random_labels` replaces every label with a random token
# (labels that do not follow from the inputs, as labels taken from a noisy copy of the features
# are: DESIGN 3.2); `PIPELINE_PLANT=lr_blowup` multiplies the learning rate by 1000 from step
# LR_BLOWUP_STEP on (a diverging run). Outside tests the variable is unset.
PLANT_ENV = "PIPELINE_PLANT"
PLANTS = ("random_labels", "lr_blowup")
LR_BLOWUP_STEP = 20


def planted() -> str | None:
    name = os.environ.get(PLANT_ENV) or None
    if name is not None and name not in PLANTS:
        raise ValueError(f"{PLANT_ENV}: unknown plant {name!r}; one of {', '.join(PLANTS)}")
    return name
