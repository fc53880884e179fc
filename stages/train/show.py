"""What `pipeline train` prints at its end: steps, the last logged metrics and where the drafter went, or --json's document."""

from __future__ import annotations

from pipeline.ui import console, key_value_table, print_json


def show_train(summary: dict, json_out: bool) -> None:
    if json_out:
        print_json(summary)
        return
    last = summary.pop("last") or {}
    rows = [(k, v) for k, v in summary.items()]
    rows += [(k, f"{last[k]:.4f}") for k in ("loss", "ce", "accuracy", "top4_acc", "avg_streak", "ddtree_streak8",
                                               "outside_vocab") if k in last]
    console.print(key_value_table("train", rows))

