"""What `pipeline eval` prints: tau per variant, per kind of turn and per field, and lossless or not; or --json's document."""

from __future__ import annotations

from rich.table import Table

from pipeline.records.eval_result import EvalResult, variants_in
from pipeline.ui import console, error, print_json


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

