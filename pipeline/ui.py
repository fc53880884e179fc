"""One output layer: humans get rich tables, machines get one JSON document (`--json`).

Progress bars and colour go to stderr and are off in JSON mode, so stdout stays parseable.
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
    """A rich progress bar on stderr (count, rate, ETA); a no-op when disabled (JSON mode,
    non-zero ranks). `advance(n, tokens=k)` adds a tokens/s readout."""

    def __init__(self, label: str, unit: str, *, total: int, enabled: bool):
        self.enabled, self.tokens, self.t0 = enabled, 0, time.perf_counter()
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            self.progress = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
                                     TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=err_console)
            self.task = self.progress.add_task(label, total=total, rate="")

    def __enter__(self):
        if self.enabled:
            self.progress.start()
        return self

    def __exit__(self, exc_type, *exc):
        if self.enabled:
            if exc_type is not None:   # an error's one line stands alone: no final bar printed before it
                self.progress.live.transient = True
            self.progress.stop()

    def set_total(self, total: int) -> None:
        if self.enabled:
            self.progress.update(self.task, total=total)

    def advance(self, n: int, tokens: int = 0) -> None:
        self.tokens += tokens
        if self.enabled:
            rate = f"{self.tokens / max(time.perf_counter() - self.t0, 1e-9):,.0f} tok/s" if self.tokens else ""
            self.progress.update(self.task, advance=n, rate=rate)


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
