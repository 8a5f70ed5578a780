"""File modes of what we write: the user's umask, as for any file they create.

safetensors (0.8) writes through a private temporary file and keeps its mode 0600 whatever the
umask, so an export or checkpoint shared through a group-readable folder could not be read by
the group. `apply_umask` gives such a tree the modes a plain `open()` would have given it.
"""

from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def apply_umask(root: str | Path) -> None:
    """Set every regular file under `root` to 0666 & ~umask and every directory to 0777 & ~umask."""
    root = Path(root)
    mask = current_umask()
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        if path.is_dir():
            path.chmod(0o777 & ~mask)
        elif path.is_file():
            path.chmod(0o666 & ~mask)
