"""Command-line options derived from a config dataclass: each field declared with
`pipeline.config.option(...)` becomes `--NAME` with the field's type and help, so an option is
declared once, as a field (torchtitan's JobConfig does the same from its dataclasses).

A command decorated with `config_options(Cls)` receives the options that were given as one dict,
`overrides` (None for those left out: the TOML file or the preset decides them).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from typing import Annotated, Optional

import typer

_PLAIN = (str, int, float)


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def _without_none(hint):
    """`int | None` -> int; other hints unchanged."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _option_annotation(cls, f: dataclasses.Field, hint):
    """The typer annotation of one field's option."""
    flag, kind = flag_of(f.name), _without_none(hint)
    decls: tuple[str, ...] = ()
    if f.metadata["parse"] is not None:
        kind = str                               # the field parses the option's text itself
    elif kind is bool:
        decls = (flag,) if f.default is False else (f"{flag}/--no-{flag[2:]}",)
    elif kind not in _PLAIN and kind != list[str]:
        raise TypeError(f"{cls.__name__}.{f.name}: a {hint} option needs option(..., parse=...)")
    return Annotated[Optional[kind], typer.Option(*decls, help=f.metadata["help"])]


def option_fields(cls) -> list[dataclasses.Field]:
    """The fields of `cls` that are command-line options, in declaration order."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def config_options(cls):
    """Decorator: add `cls`'s option fields to a typer command, handed to it as `overrides`."""
    hints = typing.get_type_hints(cls)
    fields = option_fields(cls)

    def decorate(command):
        own = inspect.signature(command, eval_str=True).parameters
        if "overrides" not in own:
            raise TypeError(f"{command.__name__}: a command with config options takes `overrides`")
        clash = sorted(set(own) & {f.name for f in fields})
        if clash:
            raise TypeError(f"{command.__name__}: {', '.join(clash)} is declared by {cls.__name__} already")

        @functools.wraps(command)
        def with_overrides(**given):
            overrides = {}
            for f in fields:
                value = given.pop(f.name)
                if value is not None and f.metadata["parse"] is not None:
                    value = f.metadata["parse"](value, flag_of(f.name))
                overrides[f.name] = value
            return command(overrides=overrides, **given)

        derived = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                     annotation=_option_annotation(cls, f, hints[f.name])) for f in fields]
        kept = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for name, p in own.items() if name != "overrides"]
        parameters = derived + kept
        with_overrides.__signature__ = inspect.Signature(parameters, return_annotation=None)
        with_overrides.__annotations__ = {p.name: p.annotation for p in parameters}
        del with_overrides.__wrapped__           # typer must read the signature above, not the command's
        return with_overrides
    return decorate
