"""Where `pipeline generate` keeps its work: OUT.jsonl appears only when complete.

Until then the shards live in `OUT.jsonl.parts/`: `plan.json` (the data's digests, the shard
count, the settings and the generation source; a re-run with anything else is refused rather than
mixed in), and per finished shard `shard-NNNNN.jsonl` plus `shard-NNNNN.json` (its counts and the
JSONL's sha256). Each file is written to a temporary name, fsynced and renamed; the small JSON is
written last, so a shard counts as done only when both are whole, and a kill -9 loses at most
the shard in flight. When every shard of the plan is done, the shards are concatenated in order
into OUT.jsonl the same way (whichever process finishes last does it; the result is the same),
`complete.json` records it, and the shard files are removed (OUT.jsonl holds them).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.files import write_atomic
from pipeline.provenance import sha256_file


class Parts:
    def __init__(self, out: Path):
        self.out = Path(out)
        self.dir = self.out.with_name(self.out.name + ".parts")

    def start(self, plan: dict) -> None:
        """Create the parts folder with `plan`, or check that an existing one was made for the same
        output: the same data, shard count, target (or served model) and sampling. How the work was
        run (batch size, the server's address, the target directory's path) is not compared: it does
        not change the output, so a run resumes through another port or with another batch size."""
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
            differs = first_difference(output_identity(old), output_identity(plan))
            if differs is not None:
                field, then, now = differs
                raise PipelineError(f"{self.dir}: made with another {field} ({_short(then)} then, {_short(now)} now); "
                                    "resume with the same data and settings, or choose another --out")
            return
        write_atomic(existing, json.dumps(plan, indent=1, sort_keys=True).encode())

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
        write_atomic(self.shard_path(shard), data)
        record = {**record, "shard": shard, "rows_written": len(rows), "sha256": hashlib.sha256(data).hexdigest()}
        write_atomic(self.shard_path(shard).with_suffix(".json"), json.dumps(record, indent=1, sort_keys=True).encode())
        return record

    def assemble(self, num_shards: int) -> bool:
        """OUT.jsonl from every shard, in order, once all are done; False while some are missing.
        Then `complete.json` (OUT.jsonl's size and sha256) is written and the shard files are
        removed: OUT.jsonl holds them all. The folder keeps plan.json and complete.json (a few
        hundred bytes), so a re-run recognises the finished output instead of redoing it."""
        if self.complete():
            return True
        if any(self.done(s) is None for s in range(num_shards)):
            return False
        try:
            data = b"".join(self.shard_path(s).read_bytes() for s in range(num_shards))
        except FileNotFoundError:   # another process assembled and cleared the shards meanwhile
            return self.complete()
        write_atomic(self.out, data)
        record = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "num_shards": num_shards}
        write_atomic(self.dir / "complete.json", json.dumps(record, indent=1, sort_keys=True).encode())
        for s in range(num_shards):
            self.shard_path(s).unlink(missing_ok=True)
            self.shard_path(s).with_suffix(".json").unlink(missing_ok=True)
        return True

    def complete(self) -> bool:
        """OUT.jsonl was assembled by this plan and is whole."""
        try:
            record = json.loads((self.dir / "complete.json").read_text())
            return self.out.stat().st_size == record["bytes"] and sha256_file(self.out) == record["sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            return False


def output_identity(plan: dict) -> dict:
    """What in a plan decides the output's rows: the data, the shard count, the backend, the target's
    config digest (in this process) or the served model (a server), and the sampling settings."""
    source = plan.get("generated_by") or {}
    model = {"model": source.get("model")} if source.get("backend") == "server" else \
        {"target_config_sha256": source.get("target_config_sha256")}
    return {"data": plan.get("data"), "num_rows": plan.get("num_rows"), "num_shards": plan.get("num_shards"),
            "generated_by": {"backend": source.get("backend"), **model, "sampling": source.get("sampling")}}


def first_difference(then, now, path: str = "") -> tuple[str, object, object] | None:
    """(dotted field, value then, value now) of the first leaf where two plans differ, or None."""
    if isinstance(then, dict) and isinstance(now, dict):
        for key in sorted(set(then) | set(now)):
            found = first_difference(then.get(key), now.get(key), f"{path}.{key}" if path else key)
            if found:
                return found
        return None
    if isinstance(then, list) and isinstance(now, list) and len(then) == len(now):
        for i, (a, b) in enumerate(zip(then, now)):
            found = first_difference(a, b, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if then == now else (path, then, now)


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."
