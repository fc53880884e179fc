"""`pipeline extract`: options.py (its flags), run.py (the recipe), show.py (what it prints)."""

from __future__ import annotations

from pipeline.config import ExtractConfig, load_config
from pipeline.errors import PipelineError
from pipeline.ui.options import command
from stages.extract.options import ExtractOptions
from stages.extract.show import show_extract, show_extract_dry
from stages.options import config_file


@command(ExtractOptions, config=ExtractConfig)
def extract(options: ExtractOptions, overrides: dict) -> None:
    """Run the target once and write the sharded, checksummed hidden-state cache."""
    from stages.extract.run import run_extract, run_extract_dry  # imports torch: `pipeline --help` stays fast

    o = options
    config = config_file(o.config, "extract.toml")
    if o.thinking is not None:
        base = load_config(ExtractConfig, config, {}, section="extract").chat_template_kwargs
        overrides["chat_template_kwargs"] = {**base, "enable_thinking": o.thinking}
    cfg = load_config(ExtractConfig, config, overrides, section="extract")
    if o.dry_run:
        show_extract_dry(run_extract_dry(cfg, o.shards, assume_tokens_per_s=o.assume_tokens_per_s,
                                         assume_compression=o.assume_compression, progress=not o.json_out), o.json_out)
        return
    if o.assume_tokens_per_s is not None or o.assume_compression != 1.0:
        raise PipelineError("--assume-tokens-per-s and --assume-compression go with --dry-run")
    summary = run_extract(cfg, o.shards, progress=not o.json_out)
    if summary["rank"] == 0:
        show_extract(summary, o.json_out)
