"""`pipeline target-info`: options.py (its flags), run.py (the recipe), show.py (what it prints)."""

from __future__ import annotations

from pipeline.embedded import BUILD_REPORT, HELDOUT_DATA, TARGET_DIR
from pipeline.ui.options import command
from stages.target_info.options import TargetInfoOptions
from stages.target_info.show import show_target_info


@command(TargetInfoOptions)
def target_info(options: TargetInfoOptions) -> None:
    """Summarise a target model directory: class, layers, taps, tokenizer, chat template."""
    from stages.target_info.run import target_summary  # imports torch: `pipeline --help` stays fast

    path, data, build = options.path, options.data, None
    if path is None:
        path, data, build = TARGET_DIR, data or HELDOUT_DATA, BUILD_REPORT
    show_target_info(target_summary(path, heldout=data, build_report=build), options.json_out)
