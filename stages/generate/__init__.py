"""`pipeline generate`: options.py (its flags), run.py (the recipe), show.py (what it prints)."""

from __future__ import annotations

from pipeline.ui import ProgressBar, warning
from pipeline.ui.options import command
from stages.generate.options import GenerateOptions
from stages.generate.show import show_generate


@command(GenerateOptions)
def generate(options: GenerateOptions) -> None:
    """Regenerate the conversations' assistant turns with the target itself (resumable, sharded)."""
    from pipeline.distributed import launched_rank  # imports torch: `pipeline --help` stays fast
    from stages.generate.run import run_generate

    with ProgressBar("generate", "rows", total=0, enabled=not options.json_out and launched_rank() == 0) as bar:
        result = run_generate(options, progress=bar.advance, on_total=bar.set_total, warn=warning)
    show_generate(result, options.json_out)
