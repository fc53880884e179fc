"""What each command prints when it finishes: a rich table for people, or with `--json` the
stage's result as one JSON document on stdout (the stage's dict, untouched, so scripts see every
field the tables leave out).
"""

from __future__ import annotations

import json

from rich.markup import escape
from rich.table import Table

from pipeline.records.eval_result import EvalResult, flat_in, grouped_labels, variants_in
from pipeline.records.verify_result import VerifyResult
from pipeline.ui import console, err_console, error, key_value_table, print_json

# Verdict and check colours; anything unknown prints white rather than failing the render.
VERDICT_COLOURS = {"improving": "green", "plateau": "yellow", "regressing": "bold red", "missing": "red"}
CHECK_COLOURS = {"pass": "green", "fail": "bold red", "skipped": "yellow", "inconclusive": "yellow"}


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


def show_train(summary: dict, json_out: bool) -> None:
    if json_out:
        print_json(summary)
        return
    last = summary.pop("last") or {}
    rows = [(k, v) for k, v in summary.items()]
    rows += [(k, f"{last[k]:.4f}") for k in ("loss", "ce", "accuracy", "top4_acc", "avg_streak", "ddtree_streak8",
                                               "outside_vocab") if k in last]
    console.print(key_value_table("train", rows))


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


def show_eval(result: dict, json_out: bool) -> None:
    if json_out:
        print_json(result)
    evaluated = EvalResult.from_json(result)
    if not json_out:
        _eval_tables(evaluated)
    # Said in both modes: a lossy result is a bug, and the JSON reader must not be the only one told.
    if evaluated.lossless is False:
        first = next(d for r in evaluated.variants.values() for d in r["mismatches"])
        where = (f"prompt {first['prompt']}, generated token {first['position']}: greedy {first['greedy_token']}, "
                 f"speculative {first['speculative_token']}"
                 + (f", {first['gap']:.3g} logits below the best (a tie is within {first['tolerance']:.3g})"
                    if first["gap"] is not None else ""))
        error(f"speculative output differs from greedy decoding ({where}; a bug: speculative decoding is lossless)")


def _group_table(title: str, groups: dict) -> None:
    """Pooled tau (mean of per-response means) per group, each variant a column."""
    if not groups:
        return
    columns = [v for v, _ in variants_in(next(iter(groups.values())))]
    table = Table(title=title, title_justify="left")
    for col in ("group", "prompts", *(f"{v.label} tau" for v in columns)):
        table.add_column(col)
    def cell(f: dict) -> str:
        return f"{f['tau_pooled']:.2f} ({f['tau_mean_of_means']:.2f})"
    for name, g in groups.items():
        figures = dict(variants_in(g))
        table.add_row(name, str(g["prompts"]), *(cell(figures[v]) for v in columns))
    console.print(table)


def _eval_tables(result: EvalResult) -> None:
    sampling, g = result.sampling, result.reference
    if sampling:
        baseline = "plain sampling"
        mode = (f"sampled (temperature {sampling['temperature']:g}, top-p {sampling['top_p']:g}, "
                f"top-k {sampling['top_k'] or 'off'}, seed {sampling['seed']})")
    else:
        baseline, mode = "greedy", "greedy"
    table = Table(title=f"eval: {result.prompts} prompts, block {result.block_size}, {mode}, "
                        f"{baseline} {g['tokens_per_s']:,.0f} tok/s", title_justify="left")
    columns = ["method", "tau (mean of means)", "tau (pooled)", "verify passes/token", "target passes/token",
               "tok/s", f"speed vs {baseline}"]
    for col in columns + ([] if sampling else ["identical to greedy"]):
        table.add_column(col)
    rows = [(v.label, r) for v, r in result.variants.items()]
    for name, r in rows:
        speedup = r["speedup_vs_plain_sampling"] if sampling else r["speedup_vs_greedy"]
        cells = [name, f"{r['tau_mean_of_means']:.2f}", f"{r['tau_pooled']:.2f}", f"{r['verify_passes_per_token']:.3f}",
                 f"{r['target_passes_per_token']:.3f}", f"{r['tokens_per_s']:,.0f}", f"{speedup:.2f}x"]
        if not sampling:
            cells.append(f"{r['identical_to_greedy']}/{result.prompts}"
                         + (f" (+{r['departed_at_ties']} at ties)" if r.get("departed_at_ties") else ""))
        table.add_row(*cells)
    console.print(table)
    if sampling:
        console.print("lossless in distribution by the rule (speculative sampling; outputs are not compared with "
                      "plain sampling's one sample per prompt)", highlight=False)
    for name, r in rows:
        for d in r.get("ties", []):
            console.print(f"{name}: prompt {d['prompt']} departs from greedy at generated token {d['position']} where the "
                          f"target ties (tokens {d['greedy_token']} and {d['speculative_token']} within {d['gap']:.3g} "
                          f"logits of the best, tolerance {d['tolerance']:.3g}: rounding in another batch shape)",
                          highlight=False)
    if any(v.kind.parametrised for v in result.variants):
        console.print(f"DDTree verified as {result.tree_verify} ({result.tree_verify_reason})", highlight=False)
    _group_table("tau by kind of turn", result.by_kind)
    if result.by_field is not None:
        _group_table(f"tau by {result.by_field['field']}", result.by_field["groups"])
    lead, figures = next(iter(result.variants.items()))
    console.print(f"{lead.label} acceptance lengths: " + "  ".join(f"{k}:{v}" for k, v in figures["accept_histogram"].items()),
                  highlight=False)
    if result.teacher_forced is not None:
        tf = result.teacher_forced
        console.print(f"teacher-forced on the cache (last assistant turns, {tf['anchors']:,} anchors): "
                      f"avg_streak + 1 = {tf['tau_estimate']:.2f}, decoding replayed on its streaks = "
                      f"{tf['tau_walk']:.2f}, accuracy {tf['accuracy']:.3f}", highlight=False)
    if result.outputs is not None:
        console.print(f"outputs: {result.outputs} (a JSON line per prompt)", highlight=False)


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


