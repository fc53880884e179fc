"""What `pipeline train` prints when it finishes: a rich table for people, or with `--json`
the result as one JSON document on stdout (untouched, so scripts see every field the tables leave out)."""

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

