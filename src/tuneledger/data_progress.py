"""Progress of a long data preparation on stderr: records/s, tokens/s and an ETA, per phase.

On a terminal the line is redrawn in place about once a second. Anywhere else (a log, a pipe) a
whole line is written every EVERY_S seconds, so a log gets lines, never a smear of carriage
returns. A phase that ends within its first EVERY_S seconds prints nothing (small data stays
quiet); one that printed ends with a line saying what it did in how long.

The tokenizing phase runs in datasets' map workers, which are other processes: each adds its
records and tokens to its own slot of a small file (`count`, one writer per slot, so no lock),
and a thread here reads the sum (`Meter.watch`). A file works the same with fork and spawn.
"""

from __future__ import annotations

import os
import struct
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, TextIO

EVERY_S = 5.0  # between lines when stderr is not a terminal, and before the first line at all
TTY_EVERY_S = 1.0
SLOT = struct.Struct("<qq")  # records, tokens
_done: dict[tuple[str, int], list[int]] = {}  # this process's totals per (counts file, slot)


def duration(seconds: float) -> str:
    """'45 s', '3 min 07 s', '1 h 05 min'."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    h, rem = divmod(s, 3600)
    return f"{h} h {rem // 60:02d} min" if h else f"{rem // 60} min {rem % 60:02d} s"


def _si(n: float) -> str:
    return f"{n / 1e6:,.2f}M" if n >= 1e6 else f"{n:,.0f}"


class Meter:
    """One phase's progress. `total` is what `done` counts up to: bytes (unit "MB") or records
    (unit "records"). `update` is cheap enough to call per record; it prints only when due."""

    def __init__(self, what: str, total: float, unit: str = "records", enabled: bool = True,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        self.what, self.total, self.unit, self.enabled = what, total, unit, enabled
        self.stream = stream or sys.stderr
        self.clock = clock
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = clock()
        self.next = self.t0 + EVERY_S
        self.printed = False
        self.last = (0.0, 0, None)

    def update(self, done: float, records: int, tokens: int | None = None) -> None:
        """`done` of `total` so far, with `records` records and `tokens` tokens (None: the phase
        does not count tokens) done."""
        self.last = (done, records, tokens)
        if not self.enabled or not done:  # nothing done yet: nothing to estimate from
            return
        now = self.clock()
        if now < self.next:
            return
        self.next = now + (TTY_EVERY_S if self.tty else EVERY_S)
        self._write(self.line(now), final=False)

    def line(self, now: float) -> str:
        done, records, tokens = self.last
        took = max(now - self.t0, 1e-9)
        if self.unit == "MB":
            amount = f"{done / 1e6:,.0f} of {self.total / 1e6:,.0f} MB"
        else:
            amount = f"{done:,.0f} of {self.total:,.0f} records"
        pct = f" ({100 * done / self.total:.0f}%)" if self.total else ""
        rates = f"{records / took:,.0f} records/s" + (f", {_si(tokens / took)} tokens/s" if tokens is not None else "")
        eta = duration(took * (self.total - done) / done) if done else "?"
        return f"{self.what}: {amount}{pct}, {rates}, ETA {eta}"

    def _write(self, text: str, final: bool) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self.printed = True

    def close(self, records: int, tokens: int | None = None) -> None:
        """The phase's last line (only when it printed before): what it did, in how long."""
        if not (self.enabled and self.printed):
            return
        took = max(self.clock() - self.t0, 1e-9)
        rates = f"{records:,} records ({records / took:,.0f}/s)"
        if tokens is not None:
            rates += f", {tokens:,} tokens ({_si(tokens / took)}/s)"
        self._write(f"{self.what}: done in {duration(took)}: {rates}", final=True)

    @contextmanager
    def watch(self, counts: "Counts", every_s: float = 0.5) -> Iterator[None]:
        """Update from `counts` (records, tokens) on a thread while the block runs (a map whose
        workers `count`), then close with the last sum."""
        stop = threading.Event()

        def poll() -> None:
            while not stop.wait(every_s):
                r, t = counts.read()
                self.update(r, r, t)

        thread = threading.Thread(target=poll, name="data-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
        r, t = counts.read()
        self.last = (r, r, t)
        self.close(r, t)


class Counts:
    """Records and tokens done, one slot per worker, in the file `path` (made here, zeroed)."""

    def __init__(self, path: Path, slots: int):
        self.path = path
        path.write_bytes(bytes(SLOT.size * slots))

    def read(self) -> tuple[int, int]:
        raw = self.path.read_bytes()
        pairs = [SLOT.unpack_from(raw, i) for i in range(0, len(raw) - SLOT.size + 1, SLOT.size)]
        return sum(p[0] for p in pairs), sum(p[1] for p in pairs)


def count(path: str, slot: int, records: int, tokens: int) -> None:
    """Add to this process's slot of a Counts file (called in a map worker, per batch)."""
    total = _done.setdefault((path, slot), [0, 0])
    total[0] += records
    total[1] += tokens
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, SLOT.pack(*total), SLOT.size * slot)
    finally:
        os.close(fd)