def show_cache_info(info: dict, json_out: bool) -> None:
    if json_out:
        print_json(info)
        return
    done, counts, size, read = info["completeness"], info["counts"], info["bytes"], info["read"]
    prov = info["provenance"]

    def groups(grouped: dict) -> str:
        return "; ".join(f"{value}: {g['shards']} shards" for value, g in grouped.items()) or "none"

    def share(value) -> str:
        return "n/a" if value is None else f"{value:.1%}"

    rows = [("cache", info["cache"]), ("schema", info["schema_version"]), ("created", info["created"]),
            ("shards committed / planned", f"{done['committed']} / {done['planned']}"
             + ("" if done["complete"] else f" (INCOMPLETE: {len(done['missing'])} missing, {done['missing_rows']} rows)")),
            ("uncommitted (record does not match files)", ", ".join(done["broken"]) or "none"),
            ("shards of another identity", "; ".join(f"{k}: {', '.join(v)}" for k, v in done["other_identity"].items())
             or "none"),
            ("kernel path", groups(prov["kernel_path"]))]
    rows += [(f"  {op}", groups(kinds)) for op, kinds in prov["ops"].items()]
    rows += [("hosts", groups(prov["hosts"])), ("environments", groups(prov["environments"])),
             ("layouts", groups(prov["layouts"])),
             ("rows / samples", f"{counts['rows']:,} / {counts['samples']:,}"),
             ("tokens / supervised", f"{counts['tokens']:,} / {counts['supervised_tokens']:,} ({share(counts['supervised_share'])})"),
             ("reasoning / tool-call share of supervised", f"{share(counts['reasoning_share'])} / {share(counts['tool_call_share'])}"),
             ("truncated / skipped overlong / malformed / no supervised token",
              f"{counts['truncated']} / {counts['overlong_skipped']} / {counts['malformed']} / {counts['no_supervised_tokens']}"),
             ("stored bytes / files", f"{size['stored']:,} / {size['files']:,}"),
             ("bytes per token (stored / raw)", "n/a" if size["per_token"] is None else
              f"{size['per_token']:,.1f} / {size['raw_per_token']:,.1f} ({size['stored_vs_raw']:.3f})"),
             ("read", f"{read['records']} shard records in {read['seconds']:.2f} s"
              + ("" if read["requests"] is None else f", {read['requests']} requests"))]
    if info.get("draft_vocab"):
        dv = info["draft_vocab"]
        rows.append(("supervised labels (distinct)", f"{dv['labels']:,} ({dv['distinct']:,} of {dv['target_vocab']:,} ids; "
                                                     f"first {dv['max_length']:,} tokens of each sample)"))
        rows += [(f"draft vocabulary {r['size']:,}: coverage", f"{r['coverage']:.2%} (reserved {r['reserved']}, byte "
                                                               f"fallbacks {r['byte_fallbacks']})") for r in dv["rows"]]
    console.print(key_value_table("cache-info", [(k, escape(str(v))) for k, v in rows]))
    identity = info["identity"]
    console.print(key_value_table("identity", [(f"{section}.{k}", escape(str(v))) for section in ("target", "tokenizer", "capture", "data")
                                               for k, v in identity[section].items()]))
