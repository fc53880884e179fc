"""Typed JSON records: frozen dataclasses read from parsed JSON field by field, and written back.

`parse_record` checks every field's type against its annotation (errors name the dotted field
path) and builds the dataclass; `dump_record` is its inverse. A field may be stored under another
JSON key (`stored_as`), carry a human name for messages (`label`), or be kept out of the JSON
(metadata stored=False); unknown keys are an error, or kept in a record's `extra` where it has one.

The one record mechanism of the pipeline, on the records' floor so that every package may use it.
The cache manifest and its identity (pipeline/cache/manifest.py, identity.py) are read with
`parse_record` because they are untrusted input: nothing is built from a value before its type is
checked. run.json and verify-cache's result are written with `dump_record` (the train log, eval's
result and the verdicts keep writers of their own, which order and round their fields); the run
files' readers stay tolerant by design (older files, keys a newer pipeline added, values kept as written), which
this strict reader is not.
"""

from __future__ import annotations

import functools
import types
import typing
from dataclasses import MISSING, field, fields, is_dataclass
from typing import Any


def stored_as(name: str) -> Any:
    """A field stored under another JSON key than its attribute name."""
    return field(metadata={"key": name})


def label(text: str, **kwargs) -> Any:
    """A field with a human name for messages (defaults: the dotted field path)."""
    return field(metadata={"label": text}, **kwargs)


# Resolved once per record class: a manifest has a record per shard, and resolving the
# (string) annotations is the costly part of parsing one.
type_hints = functools.cache(typing.get_type_hints)


class RecordFieldError(Exception):
    """A field of a record is missing, unknown or of the wrong type (the message names it)."""


def _kind(tp: Any) -> str:
    return {int: "an integer", str: "a string", float: "a number", bool: "true or false", dict: "a mapping",
            list: "a list"}.get(typing.get_origin(tp) or tp, str(tp))


def parse_record(tp: Any, value: Any, where: str) -> Any:
    """`value` (parsed JSON) checked against type `tp`; dataclasses built field by field. `where`
    is the dotted path so far, ending with '.'."""
    name = where.rstrip(".") or "record"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return parse_record(inner, value, where)
    if tp is Any:
        return value
    if is_dataclass(tp):
        if not isinstance(value, dict):
            raise RecordFieldError(f"field '{name}' must be a mapping, got {type(value).__name__}")
        hints, kwargs, known = type_hints(tp), {}, set()
        for f in fields(tp):
            if f.name == "extra" or f.metadata.get("stored") is False:
                continue
            json_key = f.metadata.get("key", f.name)
            known.add(json_key)
            if json_key not in value:
                if f.default is MISSING and f.default_factory is MISSING:
                    raise RecordFieldError(f"field '{where}{json_key}' is missing")
                continue
            kwargs[f.name] = parse_record(hints[f.name], value[json_key], f"{where}{json_key}.")
        unknown = {k: v for k, v in value.items() if k not in known}
        if "extra" in hints:
            kwargs["extra"] = unknown
        elif unknown:
            raise RecordFieldError(f"field '{where}{sorted(unknown)[0]}' is not known to this version")
        return tp(**kwargs)
    if origin is list or tp is list:
        if not isinstance(value, list):
            raise RecordFieldError(f"field '{name}' must be a list, got {type(value).__name__}")
        return [parse_record(args[0], v, f"{where}{i}.") for i, v in enumerate(value)] if args else value
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise RecordFieldError(f"field '{name}' must be a mapping, got {type(value).__name__}")
        return {k: parse_record(args[1], v, f"{where}{k}.") for k, v in value.items()} if args else value
    ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str), bool: lambda v: isinstance(v, bool)}[tp]
    if not ok(value):
        raise RecordFieldError(f"field '{name}' must be {_kind(tp)}, got {type(value).__name__}")
    return value


def dump_record(value: Any) -> Any:
    """The JSON form of a record (inverse of `parse_record`)."""
    if is_dataclass(value):
        out = {}
        for f in fields(value):
            if f.name == "extra" or f.metadata.get("stored") is False:
                continue
            out[f.metadata.get("key", f.name)] = dump_record(getattr(value, f.name))
        return {**out, **getattr(value, "extra", {})}
    if isinstance(value, dict):
        return {k: dump_record(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [dump_record(v) for v in value]
    return value


def flatten(value: dict, prefix: str = "") -> dict[str, Any]:
    """{dotted key path: value} of nested mappings (an empty mapping stays a value)."""
    out = {}
    for k, v in value.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
