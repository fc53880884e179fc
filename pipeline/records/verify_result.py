"""`pipeline verify-cache`'s result (`--json`), written by the verify stage and read here by
everything that reads one (the summary table, the demo, the rehearsal and verify-cost benchmarks):
the cache, the verdict, and each check's status, summary and evidence."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pipeline.errors import PipelineError
from pipeline.records.typed import dump_record

STATUSES = ("pass", "fail", "skipped", "inconclusive")


@dataclass(frozen=True)
class CheckLine:
    check: str
    status: str            # one of STATUSES
    summary: str
    evidence: dict = field(default_factory=dict)


@dataclass(frozen=True)
class VerifyResult:
    cache: str                       # where the cache is (a directory or s3://BUCKET/PREFIX)
    passed: bool                     # no check failed (inconclusive and skipped do not fail)
    checks: list[CheckLine]
    tokens: int | None = None        # None when the manifest could not be read
    seconds: float | None = None
    tokens_per_s: float | None = None
    compute: dict | None = None      # {"device", "dtype"} of the model checks, None without a model
    peak_rss_mb: float | None = None

    def to_json(self) -> dict:
        """The `--json` document; a result that stopped at the manifest has only cache, passed, checks."""
        out = dump_record(self)
        if self.tokens is None:
            out = {k: out[k] for k in ("cache", "passed", "checks")}
        return out

    @classmethod
    def from_json(cls, raw: dict, where: str = "verify result") -> VerifyResult:
        try:
            checks = [CheckLine(c["check"], c["status"], c["summary"], c.get("evidence") or {}) for c in raw["checks"]]
            known = {f.name for f in dataclasses.fields(cls)} - {"checks"}
            return cls(checks=checks, **{k: v for k, v in raw.items() if k in known})
        except (KeyError, TypeError) as e:
            raise PipelineError(f"{where}: not a `pipeline verify-cache --json` result (missing or bad field {e})") from None

    def with_status(self, status: str) -> list[str]:
        """The names of the checks with this status."""
        return [c.check for c in self.checks if c.status == status]

    def statuses(self) -> dict[str, str]:
        return {c.check: c.status for c in self.checks}

    def check(self, name: str) -> CheckLine:
        found = [c for c in self.checks if c.check == name]
        if not found:
            raise PipelineError(f"verify result of {self.cache}: no check named {name!r}")
        return found[0]
