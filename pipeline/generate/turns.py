"""What a generation backend is given and gives back, one assistant turn at a time."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Turn:
    """One assistant turn to write: the conversation before it."""
    messages: list[dict]
    tools: list[dict] | None
    template_kwargs: dict | None
    seed: int


@dataclass
class Written:
    message: dict | None      # None: it did not end within max_new_tokens
    tokens: int               # tokens generated
    problem: str | None = None
