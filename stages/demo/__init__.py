"""`pipeline demo`: options.py (its flags), run.py (the recipe), show.py (what it prints)."""

from __future__ import annotations

from pipeline.ui.options import command
from stages.demo.options import DemoOptions
from stages.demo.show import show_demo, show_demo_step


@command(DemoOptions)
def demo(options: DemoOptions) -> None:
    """The whole pipeline on the embedded tiny target: extract, verify, train, speculative-decoding
    eval, report. About 5 minutes on 2 CPU cores; re-running resumes."""
    from stages.demo.run import run_demo  # imports torch: `pipeline --help` stays fast

    summary = run_demo(options.out, quick=options.quick, progress=not options.json_out, report_to=options.report_to,
                       block_size=options.block_size, say=show_demo_step)
    show_demo(summary, options.json_out)
