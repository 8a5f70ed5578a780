"""Reading the ranks' output as the launcher passes it on: the one-line cause of a failed run
(FailureReader) and torchrun's own traceback after a stop signal shown as one line (StopTraceback)."""

from __future__ import annotations

import re
from pathlib import Path

# The last line of a Python traceback, with or without torchrun's "[rankN]: " prefix.
ROOT_CAUSE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_][\w.]*)?(?:Error|Exception)\b:.*)$")
# torchrun's failure summary: "  rank      : 1 (local_rank: 1)" ... "  traceback : Signal 9 (SIGKILL) received by PID 7".
FAILED_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank")
RANK_SIGNAL = re.compile(r"Signal (\d+) \((\w+)\) received by PID")


class FailureReader:
    """Reads the launcher's output line by line and keeps what caused a failure, once: the last line
    of each distinct traceback, and first of all a rank that died of a signal (torchrun's summary
    says "rank : 1 (local_rank: 1)" ... "Signal 9 (SIGKILL) received by PID"), since the other ranks'
    errors (a lost connection, a timeout) only follow from it."""

    WHY = {"SIGKILL": "the kernel's out-of-memory killer (see `dmesg`) or a kill -9",
           "SIGSEGV": "a crash in native code (a CUDA or library fault)",
           "SIGBUS": "a bus error: often a full /dev/shm (docker run --shm-size, or ipc: host)"}

    def __init__(self) -> None:
        self.killed: dict[str, None] = {}
        self.errors: dict[str, None] = {}
        self.signals: set[str] = set()  # the signals the killed ranks died of (SIGKILL, SIGTERM, ...)
        self._rank = "?"

    def feed(self, line: str) -> None:
        cause = ROOT_CAUSE.match(line)
        if cause and "ChildFailedError" not in line:
            self.errors[cause.group(1).strip()] = None
        rank, sig = FAILED_RANK.match(line), RANK_SIGNAL.search(line)
        if rank:
            self._rank = rank.group(1)
        if sig:
            num, name = sig.groups()
            self.signals.add(name)
            self.killed[f"rank {self._rank} was killed by {name} (signal {num}): {self.WHY.get(name, 'a signal')}; "
                        "the other ranks' errors follow from it"] = None

    def causes(self) -> list[str]:
        """At most 4 lines: the killed ranks, then the last 3 distinct errors."""
        return [*self.killed, *list(self.errors)[-3:]][:4]


class StopTraceback:
    """What the terminal shows of the ranks' output once a stop signal was passed on: torchrun answers
    it with its own `SignalException` traceback, which says nothing the launcher's last line does not;
    that traceback becomes one line (the log keeps it whole). Every other traceback is shown."""

    def __init__(self, log_path: Path | None):
        self.where = f" (its traceback is in {log_path})" if log_path else ""
        self.held: list[str] = []

    def shown(self, line: str, stop_signal: str | None) -> str:
        """The text to show for `line` ("" while a traceback is held); `stop_signal`: the signal's
        name once one was passed on, else None. shown("", None) gives back what is still held."""
        if not (self.held or (stop_signal and line.startswith("Traceback (most recent call last)"))):
            return line
        if not line:
            text, self.held = "".join(self.held), []
            return text
        self.held.append(line)
        if not ROOT_CAUSE.match(line):
            return ""
        text, self.held = "".join(self.held), []
        if "SignalException" in line:
            return f"launch: torchrun stopped by the {stop_signal} passed on to it{self.where}\n"
        return text


class FailureTable:
    """What the terminal shows of torchrun's table of failed ranks (tuneledger.torchrun prints it
    after "torchrun: ChildFailedError:", between two rules of '='): one line pointing at the log,
    which keeps it whole. The launcher's own last lines say which rank failed and why
    (FailureReader), so the 20 lines say nothing more there. Without a log it is shown."""

    def __init__(self, log_path: Path | None):
        self.log_path = log_path
        self.held: list[str] | None = None

    def shown(self, line: str) -> str:
        """The text to show for `line` ("" while the table is held); shown("") gives back what is
        still held (a table cut short)."""
        if self.held is None:
            if self.log_path and line.startswith("torchrun: ChildFailedError"):
                self.held = [line]
                return ""
            return line
        if not line:
            text, self.held = "".join(self.held), None
            return text
        self.held.append(line)
        if sum(held.startswith("====") for held in self.held) < 2:
            return ""
        self.held = None
        return f"launch: torchrun's table of the failed ranks is in {self.log_path}\n"
