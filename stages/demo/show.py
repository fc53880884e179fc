"""What `pipeline demo` prints: each step as it starts, then the cache, training and eval figures, or --json's document."""

from __future__ import annotations

from pipeline.records.eval_result import flat_in, grouped_labels
from pipeline.ui import console, err_console, key_value_table, print_json


def show_demo_step(message: str) -> None:
    """A demo step's heading, on stderr so stdout holds only the summary (or the JSON)."""
    err_console.print(f"[bold]{message}[/]", highlight=False, markup=True)


def show_demo(summary: dict, json_out: bool) -> None:
    if json_out:
        print_json(summary)
        return
    t, e, c = summary["train"], summary["eval"], summary["cache"]
    timings = summary["timings"]
    rows = [
        ("cache", f"{c['path']}: {c['tokens']:,} tokens in {c['shards']} shards, {c['bytes']:,} bytes, "
                  f"{c['bytes_per_token']:,.0f} bytes/token"),
        ("verify-cache", "all checks passed" if summary["verify"]["passed"]
                         else f"FAILED: {', '.join(summary['verify']['failed_checks'])}"),
        ("training", f"{t['steps']} steps, block {t['block_size']}: loss {t['loss']:.3f}, accuracy {t['accuracy']:.3f}, "
                     f"avg_streak {t['avg_streak']:.2f} (teacher-forced)"),
        ("eval", f"{e['prompts']} held-out prompts, outputs identical to greedy: {'yes' if e['lossless'] else 'NO'}"),
        ("tau (block)", f"{e['block_tau_mean_of_means']:.2f} mean of per-response means, {e['block_tau_pooled']:.2f} pooled"),
        # The demo's keys <variant>_tau_pooled (ddtree8_tau_pooled): one row per DDTree budget.
        *[(f"tau ({v.plot_label})", f"{x:.2f} pooled") for v, x in flat_in(e, "tau_pooled") if v.kind.parametrised],
        # Per kind of turn: each variant, pooled.
        *[(f"tau, {kind.replace('_', '-')} turns", f"{g['prompts']} prompts: " + " / ".join(
            f"{x:.2f}" for _, x in flat_in(g, "tau_pooled")) + f" ({grouped_labels([v for v, _ in flat_in(g, 'tau_pooled')])})")
          for kind, g in e.get("by_kind", {}).items()],
        ("drafter", t["drafter"]),
        ("report", ", ".join(summary["report"]["plots"])),
        # The timings' keys are <step>_s, shown as '<step> N s'.
        ("wall time", f"{timings['total_s']:.0f} s (" + ", ".join(f"{k[:-2]} {v:.0f} s" for k, v in timings.items()
                                                                 if k != "total_s") + ")"),
    ]
    console.print(key_value_table("demo", rows))

