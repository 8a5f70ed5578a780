"""Counts said in words: '1 checkpoint', '2 checkpoints' (never a maybe-plural in parentheses), and counts
read from the command line (count_at_least). A leaf module: every layer (config, data, the verbs, the
monitor) may use it."""

from __future__ import annotations


def plural(n: int, word: str, many: str | None = None) -> str:
    """'1 checkpoint', '2 checkpoints', '1,024 records'; `many` for another plural ('process',
    'processes')."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"


def count_at_least(low: int):
    """An argparse `type` for a count option (ranks, records, tokens, steps): an integer of at least
    `low`, else argparse's one-line usage error naming the option (exit 2). A count of 0 or -1 that
    an option passed on as "unset" or "one" was a silent wrong answer (preflight --nproc -1)."""
    import argparse

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {n}")
        return n
    parse.__name__ = "count"  # argparse names the type in some messages
    parse.least = low  # type: ignore[attr-defined]
    return parse
