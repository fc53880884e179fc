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


def error(message: str) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)


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

    def __exit__(self, *exc):
        if self.enabled:
            self.progress.stop()

    def advance(self, n: int, tokens: int = 0) -> None:
        self.tokens += tokens
        if self.enabled:
            rate = f"{self.tokens / max(time.perf_counter() - self.t0, 1e-9):,.0f} tok/s" if self.tokens else ""
            self.progress.update(self.task, advance=n, rate=rate)
