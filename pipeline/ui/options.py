"""A command's options declared once, as the fields of a dataclass: each field declared with
`pipeline.config.option(...)` becomes `--NAME` with the field's type, default and help (torchtitan's
JobConfig and the `hf` CLI do the same from their dataclasses; fastapi from its parameters).

`command(Options)` turns `def run(options: Options)` into a typer command: the function receives
one `Options` built from what was given, defaults from the dataclass. `command(Options,
config=Config)` adds the option fields of a TOML-backed config (ExtractConfig, TrainConfig), handed
over as `overrides`: the values given, None for those left out (the TOML file or the preset decides
them, pipeline/config/tables.py). A composed config (TrainConfig) gives its components' fields, flat.

An option block several commands share (stages/options.py: --seed, --device, --shards...) has one
help for all of them; a command where the option means something of its own says what in its
class's `OWN_HELP` ({field name: help}), which --help shows instead.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from pathlib import Path
from typing import Annotated, Optional

import typer

_PLAIN = (str, int, float, Path)
_LISTS = (list[str], list[Path])


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _without_none(hint):
    """`int | None` -> int; other hints unchanged."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _default_of(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _shown(value) -> str:
    """A parsed default as the text that would give it ([16, 64] -> '16,64')."""
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def help_of(cls, f: dataclasses.Field) -> str:
    """The field's help as `cls`'s command shows it: the command's own wording (OWN_HELP) of an
    option it shares with others, else the help the field was declared with."""
    return getattr(cls, "OWN_HELP", {}).get(f.name, f.metadata["help"])


def _check_own_help(cls, fields: list[dataclasses.Field]) -> None:
    """OWN_HELP names options of the class: a misspelt name would leave the shared help silently."""
    unknown = sorted(set(getattr(cls, "OWN_HELP", {})) - {f.name for f in fields})
    if unknown:
        raise TypeError(f"{cls.__name__}.OWN_HELP: {', '.join(unknown)} is not one of its options")


def _parameter(cls, f: dataclasses.Field, hint, *, overrides: bool) -> inspect.Parameter:
    """The typer parameter of one field: as an override (default None: not given) or as a value
    (the field's default, or required where the field has none)."""
    flag, kind, parse, help_text = flag_of(f), _without_none(hint), f.metadata["parse"], help_of(cls, f)
    decls: tuple[str, ...] = ()
    default = None if overrides else _default_of(f)
    if parse is not None:
        kind = str                               # the field parses the option's text itself
        if default is not None and default is not dataclasses.MISSING:
            default = _shown(default)            # the text that gives the field's default
    elif kind is bool:
        one_flag = f.default is False and not f.metadata.get("negatable")
        decls = (flag,) if one_flag else (f"{flag}/--no-{flag[2:]}",)
    elif kind not in _PLAIN and kind not in _LISTS:
        raise TypeError(f"{cls.__name__}.{f.name}: a {hint} option needs option(..., parse=...)")
    elif f.metadata.get("flag"):
        decls = (flag,)
    if f.metadata.get("argument"):
        marker = typer.Argument(help=help_text, show_default=default not in (None, dataclasses.MISSING))
    else:
        marker = typer.Option(*decls, help=help_text, metavar=f.metadata.get("metavar"))
    annotation = Annotated[Optional[kind] if default is None else kind, marker]
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                             default=inspect.Parameter.empty if default is dataclasses.MISSING else default)


def option_fields(cls) -> list[dataclasses.Field]:
    """The fields of `cls` that are command-line options, in declaration order; a composed config
    (TrainConfig) gives its components' options, flat: each setting's flag is its own name."""
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        if "help" in f.metadata:
            fields.append(f)
        elif dataclasses.is_dataclass(hints[f.name]):
            fields += option_fields(hints[f.name])
    return fields


def _hints(cls) -> dict:
    """The type of every option field of `cls`, its components' included."""
    hints = typing.get_type_hints(cls)
    for name, hint in list(hints.items()):
        if dataclasses.is_dataclass(hint):
            hints.update(_hints(hint))
    return hints


def _own_first(cls, fields: list[dataclasses.Field]) -> list[dataclasses.Field]:
    """The class's own options before those of the blocks it inherits (--json, --device...), so
    --help opens with what the command is about."""
    own = set(cls.__dict__.get("__annotations__", {}))
    return [f for f in fields if f.name in own] + [f for f in fields if f.name not in own]


def _parsed(f: dataclasses.Field, value):
    parse = f.metadata["parse"]
    return parse(value, flag_of(f)) if value is not None and parse is not None else value


def command(options_cls, *, config=None):
    """Decorator: a typer command from `def run(options)` (or `def run(options, overrides)` with
    `config`), its parameters derived from the dataclasses' option fields."""
    own = _own_first(options_cls, option_fields(options_cls))
    _check_own_help(options_cls, own)
    from_config = option_fields(config) if config is not None else []
    clash = sorted({f.name for f in own} & {f.name for f in from_config})
    if clash:
        raise TypeError(f"{options_cls.__name__}: {', '.join(clash)} is declared by {config.__name__} already")
    hints = {**(_hints(config) if config is not None else {}), **typing.get_type_hints(options_cls)}
    parameters = ([_parameter(config, f, hints[f.name], overrides=True) for f in from_config]
                  + [_parameter(options_cls, f, hints[f.name], overrides=False) for f in own])

    def decorate(run):
        @functools.wraps(run)
        def with_options(**given):
            overrides = {f.name: _parsed(f, given.pop(f.name)) for f in from_config}
            values = {}
            for f in own:
                value = given.pop(f.name)
                if value is None and f.metadata["parse"] is not None:
                    continue                     # not given: the field's own default
                values[f.name] = _parsed(f, value)
            options = options_cls(**values)
            return run(options, overrides) if config is not None else run(options)

        with_options.__signature__ = inspect.Signature(parameters, return_annotation=None)
        with_options.__annotations__ = {p.name: p.annotation for p in parameters}
        del with_options.__wrapped__             # typer must read the signature above, not the function's
        return with_options
    return decorate
