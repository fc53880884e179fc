"""`pipeline`: the command-line entry point. It only registers the commands (each lives in its own
folder of `stages/`: options.py declares its flags once, run.py is its recipe, show.py what it
prints) and renders user errors (PipelineError) once, here.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Annotated

import typer

from pipeline.errors import PipelineError
from pipeline.files import STORAGE_ERRNOS, describe_os_error
from pipeline.threads import apply_threads
from pipeline.ui import error
from stages.cache_info import cache_info
from stages.demo import demo
from stages.eval import eval_
from stages.extract import extract
from stages.generate import generate
from stages.report import report
from stages.target_info import target_info
from stages.train import train
from stages.verify_cache import verify_cache

# A command's recipe imports torch (a second or more), so each command imports its own run.py when
# it runs: `pipeline --help` and a mistyped option answer at once. Nothing imported above pulls in
# torch (tests/command_line/test_layers.py checks it).

# Nothing in this tool downloads at run time: targets, tokenizers and data are local paths.
# Set before anything imports huggingface_hub (through transformers), which reads it once, at import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

app = typer.Typer(
    name="pipeline",
    help="Train DFlash speculative-decoding drafters offline: extract a hidden-state cache once, "
         "verify it, train from it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_state = {"debug": False, "threads": "auto"}


@app.callback()
def _main(debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks on errors.")] = False,
          threads: Annotated[str, typer.Option(help="CPU threads for torch: N, or 'auto' (default): OMP_NUM_THREADS when set, else the cores other processes leave idle now (torch's default on an idle machine; on a busy one fewer threads run faster).")] = "auto") -> None:
    _state["debug"] = debug
    _state["threads"] = threads


def _user_errors(exit_code: int = 1):
    """Render a PipelineError as one line on stderr and exit `exit_code` (tracebacks only with
    --debug); verify-cache exits 2 on them, keeping 1 for a check that failed."""
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                apply_threads(_state["threads"])
                result = fn(*args, **kwargs)
                if "torch.distributed" in sys.modules:  # a torchrun job: leave it as it should (pipeline/distributed.py)
                    from pipeline.distributed import finish_distributed
                    finish_distributed()
                return result
            except PipelineError as e:
                if _state["debug"]:
                    raise
                error(str(e))
                raise typer.Exit(exit_code) from None
            except OSError as e:
                # A full disk or a quota can strike any write (a log line, a lock file): one line
                # naming the file, not a traceback. Other OS errors keep theirs: they may be bugs.
                if _state["debug"] or e.errno not in STORAGE_ERRNOS:
                    raise
                error(f"{e.filename or 'a write'}: {describe_os_error(e)}")
                raise typer.Exit(exit_code) from None
        return wrapper
    return decorate


# The commands, each declared in its own folder of stages/ (its options, recipe and summary side by
# side); verify-cache exits 2 on a usage error, keeping 1 for a check that failed.
COMMANDS = [("extract", extract, 1), ("train", train, 1), ("generate", generate, 1), ("eval", eval_, 1),
            ("report", report, 1), ("verify-cache", verify_cache, 2), ("demo", demo, 1),
            ("cache-info", cache_info, 1), ("target-info", target_info, 1)]
for _name, _command, _exit_code in COMMANDS:
    app.command(_name)(_user_errors(_exit_code)(_command))


if __name__ == "__main__":
    app()
