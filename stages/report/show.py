"""What `pipeline report` prints: verdicts, rolling windows, extrapolation and the runs compared, or --json's document(s)."""

from __future__ import annotations

import json

from rich.table import Table

from pipeline.records.eval_result import variants_in
from pipeline.ui import console, print_json


# Verdict and check colours; anything unknown prints white rather than failing the render.
VERDICT_COLOURS = {"improving": "green", "plateau": "yellow", "regressing": "bold red", "missing": "red"}


def show_report(result: dict, json_out: bool) -> None:
    if json_out:
        print_json(result)
    else:
        _report_tables(result)


def show_report_redraw(result: dict, json_out: bool) -> None:
    """One re-draw of `report --follow`. JSON goes out compact, one document per line and flushed,
    so a reader of the pipe can split the stream on newlines and sees each re-draw as it happens."""
    if json_out:
        print(json.dumps(result, default=str), flush=True)
    else:
        _report_tables(result)


def _mean_with_ci(window) -> str:
    """A rolling window as 'mean ± ci95'; a window the log had no entries for is 'missing'."""
    if not isinstance(window, dict):
        return "missing"
    ci = window.get("ci95")
    return f"{window['mean']:.4g} ± {ci:.2g}" if ci is not None else f"{window['mean']:.4g}"


def _report_tables(result: dict) -> None:
    for run in result["runs"]:
        _report_run(run)
    if "comparison" in result:
        _report_comparison(result)
    if "eval" in result:
        _report_eval(result["eval"])
    for path in result.get("plots", []):
        console.print(f"plot: {path}", highlight=False)


def _report_eval(decoded: dict) -> None:
    """Decoded tau (pooled) overall and per kind of turn, each variant a column."""
    columns = [v for v, _ in variants_in(decoded)]
    table = Table(title=f"decoded tau ({decoded['file']}: {decoded['prompts']} prompts, outputs identical to "
                        f"greedy: {'yes' if decoded['lossless'] else 'NO'})", title_justify="left")
    for col in ("turns", "prompts", *(v.plot_label for v in columns)):
        table.add_column(col)
    for name, g in [("all", decoded), *((kind.replace("_", "-"), g) for kind, g in decoded["by_kind"].items())]:
        figures = dict(variants_in(g))
        table.add_row(name, str(g["prompts"]), *(f"{figures[v]:.2f}" if v in figures else "-" for v in columns))
    console.print(table)


def _report_run(run: dict) -> None:
    table = Table(title=f"{run['name']}: {run['entries']} entries to step {run['last_step']:g}, window "
                        f"{run['window']} entries", title_justify="left")
    for col in ("metric", "last window (95% CI)", "change vs previous window", "z", "verdict", "extrapolated at end"):
        table.add_column(col)
    for metric, v in run["verdicts"].items():
        last = next((c[metric] for c in reversed(run["checkpoints"]) if isinstance(c.get(metric), dict)), None)
        verdict = v.get("verdict", "")
        ext = run["extrapolated"].get(metric)
        table.add_row(metric, _mean_with_ci(last), f"{v['change']:+.3g}" if "change" in v else "",
                      f"{v['z']:+.1f}" if "z" in v else "", f"[{VERDICT_COLOURS.get(verdict, 'white')}]{verdict}[/]",
                      f"{ext:.4g}" if isinstance(ext, float) else "")
    console.print(table)
    checkpoints = Table(title=f"{run['name']}: rolling means at checkpoints", title_justify="left")
    shown = ("loss", "ce", "accuracy", "avg_streak", "ddtree_streak8")
    for col in ("at", *shown):
        checkpoints.add_column(col)
    for c in run["checkpoints"]:
        checkpoints.add_row(c["at"], *(_mean_with_ci(c[m]) for m in shown))
    console.print(checkpoints)
    for problem in run["cliffs"]:
        console.print(f"[bold red]cliff[/] {problem['metric']} at step {problem['step']:g}: "
                      f"{problem['before']:.4g} -> {problem['after']:.4g}")
    for problem in run["grad_norm_anomalies"]:
        console.print(f"[bold red]grad-norm anomaly[/] at step {problem['step']:g}: {problem['value']:.4g}")
    if run["missing"]:
        console.print("[red]missing keys[/] (entries without them; never counted as zero): "
                      + ", ".join(f"{k} in {n}" for k, n in run["missing"].items()))
    if run.get("draft_vocab"):
        dv = run["draft_vocab"]
        last = dv["outside_vocab_last"]
        console.print(f"draft vocabulary: {dv['size']:,} of {dv['target_size']:,} tokens, covering {dv['coverage']:.2%} of "
                      f"the cache's labels" + ("" if last is None else f"; outside it in the last log line: {last:.2%} "
                                               "of supervised slots (out of the loss, misses in the metrics)"))
    if run.get("tap_projection"):
        tp = run["tap_projection"]
        console.print(f"projected cache: fc trained on {tp['rank']:,} values a token (a basis keeping {tp['energy']:.2%} "
                      f"of a {tp['pilot_tokens']:,}-token pilot's energy, {tp['digest'][:12]}); the export folds it")
    if "reference" in run and run["reference"]["extrapolated_tau"] is not None:
        ref = run["reference"]
        console.print(f"extrapolated tau {ref['extrapolated_tau']:.2f} vs reference {ref['reference_tau']:.2f} "
                      f"({ref['gap']:+.2f}); {ref['note']}")


def _report_comparison(result: dict) -> None:
    names = [r["name"] for r in result["runs"]]
    table = Table(title="runs at matching steps (rolling means)", title_justify="left")
    for col in ("step", "metric", *names, "leader", "margin", "beyond noise"):
        table.add_column(col)
    for row in result["comparison"]:
        for metric in ("loss", "ce", "accuracy", "avg_streak"):
            e = row[metric]
            means = [f"{e['means'][n]:.4g}" if isinstance(e["means"][n], float) else "missing" for n in names]
            table.add_row(f"{row['step']:g}", metric, *means, e.get("leader", ""),
                          f"{e['margin']:.3g}" if "margin" in e else "", "yes" if e.get("significant") else "no")
    console.print(table)

