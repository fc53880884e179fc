"""How a setting is declared: `option(...)` makes a dataclass field a command-line flag too, and
the small parsers turn a flag's text into the field's value. Nothing here knows a command."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import field

from pipeline.errors import PipelineError

# The target (and its data) shipped inside the package: pipeline/embedded.
EMBEDDED = "embedded"


def option(default=dataclasses.MISSING, *, help: str, factory=None, parse=None, flag: str | None = None,
           argument: bool = False, metavar: str | None = None, negatable: bool = False):
    """A config field that is also the command-line option `--NAME` (hyphens for underscores),
    with this help text: the command's option is derived from the field (pipeline/ui/options.py),
    so a new option is one field. The option's type is the field's (str, int, float, Path, bool: a
    `--NAME` flag when the default is False, else `--NAME/--no-NAME`; `negatable` gives a False
    default its `--no-NAME` too; a list: repeatable); `parse(text, flag)` turns the option's text
    into the value where the field is anything else. `flag` names the option where the field's
    name cannot (`--json` for `json_out`); `argument` makes it positional; `metavar` names its
    value in --help. A field without a default is a required option."""
    metadata = {"help": help, "parse": parse, "flag": flag, "argument": argument, "metavar": metavar,
                "negatable": negatable}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def int_list(text: str, flag: str) -> list[int]:
    """'1,3,5' -> [1, 3, 5]."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PipelineError(f"{flag}: {text!r} is not a comma-separated list of integers") from None


def float_list(text: str, flag: str) -> list[float]:
    """'0.9,0.95' -> [0.9, 0.95]."""
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PipelineError(f"{flag}: {text!r} is not a comma-separated list of numbers") from None


def text_list(text: str, flag: str) -> list[str]:
    """'tensorboard, mlflow' -> ['tensorboard', 'mlflow']."""
    return [x.strip() for x in text.split(",") if x.strip()]


def token_or_id(text: str, flag: str) -> str | int:
    """'248070' -> 248070 (a token id); anything else stays a token string."""
    return int(text) if text.strip().isdigit() else text


def parse_size(text) -> int | None:
    """'500G' -> bytes (K, M, G, T: powers of 1024); None when it is not a positive size."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", str(text), re.IGNORECASE)
    if not m:
        return None
    value = int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))
    return value if value > 0 else None


def refuse_failed(checks: list[tuple[bool, str]]) -> None:
    """Raise the first failed check's message: a dataclass's __post_init__ lists its rules as
    (holds, message) pairs and hands them here."""
    for ok, message in checks:
        if not ok:
            raise PipelineError(message)
