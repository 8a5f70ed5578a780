"""Replacing a whole directory so that it always holds one whole version (the export, the INT4 model).

`atomic_dir(out)` yields an empty `<out>.partial` to write into and, on success, swaps it in
whole (`swap_in`); on any failure it is removed and `out` stays as it was. A kill at any instant
leaves one whole version: the swap is one step (RENAME_EXCHANGE, or one rename of a symlink), and
the one gap left (a real folder on a filesystem without the exchange) is undone by `_recover` on
the next call.
"""

from __future__ import annotations

import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    import ctypes
    import os

    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    return False  # EINVAL/ENOSYS: the filesystem cannot; the two-rename swap below is used


def _recover(out: Path) -> None:
    """Finish a swap that a kill interrupted: `<out>.old` without `out` is the whole previous
    export (put back); beside `out` it is the replaced one (removed). Versions `<out>.v*` that
    `out` does not link to are a swap killed before its link moved: removed."""
    old = out.with_name(out.name + ".old")
    if old.exists():
        if out.exists():
            shutil.rmtree(old)
        else:
            old.rename(out)
    current = out.resolve() if out.is_symlink() else None
    for v in out.parent.glob(out.name + ".v*"):
        if v.is_dir() and not v.is_symlink() and v.resolve() != current:
            shutil.rmtree(v, ignore_errors=True)
    out.with_name(out.name + ".link-tmp").unlink(missing_ok=True)


def _can_exchange(parent: Path) -> bool:
    """Whether this filesystem swaps two paths in one step (NFS, some FUSE mounts cannot)."""
    a, b = parent / f".tl-xchg-a-{os.getpid()}", parent / f".tl-xchg-b-{os.getpid()}"
    a.mkdir(exist_ok=True)
    b.mkdir(exist_ok=True)
    try:
        return _exchange(a, b)
    finally:
        a.rmdir()
        b.rmdir()


def _swap_link(new: Path, out: Path) -> None:
    """`out` as a symlink to a versioned directory: the new version gets its own name, then one
    rename moves the link (atomic on every POSIX filesystem), then the old version goes."""
    version = out.with_name(f"{out.name}.v{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
    new.rename(version)
    link = out.with_name(out.name + ".link-tmp")
    link.unlink(missing_ok=True)
    link.symlink_to(version.name)
    previous = out.resolve() if out.is_symlink() else None
    os.replace(link, out)  # until here `out` is the old version, from here the new one
    if previous is not None and previous != version.resolve():
        shutil.rmtree(previous, ignore_errors=True)


def swap_in(new: Path, out: Path) -> None:
    """Put the whole directory `new` at `out`, so that `out` always holds one whole version: an
    atomic exchange where the kernel and filesystem have one; else `out` is a symlink to a
    versioned directory, moved in one rename (_swap_link). The one case left with a moment
    without `out`: a real `out` directory (written before exports became links) on a filesystem
    without the exchange; a kill there is undone by _recover on the next export."""
    if out.is_symlink():
        _swap_link(new, out)
        return
    if not out.exists():
        if _can_exchange(out.parent):
            new.rename(out)
        else:
            _swap_link(new, out)
        return
    if _exchange(new, out):
        shutil.rmtree(new)  # now the previous version
        return
    old = out.with_name(out.name + ".old")
    out.rename(old)
    new.rename(out)
    shutil.rmtree(old)


@contextmanager
def atomic_dir(out: Path) -> Iterator[Path]:
    """Yields an empty `<out>.partial` to write into. On success it replaces `out` whole (swap_in);
    on any failure (an exception, Ctrl-C) it is removed and `out` stays as it was."""
    _recover(out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    swap_in(tmp, out)
