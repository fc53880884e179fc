"""Settings from TOML files and flags, merged in one order: the defaults < a preset < the file
(`--config`, else ./extract.toml or ./train.toml where present) < the flags given.

A flat config (ExtractConfig) is one table, `[extract]` (or top-level keys). A composed config
(TrainConfig) is a table a component: `[train.optimizer]`, `[train.data]`... (or top-level
`[optimizer]`...). Its older flat form, every key directly under `[train]`, still loads: each key
is moved into its component's table and one line says where it went, so a user's train.toml keeps
working and learns the new key. Unknown keys are refused naming the file, the table and the key.
Relative paths in a file are relative to the file, not to where the command runs.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from pathlib import Path

from pipeline.config.fields import EMBEDDED
from pipeline.errors import PipelineError

# The settings that name a file or directory, resolved against the file that holds them.
PATH_KEYS = ("target", "cache", "out")


def read_toml(path: Path | None, section: str | None) -> dict:
    """The `[section]` table of a TOML file (or its top-level keys; all of it with section None);
    {} without a file."""
    if path is None:
        return {}
    if not path.is_file():
        raise PipelineError(f"{path}: config file not found")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise PipelineError(f"{path}: invalid TOML ({e})") from None
    return raw if section is None else raw.get(section, raw)


def _relative_to_file(values: dict, path: Path) -> dict:
    values = dict(values)
    for key in PATH_KEYS:
        text = values.get(key)
        if isinstance(text, str) and text != EMBEDDED and not text.startswith("embedded:") and not Path(text).is_absolute():
            values[key] = str((path.parent / text).resolve())
    if isinstance(values.get("data"), str):
        values["data"] = [values["data"]]
    if isinstance(values.get("data"), list):
        values["data"] = [d if d.startswith("embedded:") or Path(d).is_absolute() else str((path.parent / d).resolve())
                          for d in values["data"]]
    return values


# --- flat configs ------------------------------------------------------------------------------

def read_config_file(cls, path: Path | None, *, section: str) -> dict:
    """A flat config's `[section]` table, unknown keys refused, relative paths made relative to the file."""
    values = read_toml(path, section)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise PipelineError(f"{path}: unknown key(s) {', '.join(unknown)} in [{section}]")
    return _relative_to_file(values, path) if path is not None else values


def load_config(cls, path: Path | None, overrides: dict, *, section: str, base: dict | None = None):
    """A flat config from `base` (a preset), then TOML `[section]` at `path`, then non-None `overrides`."""
    values = {**(base or {}), **read_config_file(cls, path, section=section)}
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return cls(**values)
    except TypeError as e:
        raise PipelineError(f"{path or 'options'}: {e}") from None


# --- composed configs --------------------------------------------------------------------------

def components(cls) -> dict[str, type]:
    """{table name: component class} of a composed config."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def owners(cls) -> dict[str, str]:
    """{setting: the table that holds it}; a setting's name is unique across the components."""
    return {f.name: table for table, part in components(cls).items() for f in dataclasses.fields(part)}


def tables_of(cls, values: dict, *, where: str, section: str | None = None, note=None) -> dict[str, dict]:
    """{table: {setting: value}} from a file's `[section]` or a preset's tables (section None: they
    stand at the top); a flat key (the old form) is moved to its table and reported through
    `note` in one line. `where` names the file or preset in errors."""
    parts, owner = components(cls), owners(cls)

    def table(name: str) -> str:
        return f"[{section}.{name}]" if section else f"[{name}]"

    tables: dict[str, dict] = {name: {} for name in parts}
    moved = []
    for key, value in values.items():
        if key in parts and isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(parts[key])})
            if unknown:
                hint = "; ".join(f"{k} belongs in {table(owner[k])}" for k in unknown if k in owner)
                raise PipelineError(f"{where}: unknown key(s) {', '.join(unknown)} in {table(key)}"
                                    + (f" ({hint})" if hint else ""))
            clash = sorted(set(value) & set(tables[key]))
            if clash:
                raise PipelineError(f"{where}: {', '.join(clash)} given both flat and in {table(key)}")
            tables[key].update(value)
        elif key in owner:
            if key in tables[owner[key]]:
                raise PipelineError(f"{where}: {key} given both flat and in {table(owner[key])}")
            tables[owner[key]][key] = value
            moved.append(key)
        else:
            raise PipelineError(f"{where}: unknown key(s) {key} in [{section or 'the top level'}]; its tables are "
                                + ", ".join(table(name) for name in parts))
    if moved and note is not None:
        note(f"{where}: flat keys are the older form of [{section or 'the top level'}]; read as "
             + ", ".join(f"{table(owner[k])} {k}" for k in moved) + " (move them there to silence this)")
    return tables


def file_tables(cls, path: Path | None, *, section: str, note=None) -> dict[str, dict]:
    """A composed config's tables from the `[section]` of a TOML file (or its top level, where it
    has no such section), relative paths resolved."""
    if path is None:
        return {}
    raw = read_toml(path, None)
    values, label = (raw[section], section) if isinstance(raw.get(section), dict) else (raw, None)
    tables = tables_of(cls, values, where=str(path), section=label, note=note)
    return {name: _relative_to_file(values, path) for name, values in tables.items()}


def flag_tables(cls, flags: dict) -> dict[str, dict]:
    """Flat flag values ({setting: value}, None for a flag not given) as tables."""
    owner = owners(cls)
    tables: dict[str, dict] = {}
    for key, value in flags.items():
        if value is not None:
            tables.setdefault(owner[key], {})[key] = value
    return tables


def merge_tables(*layers: dict[str, dict]) -> dict[str, dict]:
    """Table layers merged, later layers overriding earlier ones key by key within a table."""
    merged: dict[str, dict] = {}
    for layer in layers:
        for table, values in layer.items():
            merged.setdefault(table, {}).update(values)
    return merged


def build(cls, *layers: dict[str, dict], where: str = "options"):
    """The composed config from table layers (merge_tables' order)."""
    parts = components(cls)
    merged = {table: {} for table in parts} | merge_tables(*layers)
    try:
        return cls(**{table: parts[table](**values) for table, values in merged.items()})
    except TypeError as e:
        raise PipelineError(f"{where}: {e}") from None


def flat_record(recorded: dict, cls) -> dict:
    """A recorded config (dataclasses.asdict of a composed config, or an older run's flat one) as
    {setting: value}."""
    parts = components(cls)
    if any(table in recorded and isinstance(recorded[table], dict) for table in parts):
        return {k: v for table in parts for k, v in recorded.get(table, {}).items()}
    return dict(recorded)
