"""Printing a rich table: the terminal's own width and colour on a terminal; off one (a pipe, a
log file) `width` columns, no colour codes and no trailing blanks (rich pads every line, a title's
too, to the table's width). A leaf module: any verb may use it."""

from __future__ import annotations

import sys
from typing import Any, TextIO


def print_table(renderable: Any, file: TextIO | None = None, width: int = 100) -> None:
    """Prints `renderable` to `file` (default: sys.stdout); `width` in columns, off a terminal only."""
    from rich.console import Console

    file = file or sys.stdout
    if getattr(file, "isatty", lambda: False)():
        Console(file=file).print(renderable)
        return
    console = Console(width=width, color_system=None, file=file)
    with console.capture() as cap:
        console.print(renderable)
    file.write("".join(line.rstrip() + "\n" for line in cap.get().splitlines()))
    file.flush()
