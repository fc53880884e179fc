"""Argument checks the benchmark scripts share: a bad value ends in argparse's usage and one
`error:` line (exit 2), never a traceback."""

from __future__ import annotations

import argparse


def positive_ints(parser: argparse.ArgumentParser, option: str, text: str) -> list[int]:
    """A comma-separated list of integers >= 1, e.g. '16,64'."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        parser.error(f"{option} must be comma-separated positive integers, got {text!r}")
    return values


def at_least_one(parser: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """Each named count (argparse dest) is >= 1."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
