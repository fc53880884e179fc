"""`pipeline eval --outputs FILE`: what eval decoded, one JSON line per prompt.

tau and losslessness say how a drafter did, not what it wrote: a line holds a prompt's number,
its kind of turn (groups.turn_kind, as `by_kind` counts it), the reference's ids and text (plain
greedy, or plain sampling under "plain_sampling"), and per variant (where eval's JSON puts it:
"block", "tree": {"<budget>": ...}) its ids, text, accepted draft tokens per verify step and, for
greedy, where it departed from greedy (ties.judge_departures' record; null when it did not).

Streamed: eval decodes a batch of prompts (`--batch-size`) with the reference and every variant
before the next (compare.py), so the batch's lines are written, and flushed, as soon
as its last variant is done (one prompt at a time by default). They go to FILE.partial, renamed
to FILE once every prompt's line is in: a file under the name asked for is complete, and a killed
eval leaves FILE.partial, whose newline-terminated lines are complete. Costs the tokenizer's
decode of every output and one JSON line per prompt; nothing the decoding reads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.files import fsync_dir
from pipeline.records.eval_result import Variant, nest
from pipeline.eval.speculative_decoding import Decoded
from pipeline.eval.groups import TurnMarkers, turn_kind
from pipeline.eval.ties import Departure

PARTIAL = ".partial"  # the name a file has while eval writes it


def partial_path(path: Path) -> Path:
    return path.with_name(path.name + PARTIAL)


def check_outputs_path(path: Path) -> None:
    """One line, before any decoding, for a path eval could not write at the end."""
    if path.is_dir():
        raise PipelineError(f"--outputs {path}: is a directory; give the name of a file to write (JSONL)")
    folder = path.parent
    if not folder.is_dir():
        raise PipelineError(f"--outputs {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PipelineError(f"--outputs {path}: cannot write in the folder {folder}")


class OutputsWriter:
    """Writes eval's lines to FILE.partial as batches finish; `finish` renames it to FILE. Used as a
    context manager: leaving it closes the partial file (a failed eval leaves it, lines whole)."""

    def __init__(self, path: Path, *, tokenizer, markers: TurnMarkers, reference_key: str, sampled: bool):
        check_outputs_path(path)
        self.path, self.partial = path, partial_path(path)
        self.tokenizer, self.markers, self.reference_key, self.sampled = tokenizer, markers, reference_key, sampled
        self.lines = 0
        self._file = None

    def __enter__(self) -> OutputsWriter:
        try:
            self._file = open(self.partial, "w", encoding="utf-8")
        except OSError as e:
            raise PipelineError(f"--outputs {self.path}: cannot write {self.partial.name} ({e.strerror or e})") from None
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def write_batch(self, first: int, prompts: list[list[int]], reference: list[Decoded],
                    runs: dict[Variant, list[Decoded]], departures: dict[Variant, list[Departure]]) -> None:
        """The lines of prompts first.., in one write, flushed (`tail -f` shows them at once)."""
        lines = []
        for i, (prompt, ref) in enumerate(zip(prompts, reference)):
            number = first + i
            found = {v: next((d for d in departures.get(v, ()) if d.prompt == number), None) for v in runs}
            lines.append(self.line(number, prompt, ref, {v: results[i] for v, results in runs.items()}, found))
        self._file.write("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
        self._file.flush()
        self.lines += len(lines)

    def line(self, number: int, prompt: list[int], reference: Decoded, outputs: dict[Variant, Decoded],
             departures: dict[Variant, Departure | None]) -> dict:
        def variant(v: Variant, out: Decoded) -> dict:
            entry = {**self.decoded(out), "accepted": list(out.accepted)}
            if not self.sampled:  # sampled outputs are not compared with plain sampling's
                d = departures.get(v)
                entry["departure"] = None if d is None else {k: x for k, x in d.record().items() if k != "prompt"}
            return entry
        return {"prompt": number, "kind": turn_kind(prompt, reference.tokens, self.markers),
                self.reference_key: self.decoded(reference), **nest({v: variant(v, out) for v, out in outputs.items()})}

    def decoded(self, out: Decoded) -> dict:
        return {"ids": list(out.tokens), "text": self.tokenizer.decode(out.tokens)}

    def finish(self) -> None:
        """Every prompt's line is in: FILE.partial becomes FILE (replacing an earlier one)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        os.replace(self.partial, self.path)
        fsync_dir(self.path.parent)
