"""Writing the files a run leaves, so that a full disk or a kill mid-write never leaves half of
one where a whole one was (a 0-byte dryrun.json that the next `train` then cannot read), and
telling a full disk apart from other faults (`disk_full`)."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def write_text_atomic(path: Path | str, text: str) -> Path:
    """Write `text` (UTF-8) to `path` through a temporary file beside it, fsync'd, then a rename:
    a reader sees the old file or the new one, never part of either. On any error the temporary
    file is removed and the old file, if any, is left as it was; the error is raised (OSError,
    e.g. ENOSPC)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno and not e.filename:  # a failed write or fsync names no file: name the one meant
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    return path


def disk_full(exc: BaseException | None) -> bool:
    """True if `exc` (or what caused it) is a full disk or quota (ENOSPC, EDQUOT): an OSError, or
    torch's and safetensors' own errors, which carry only the text ("file write failed", "No space
    left on device")."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if says_disk_full(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def says_disk_full(text: str) -> bool:
    """True if `text` (an error's message, or a failed rank's last line as the launcher read it)
    is one of a full disk's: the OS's, torch.save's ("file write failed") or a save's own
    (guards.DiskFullError: "disk full while saving")."""
    return any(s in text for s in ("No space left on device", "file write failed", "Disk quota exceeded",
                                   "disk full while saving"))
