"""What a cache check reports: its verdict (`Check`) and the samples it found at fault
(`SampleList`). Shared by every check (model-free, per-sample and model checks alike)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipeline.cache.reader import ShardReader
from pipeline.records.verify_result import CheckLine


@dataclass
class Check:
    name: str
    passed: bool
    summary: str
    evidence: dict = field(default_factory=dict)
    skipped: bool = False
    inconclusive: bool = False   # ran, but the data cannot tell pass from fail (does not fail verification)

    def line(self) -> CheckLine:
        """Its line in the verify result (pipeline/records/verify_result.py)."""
        status = "skipped" if self.skipped else "inconclusive" if self.inconclusive else ("pass" if self.passed else "fail")
        return CheckLine(self.name, status, self.summary, self.evidence)


class SampleList:
    """Offending samples: every id counted, the first few kept with the reason (bounded memory)."""

    KEEP = 20

    def __init__(self):
        self.count = 0
        self.first: list[str] = []
        self._seen: set[tuple[str, int]] = set()

    def add(self, shard: str, sample_id: int, reason: str = "") -> None:
        if (shard, sample_id) in self._seen:
            return
        self._seen.add((shard, sample_id))
        self.count += 1
        if len(self.first) < self.KEEP:
            self.first.append(f"sample {sample_id} ({shard})" + (f": {reason}" if reason else ""))

    def add_tokens(self, shard: ShardReader, tokens: np.ndarray) -> None:
        """The samples holding these token indices of `shard`."""
        if len(tokens):
            rows = np.unique(np.searchsorted(shard.offsets, tokens, side="right") - 1)
            for row in rows:
                self.add(shard.name, int(shard.sample_ids[row]))

    def __bool__(self) -> bool:
        return self.count > 0

    def describe(self) -> str:
        return f"{self.count} samples, e.g. {self.first[0]}" if self.count else "no sample"

    def evidence(self) -> dict:
        return {"offending_samples": self.count, "first_offending": self.first}
