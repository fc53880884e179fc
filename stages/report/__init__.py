"""`pipeline report`: options.py (its flags), run.py (the recipe), show.py (what it prints)."""

from __future__ import annotations

from pipeline.errors import PipelineError
from pipeline.ui.options import command
from stages.report.options import ReportOptions
from stages.report.show import show_report, show_report_redraw


@command(ReportOptions)
def report(options: ReportOptions) -> None:
    """Convergence diagnostics: rolling means with confidence intervals, plateau/regression
    verdicts, cliffs, grad-norm anomalies, extrapolation, run-vs-run comparison, plots; with
    --eval, the decoded tau per kind of turn."""
    from stages.report.run import default_plots_folder, follow_report, run_report  # no torch, but matplotlib: imported when it runs

    o = options
    settings = {"window_size": o.window, "every": o.every, "epochs": o.epochs, "steps_per_epoch": o.steps_per_epoch,
                "reference_tau": o.reference_tau, "plots": o.out or default_plots_folder(o.logs), "eval_file": o.eval_file}
    if o.follow:
        if o.interval <= 0:
            raise PipelineError(f"--interval must be > 0, got {o.interval}")
        follow_report(o.logs, interval=o.interval, show=lambda result: show_report_redraw(result, o.json_out), **settings)
        return
    show_report(run_report(o.logs, **settings), o.json_out)
