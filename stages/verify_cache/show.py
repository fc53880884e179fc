"""What `pipeline verify-cache` prints: one row per check, its status and what it found, or --json's document."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from pipeline.records.verify_result import VerifyResult
from pipeline.ui import console, print_json


CHECK_COLOURS = {"pass": "green", "fail": "bold red", "skipped": "yellow", "inconclusive": "yellow"}


def show_verify(result: dict, json_out: bool) -> None:
    if json_out:
        print_json(result)
        return
    verified = VerifyResult.from_json(result)
    # The cache path and the checks' evidence quote files and user text: escaped, never read as markup.
    table = Table(title=f"verify-cache {escape(verified.cache)}", title_justify="left")
    table.add_column("check", style="bold")
    table.add_column("status")
    table.add_column("evidence")
    for check in verified.checks:
        table.add_row(check.check, f"[{CHECK_COLOURS[check.status]}]{check.status}[/]", escape(check.summary))
        # The first few problems only: the full list is in the --json document.
        for problem in (check.evidence.get("problems") or check.evidence.get("failures")
                        or check.evidence.get("mismatched") or [])[:5]:
            table.add_row("", "", f"[red]{escape(problem)}[/]")
    console.print(table)
    unsure = verified.with_status("inconclusive")
    note = f" [yellow](inconclusive: {', '.join(unsure)})[/]" if unsure else ""
    console.print(("[bold green]all checks passed[/]" if verified.passed else "[bold red]verification FAILED[/]") + note)

