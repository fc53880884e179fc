"""What `pipeline target-info` prints: the target's facts, taps and tokenizer, or --json's document."""

from __future__ import annotations

from pipeline.ui import console, key_value_table, print_json


def show_target_info(summary: dict, json_out: bool) -> None:
    if json_out:
        print_json(summary)
        return

    def four_digits(value):
        return f"{value:.4g}" if isinstance(value, float) else value

    # Top-level facts first, in one table; each nested section (tokenizer, template, ...) its own.
    console.print(key_value_table("target", [(k, four_digits(v)) for k, v in summary.items() if not isinstance(v, dict)]))
    for section, values in summary.items():
        if isinstance(values, dict):
            console.print(key_value_table(section, [(k, four_digits(v)) for k, v in values.items()]))

