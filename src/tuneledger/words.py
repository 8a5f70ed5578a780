"""Counts said in words: '1 checkpoint', '2 checkpoints' (never a maybe-plural in parentheses). A leaf module:
every layer (config, data, the verbs, the monitor) may use it."""

from __future__ import annotations


def plural(n: int, word: str, many: str | None = None) -> str:
    """'1 checkpoint', '2 checkpoints', '1,024 records'; `many` for another plural ('process',
    'processes')."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"
