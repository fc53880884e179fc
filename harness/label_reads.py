"""Which ranks read a cache's label arrays, and why: processes started with `label_reads_env(dir)`
log every open of a `target_argmax` or `loss_mask` chunk file (label_reads_hook/sitecustomize.py,
a Python audit hook), marked as counting the draft vocabulary or not; `label_reads(dir)` reads the
logs back per rank."""

from __future__ import annotations

import json
import os
from pathlib import Path

HOOK_DIR = Path(__file__).resolve().parent / "label_reads_hook"


def label_reads_env(log_dir: Path) -> dict:
    """The environment that makes a process (and torchrun's workers) log its label reads into `log_dir`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(p for p in (str(HOOK_DIR), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "DFLASH_LABEL_READS": str(log_dir)}


def label_reads(log_dir: Path) -> dict[int, dict[str, list[str]]]:
    """{rank: {"counting": paths opened to count labels, "other": paths opened otherwise}}."""
    out = {}
    for f in sorted(log_dir.glob("rank*.jsonl")):
        rank = int(f.stem.removeprefix("rank"))
        reads = {"counting": [], "other": []}
        for line in f.read_text().splitlines():
            entry = json.loads(line)
            reads["counting" if entry["counting"] else "other"].append(entry["path"])
        out[rank] = reads
    return out
