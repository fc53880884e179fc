"""What `pipeline generate` prints: rows and turns written, dropped and skipped, speed, or --json's document."""

from __future__ import annotations

from pipeline.ui import console, key_value_table, print_json


def show_generate(result: dict, json_out: bool) -> None:
    if json_out:
        print_json(result)
        return
    console.print(key_value_table("generate", [
        ("output", result["out"] if result["assembled"] else f"not yet: shards missing {result['shards_missing']}"),
        ("rows read / written", f"{result['rows']} / {result['rows_written']}"),
        ("rows skipped (--on-error skip)", result["rows_skipped"]),
        ("dropped (turn did not end)", result["dropped_unfinished"]),
        ("turns kept verbatim (unparsed)", result["kept_verbatim"]),
        ("shards written / already done", f"{result['shards_written']} / {result['shards_already_done']}"),
        ("rows/s, tokens/s", f"{result['rows_per_s']:.2f}, {result['tokens_per_s']:.1f}"),
        ("device", result["device"]),
    ]))

