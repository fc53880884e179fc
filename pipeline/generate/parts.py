"""Where `pipeline generate` keeps its work: OUT.jsonl appears only when complete.

Until then the shards live in `OUT.jsonl.parts/`: `plan.json` (the data's digests, the shard
count, the settings and the generation source; a re-run with anything else is refused rather than
mixed in), and per finished shard `shard-NNNNN.jsonl` plus `shard-NNNNN.json` (its counts and the
JSONL's sha256). Each file is written to a temporary name, fsynced and renamed; the small JSON is
written last, so a shard counts as done only when both are whole, and a kill -9 loses at most
the shard in flight. When every shard of the plan is done, the shards are concatenated in order
into OUT.jsonl the same way (whichever process finishes last does it; the result is the same).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from pipeline.errors import PipelineError


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class Parts:
    def __init__(self, out: Path):
        self.out = Path(out)
        self.dir = self.out.with_name(self.out.name + ".parts")

    def start(self, plan: dict) -> None:
        """Create the parts folder with `plan`, or check that an existing one has the same plan."""
        if self.out.exists() and not self.dir.exists():
            raise PipelineError(f"{self.out}: already exists and was not made by this command's parts "
                                f"({self.dir} is missing); choose another --out")
        self.dir.mkdir(parents=True, exist_ok=True)
        existing = self.dir / "plan.json"
        if existing.is_file():
            try:
                old = json.loads(existing.read_text())
            except json.JSONDecodeError:
                raise PipelineError(f"{existing}: not valid JSON; delete {self.dir} to start over") from None
            for key in sorted(set(old) | set(plan)):
                if old.get(key) != plan.get(key):
                    raise PipelineError(f"{self.dir}: made with another {key} ({_short(old.get(key))} here, "
                                        f"{_short(plan.get(key))} now); resume with the same data and settings, "
                                        f"or choose another --out")
            return
        _atomic_write(existing, json.dumps(plan, indent=1, sort_keys=True).encode())

    def shard_path(self, shard: int) -> Path:
        return self.dir / f"shard-{shard:05d}.jsonl"

    def done(self, shard: int) -> dict | None:
        """The shard's record if it is whole (its JSONL matches the digest the record names)."""
        record_path = self.shard_path(shard).with_suffix(".json")
        if not record_path.is_file():
            return None
        try:
            record = json.loads(record_path.read_text())
            data = self.shard_path(shard).read_bytes()
        except (OSError, json.JSONDecodeError):
            return None
        return record if hashlib.sha256(data).hexdigest() == record.get("sha256") else None

    def write(self, shard: int, rows: list[dict], record: dict) -> dict:
        data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()
        _atomic_write(self.shard_path(shard), data)
        record = {**record, "shard": shard, "rows_written": len(rows), "sha256": hashlib.sha256(data).hexdigest()}
        _atomic_write(self.shard_path(shard).with_suffix(".json"), json.dumps(record, indent=1, sort_keys=True).encode())
        return record

    def assemble(self, num_shards: int) -> bool:
        """OUT.jsonl from every shard, in order, once all are done; False while some are missing."""
        if any(self.done(s) is None for s in range(num_shards)):
            return False
        _atomic_write(self.out, b"".join(self.shard_path(s).read_bytes() for s in range(num_shards)))
        return True


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."
