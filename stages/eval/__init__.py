"""`pipeline eval`: options.py (its flags), run.py (the recipe), show.py (what it prints)."""

from __future__ import annotations

import typer

from pipeline.ui import ProgressBar, warning
from pipeline.ui.options import command
from stages.eval.options import EvalOptions
from stages.eval.show import show_eval


@command(EvalOptions)
def eval_(options: EvalOptions) -> None:
    """Real speculative decoding with the live target: acceptance length tau for DFlash blocks and
    DDTree trees. Greedy by default, checked token for token against plain greedy decoding; with
    --temperature, speculative sampling against plain sampling (--seed: a prompt's random numbers
    depend on it and the prompt's index only)."""
    from stages.eval.run import run_eval  # imports torch: `pipeline --help` stays fast

    with ProgressBar("eval", "prompts", total=0, enabled=not options.json_out) as bar:
        result = run_eval(options, progress=bar.advance, on_total=bar.set_total, warn=warning)
    show_eval(result, options.json_out)
    if result["lossless"] is False:
        raise typer.Exit(1)
