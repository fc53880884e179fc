"""What `pipeline extract` prints: the shards written, tokens and bytes (--dry-run: the bill), or --json's document."""

from __future__ import annotations

from rich.markup import escape

from pipeline.ui import console, key_value_table, print_json


def show_extract(summary: dict, json_out: bool) -> None:
    if json_out:
        print_json(summary)
        return

    def with_thousands(value):
        return f"{value:,.2f}" if isinstance(value, float) else (f"{value:,}" if isinstance(value, int) else value)

    # The layout is a nested description of the arrays, for machines; the table keeps to counts.
    console.print(key_value_table("extract", [(k, with_thousands(v)) for k, v in summary.items() if k != "layout"]))


def show_extract_dry(bill: dict, json_out: bool) -> None:
    if json_out:
        print_json(bill)
        return

    def size(n: float) -> str:
        for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
            if abs(n) < 1000 or unit == "PB":
                return f"{n:,.1f} {unit}" if unit != "B" else f"{n:,.0f} B"
            n /= 1000
        return str(n)

    spread = bill["samples_per_shard"]
    files = bill["files_per_shard"]
    seconds = bill["extract_seconds"]
    rows = [("cache (not touched)", bill["cache"]), ("target (config and tokenizer only)", bill["target"]),
            ("taps / hidden / vocab / top-k / format",
             f"{bill['taps']} / {bill['hidden_size']:,} / {bill['vocab_size']:,} / {bill['top_k']} / {bill['hidden_format']}"),
            ("shards", f"{bill['selected_shards']} of {bill['num_shards']}"),
            ("rows: valid / refused", f"{bill['rows']:,}: {bill['valid_rows']:,} / {bill['refused_rows']:,} "
             f"(truncated {bill['truncated']:,}, overlong skipped {bill['overlong_skipped']:,}, "
             f"no supervised token {bill['no_supervised_tokens']:,}, malformed {bill['malformed']:,})"),
            ("tokens / supervised", f"{bill['tokens']:,} / {bill['supervised_tokens']:,}"),
            ("samples per shard (min / mean / max)", f"{spread['min']:,} / {spread['mean']:,.1f} / {spread['max']:,}"),
            ("raw bytes per token (schema)", f"{bill['raw_bytes_per_token']:,}: " + ", ".join(
                f"{k} {v:,}" for k, v in bill["raw_bytes_per_token_by_array"].items())),
            ("raw bytes", size(bill["raw_bytes"])),
            (f"stored bytes (x {bill['assume_compression']} assumed compression)", size(bill["stored_bytes"])),
            ("files (per shard: min / max)", f"{bill['files']:,} ({files['min']} / {files['max']})"),
            ("extraction time", "pass --assume-tokens-per-s" if seconds is None else
             (f"{seconds / 3600:,.2f} h" if seconds >= 3600 else f"{seconds:,.1f} s")
             + f" at {bill['assume_tokens_per_s']:,.0f} tokens/s"),
            ("dry run took", f"{bill['dry_run_seconds']:.1f} s")]
    if bill["empty_shards"]:
        rows.append(("shards with no supervised sample (extract refuses them)", str(bill["empty_shards"][:10])))
    console.print(key_value_table("extract --dry-run", [(k, escape(str(v))) for k, v in rows]))

