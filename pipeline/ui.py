"""One output layer: humans get rich tables, machines get one JSON document (`--json`).

Progress bars and colour go to stderr and are off in JSON mode, so stdout stays parseable.
"""

from __future__ import annotations

import json
import sys

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
