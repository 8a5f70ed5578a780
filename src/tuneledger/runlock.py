"""One training per run directory: an exclusive lock on runs/<run>/run.lock (and one dry-run: dryrun.lock).

The lock is flock(2) on the file, so the kernel releases it when the holder exits, however it
exits (kill -9 included); the file's text (pid, host, start time, command) is only there to name
the holder in the refusal. A file that still has text but no lock was left by a holder that died
before clearing it: a stale lock, taken over with a note. Note: flock works across machines on
NFSv4 and most cluster filesystems; on others, run one job per run directory yourself.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

LOCK_NAME = "run.lock"


class RunLocked(RuntimeError):
    """Another live process holds the run directory's lock. The message names it."""


class RunLock:
    """`with RunLock(out_dir):` holds the lock for the block; raises RunLocked if another holds it."""

    def __init__(self, out_dir: Path, name: str = LOCK_NAME,
                 clash: str = "Two trainings in one run directory overwrite each other's job.json and checkpoints."):
        self.path = Path(out_dir) / name
        self.clash = clash  # what two holders at once would break, for the refusal
        # every folder this lock made (runs/ too, on a fresh clone), innermost first: a start that
        # stops before writing anything removes them again
        self.made: list[Path] = []
        self.fd: int | None = None
        self.stale: dict | None = None  # what a dead holder left, if anything

    def __enter__(self) -> "RunLock":
        self.made = [d for d in [self.path.parent, *self.path.parent.parents] if not d.exists()]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            who = (f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('started')} "
                   f"({holder.get('command')})") if holder else "another process (it has not written its pid yet)"
            raise RunLocked(f"{self.path.parent} is in use by {who}. {self.clash} Wait for it to finish, stop it, "
                            "or use another run_name / output_dir.") from None
        self.stale = _read(fd) or None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                      "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                      "command": " ".join(sys.argv)}).encode(), 0)
        except OSError as e:  # a full disk: name the lock, and release it
            os.close(fd)
            raise OSError(e.errno, e.strerror, str(self.path)) from e
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # empty = released cleanly (text left behind = stale)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            # A start that failed its checks leaves no empty runs/<run>/ behind.
            if self.made and [p.name for p in self.path.parent.iterdir()] == [self.path.name]:
                self.path.unlink(missing_ok=True)
                for d in self.made:  # one that holds something else now stays
                    with contextlib.suppress(OSError):
                        d.rmdir()
            self.fd = None


def _read(fd: int) -> dict:
    raw = os.pread(fd, 4096, 0)
    try:
        return json.loads(raw) if raw.strip() else {}
    except ValueError:
        return {"pid": "?", "host": "?", "started": "?", "command": raw[:200].decode(errors="replace")}
