"""RUN/train_log.jsonl: one JSON line per logged training step (DESIGN 4). `pipeline train` writes
it (and trims it to the step a run resumes from); report, the live verdicts, the trackers and the
benchmarks read it, all through `read_train_log`.

Every field but `step` may be missing: the report reads logs of older runs and of other trainers
("missing keys stay missing"); the values are kept as written (a non-finite loss is a finding, not
a parse error), so readers check that a value is a number before using it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.files import write_atomic

TERM_PREFIX = "loss_"     # each term of a composite objective is logged as loss_<term>


@dataclass(frozen=True)
class LogLine:
    step: int
    epoch: int | None = None
    loss: float | None = None
    # The plain cross-entropy: mean -log q(label) over the supervised slots, unweighted (no decay,
    # no D-PACE weight, no other term): `loss` depends on the objective and the slot weights, this
    # does not, so runs of different recipes compare on it (README: Metrics).
    ce: float | None = None
    accuracy: float | None = None
    top4_acc: float | None = None
    top8_acc: float | None = None
    avg_streak: float | None = None
    ddtree_streak4: float | None = None
    ddtree_streak8: float | None = None
    pos_acc: list[float] | None = None          # accuracy per draft slot, slot 1 first
    lr: float | None = None
    grad_norm: float | None = None
    noise_std: float | None = None
    tok_per_sec: float | None = None
    elapsed_s: float | None = None
    # Beyond DESIGN 4: where in the data, and how long this rank waited for it.
    epoch_progress: float | None = None
    steps_per_epoch: int | None = None
    supervised_slots: int | None = None
    # With a draft vocabulary: the share of supervised slots whose label is outside it (out of the
    # loss, and a miss in accuracy and the streaks: pipeline/training/draft_vocab.py).
    outside_vocab: float | None = None
    data_wait_frac: float | None = None
    # Another objective than the first recipe's: each term's share of the loss on its own
    # (written as loss_<term>; empty for the plain ce objective).
    loss_terms: dict[str, float] = field(default_factory=dict)

    def get(self, name: str):
        """The value logged under `name` (`loss_tv` reads a term), None when the line has none."""
        if name.startswith(TERM_PREFIX) and name[len(TERM_PREFIX):] in self.loss_terms:
            return self.loss_terms[name[len(TERM_PREFIX):]]
        return getattr(self, name, None) if name in _NAMES else None

    def to_json(self) -> dict:
        """The line as written: the fields in order (those without a value left out), loss terms
        flattened to loss_<term>."""
        out = {name: value for name in _NAMES if (value := getattr(self, name)) is not None}
        out.update({TERM_PREFIX + term: value for term, value in self.loss_terms.items()})
        return out

    @classmethod
    def from_json(cls, raw: dict, where: str) -> "LogLine":
        """A line as read; `where` (file:line) names it in the error for a line without a step.
        Keys this schema does not know are left out."""
        step = raw.get("step")
        if not isinstance(step, (int, float)) or isinstance(step, bool):
            raise PipelineError(f"{where}: a log entry needs a numeric `step`")
        terms = {key[len(TERM_PREFIX):]: value for key, value in raw.items()
                 if key.startswith(TERM_PREFIX) and key not in _NAMES}
        return cls(**{name: raw[name] for name in _NAMES if name in raw}, loss_terms=terms)


_NAMES = tuple(f.name for f in dataclasses.fields(LogLine) if f.name != "loss_terms")


def write_line(file, line: LogLine) -> None:
    """Append one line to an open log and flush it, so a reader (report --follow) sees it now."""
    file.write(json.dumps(line.to_json()) + "\n")
    file.flush()


def read_train_log(path: Path) -> list[LogLine]:
    """The log's lines in file order; [] when the file is absent or empty. A torn last line (a run
    killed mid-write) is left out; any other malformed line is a one-line error naming file:line."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    lines = []
    for number, text_line in enumerate(text, 1):
        if not text_line.strip():
            continue
        try:
            raw = json.loads(text_line)
        except json.JSONDecodeError:
            if number == len(text):
                break
            raise PipelineError(f"{path}:{number}: not a JSON object") from None
        if not isinstance(raw, dict):
            raise PipelineError(f"{path}:{number}: not a JSON object")
        lines.append(LogLine.from_json(raw, f"{path}:{number}"))
    return lines


def last_step(path: Path, tail_bytes: int = 65536) -> int | None:
    """The step of the log's last complete line, reading only its end (a follower polls this on a
    log of any length); None when the file is absent or holds no complete line. Reads further
    back when the tail holds no complete line."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    with open(path, "rb") as f:
        while True:
            start = max(size - tail_bytes, 0)
            f.seek(start)
            lines = f.read().decode("utf-8", errors="replace").split("\n")
            if start > 0:
                lines = lines[1:]  # the first may begin mid-line
            for text_line in reversed(lines):
                try:
                    raw = json.loads(text_line)
                except json.JSONDecodeError:
                    continue  # the torn last line of a run killed mid-write, or blank
                if isinstance(raw, dict) and isinstance(raw.get("step"), (int, float)) and not isinstance(raw["step"], bool):
                    return int(raw["step"])
            if start == 0:
                return None
            tail_bytes *= 4


def trim_to_step(path: Path, step: int) -> None:
    """Keep the lines of a step-stamped JSONL (the log, RUN/verdicts.jsonl) up to `step`, the
    checkpoint resumed from: the resumed run writes the rest again. Kept lines stay byte for byte."""
    path = Path(path)
    if not path.exists():
        return
    kept = []
    for text_line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(text_line).get("step", math.inf) <= step:
                kept.append(text_line)
        except json.JSONDecodeError:
            break  # a torn last line from a killed run
    write_atomic(path, "".join(x + "\n" for x in kept).encode("utf-8"))
