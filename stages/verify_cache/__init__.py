"""`pipeline verify-cache`: options.py (its flags), run.py (the recipe), show.py (what it prints).
Exit 0: all checks pass; 1: a check failed; 2: a usage error (cli.py registers it so)."""

from __future__ import annotations

import typer

from pipeline.ui import print_sample
from pipeline.ui.options import command
from stages.verify_cache.options import VerifyOptions
from stages.verify_cache.show import show_verify


@command(VerifyOptions)
def verify_cache(options: VerifyOptions) -> None:
    """Prove a cache is complete, intact, aligned and correctly masked. Exit 0: all checks pass;
    1: a check failed; 2: usage error."""
    from pipeline.verify.sample_view import show_sample  # imports torch: `pipeline --help` stays fast
    from stages.verify_cache.run import run_verify

    shown = show_sample(options.cache, options.show, options.target) if options.show is not None else None
    if shown is not None and not options.json_out:
        print_sample(shown)
    result = run_verify(options, progress=not options.json_out)
    if shown is not None:
        result["sample"] = shown
    show_verify(result, options.json_out)
    raise typer.Exit(0 if result["passed"] else 1)
