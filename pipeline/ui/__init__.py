"""One output layer: humans get rich tables, machines get one JSON document (`--json`).

Progress bars and colour go to stderr and are off in JSON mode, so stdout stays parseable.
This module holds the shared pieces (consoles, JSON, tables, messages, progress, the decoded
sample); options.py turns a dataclass's fields into a command's options; what each command
prints at its end lives beside it, in stages/COMMAND/show.py.
"""

from __future__ import annotations

import json
import sys
import time

from rich.console import Console
from rich.table import Table

console = Console(stderr=False, soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


def print_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def key_value_table(title: str, rows: list[tuple[str, object]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, str(value))
    return table


# verify-cache --show: a style per supervised-token kind on a terminal, a bracket tag per kind elsewhere.
SPAN_STYLES = {"reasoning": "bold black on yellow", "content": "bold black on green", "tool_call": "bold white on blue",
               "end_of_turn": "bold white on magenta", "": "dim"}
SPAN_TAGS = {"reasoning": "R", "content": "C", "tool_call": "T", "end_of_turn": "E"}


def print_sample(shown: dict, *, colour: bool | None = None) -> None:
    """A sample from `show_sample`: supervised tokens coloured by kind on a terminal; piped or
    redirected (no colour), each run of supervised tokens of one kind is wrapped as [[R ...]],
    [[C ...]], [[T ...]] or [[E ...]] (reasoning, content, tool call, end of turn), so the mask
    survives in a log."""
    from rich.markup import escape
    from rich.text import Text

    colour = console.is_terminal and not console.no_color if colour is None else colour
    kinds = ("reasoning", "content", "tool_call", "end_of_turn")
    console.print(shown["summary"], markup=False, highlight=False)
    if colour:
        console.print("  ".join(f"[{SPAN_STYLES[k]}] {k.replace('_', ' ')} [/]" for k in kinds))
        text = Text()
        for piece, kind in zip(shown["pieces"], shown["kinds"]):
            text.append(piece, style=SPAN_STYLES[kind])
        console.print(text)
        return
    console.print("supervised runs: " + "  ".join(f"[[{SPAN_TAGS[k]} {k.replace('_', ' ')}]]" for k in kinds)
                  + "; text outside [[ ]] is not supervised", markup=False, highlight=False)
    console.print(escape(tagged_text(shown["pieces"], shown["kinds"])), highlight=False, soft_wrap=True)


def tagged_text(pieces: list[str], kinds: list[str]) -> str:
    """The decoded sample with each run of supervised tokens of one kind wrapped in [[TAG ...]]."""
    out, current = [], ""
    for piece, kind in zip(pieces, kinds):
        if kind != current:
            if current:
                out.append("]]")
            if kind:
                out.append(f"[[{SPAN_TAGS[kind]} ")
            current = kind
        out.append(piece)
    if current:
        out.append("]]")
    return "".join(out)


def warning(message: str) -> None:
    from rich.markup import escape
    err_console.print(f"[yellow]warning:[/] {escape(message)}", highlight=False)


def error(message: str) -> None:
    from rich.markup import escape
    # Messages quote user text ("[train]", paths with brackets): never read it as markup.
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)


class ProgressBar:
    """Progress on stderr (count, rate, ETA); a no-op when disabled (JSON mode, non-zero ranks).
    `advance(n, tokens=k, note=...)` adds a tokens/s readout and a running figure (eval's tau).
    On a terminal: a rich bar. Otherwise (a log file, CI, `nohup`): a plain line at every
    `every_percent` of the total and at least every `every_s` seconds, never closer together than
    `min_interval_s` (so work that takes seconds stays quiet and a long step is never silent)."""

    def __init__(self, label: str, unit: str, *, total: int, enabled: bool, every_percent: float = 5.0,
                 every_s: float = 60.0, min_interval_s: float = 10.0):
        self.min_interval_s = min_interval_s
        self.enabled, self.tokens, self.t0 = enabled, 0, time.perf_counter()
        self.label, self.unit, self.total, self.done, self.note = label, unit, total, 0, ""
        self.every_percent, self.every_s = every_percent, every_s
        self.plain = enabled and not err_console.is_terminal
        self.last_line_at, self.last_percent, self.lines = self.t0, 0.0, 0
        if enabled and not self.plain:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            self.progress = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
                                     TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=err_console)
            self.task = self.progress.add_task(label, total=total, rate="")

    def __enter__(self):
        if self.enabled and not self.plain:
            self.progress.start()
        return self

    def __exit__(self, exc_type, *exc):
        if self.enabled and not self.plain:
            if exc_type is not None:   # an error's one line stands alone: no final bar printed before it
                self.progress.live.transient = True
            self.progress.stop()

    def set_total(self, total: int) -> None:
        self.total = total
        if self.enabled and not self.plain:
            self.progress.update(self.task, total=total)

    def _rate(self) -> str:
        return f"{self.tokens / max(time.perf_counter() - self.t0, 1e-9):,.0f} tok/s" if self.tokens else ""

    def advance(self, n: int, tokens: int = 0, note: str = "") -> None:
        self.tokens += tokens
        self.done += n
        self.note = note or self.note
        if not self.enabled:
            return
        if not self.plain:
            rate = "  ".join(x for x in (self._rate(), self.note) if x)
            self.progress.update(self.task, advance=n, rate=rate)
            return
        now = time.perf_counter()
        percent = 100.0 * self.done / self.total if self.total else 0.0
        due = (self.total and (percent // self.every_percent > self.last_percent // self.every_percent
                               or self.done >= self.total)) or now - self.last_line_at >= self.every_s
        finished_after_lines = self.total and self.done >= self.total and self.lines
        if due and (now - self.last_line_at >= self.min_interval_s or finished_after_lines):
            self.last_line_at, self.last_percent = now, percent
            self.lines += 1
            self._line(now)

    def _line(self, now: float) -> None:
        elapsed = now - self.t0
        parts = [f"{self.label}: {self.done}/{self.total or '?'} {self.unit}"
                 + (f" ({100.0 * self.done / self.total:.0f}%)" if self.total else ""),
                 f"{self.done / max(elapsed, 1e-9):.2f} {self.unit}/s", self._rate(), self.note,
                 f"elapsed {_clock(elapsed)}"]
        if self.total and self.done:
            parts.append(f"eta {_clock(elapsed * (self.total - self.done) / self.done)}")
        err_console.print("  ".join(x for x in parts if x), highlight=False, markup=False)


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class TrainView:
    """The live view of `pipeline train` (stderr, rank 0): a step bar with ETA and the latest
    logged numbers, plus one printed line per log step so the history stays on screen."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def start(self, *, total: int, done: int) -> None:
        if not self.enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        self.progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                                 TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[numbers]}"),
                                 console=err_console)
        self.task = self.progress.add_task("train", total=total, completed=done, numbers="")
        self.progress.start()

    def update(self, step: int, record: dict | None) -> None:
        if not self.enabled:
            return
        if record is None:
            self.progress.update(self.task, completed=step)
            return
        numbers = (f"loss {record['loss']:.3f}  acc {record['accuracy']:.3f}  streak {record['avg_streak']:.2f}  "
                   f"{record['tok_per_sec']:,.0f} tok/s")
        self.progress.update(self.task, completed=step, numbers=numbers)
        self.progress.console.print(
            f"step {record['step']:>7}  ep {record['epoch_progress']:.2f}  loss {record['loss']:.4f}  "
            f"acc {record['accuracy']:.3f}  top4 {record['top4_acc']:.3f}  streak {record['avg_streak']:.2f}  "
            f"tree8 {record['ddtree_streak8']:.2f}  lr {record['lr']:.2e}  gnorm {record['grad_norm']:.2f}  "
            f"{record['tok_per_sec']:,.0f} tok/s  wait {record['data_wait_frac']:.0%}", highlight=False)

    def stop(self) -> None:
        if self.enabled:
            self.progress.stop()
