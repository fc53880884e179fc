"""`pipeline train`: options.py (its flags), run.py (the recipe), show.py (what it prints)."""

from __future__ import annotations

from pipeline.config import TrainConfig
from pipeline.ui import TrainView, warning
from pipeline.ui.options import command
from stages.options import config_file
from stages.train.options import TrainOptions
from stages.train.show import show_train


@command(TrainOptions, config=TrainConfig)
def train(options: TrainOptions, overrides: dict) -> None:
    """Train a DFlash drafter from a cache alone (torchrun for data parallel)."""
    from pipeline.distributed import launched_rank  # imports torch: `pipeline --help` stays fast
    from stages.train.run import resolve_config, run_train

    config = config_file(options.config, "train.toml")
    cfg, preset_target = resolve_config(config, overrides, note=warning)
    rank0 = launched_rank() == 0
    summary = run_train(cfg, preset_target=preset_target, resume=options.resume,
                        view=TrainView(rank0 and not options.json_out), warn=warning)
    if rank0:
        show_train(summary, options.json_out)
