"""Checkpoints that can be trusted: a manifest written last, verified before any resume or export.

transformers' Trainer writes checkpoint-N file by file; a kill, a full disk or a crashed rank can
leave any subset of them. After every save, rank 0 writes `tuneledger_manifest.json` last: every
file of the checkpoint with its size in bytes. A checkpoint counts only if its manifest exists and
every listed file is there with that size. A checkpoint that fails is never deleted: before a
resume it is renamed to `damaged-checkpoint-N` (outside the Trainer's rotation, which globs
`checkpoint-*`), and the warning names the file that failed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MANIFEST = "tuneledger_manifest.json"
CONFIG = "tuneledger_config.json"  # the run's resolved config (settings check on resume)
DATA = "tuneledger_data.json"  # sha256 of every data file the checkpoint was trained on
# What a resume needs besides the RNG state: adapter, optimizer, scheduler, step, our settings.
REQUIRED = ("adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "scheduler.pt",
            "trainer_state.json", CONFIG)
DAMAGED_PREFIX = "damaged-"


def step_of(path: Path) -> int | None:
    tail = path.name.removeprefix("checkpoint-")
    return int(tail) if path.name.startswith("checkpoint-") and tail.isdigit() else None


def files_of(ckpt: Path) -> dict[str, int]:
    """{relative path: size in bytes} of every file under `ckpt` but the manifest."""
    return {str(f.relative_to(ckpt)): f.stat().st_size for f in sorted(ckpt.rglob("*"))
            if f.is_file() and f.name != MANIFEST}


def write_manifest(ckpt: Path, step: int) -> None:
    """Seal `ckpt`: list every file and its size, written to a temporary name and renamed, so the
    manifest itself is whole or absent. Raises ValueError naming a REQUIRED file that is missing."""
    files = files_of(ckpt)
    missing = [f for f in REQUIRED if f not in files]
    if missing:
        raise ValueError(f"{ckpt} is missing {', '.join(missing)}; not sealing it")
    tmp = ckpt / (MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"step": step, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt / MANIFEST)


def problem(ckpt: Path) -> str | None:
    """Why `ckpt` cannot be resumed from, naming the file (None: it verifies)."""
    ckpt = Path(ckpt)
    manifest = ckpt / MANIFEST
    if not manifest.is_file():
        return (f"{manifest} is missing: the save did not finish (killed or disk full during it), or the "
                "checkpoint was written before tuneledger sealed checkpoints")
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"{manifest} is unreadable ({e})"
    for name, size in files.items():
        f = ckpt / name
        if not f.is_file():
            return f"{f} is missing"
        got = f.stat().st_size
        if got != size:
            return f"{f} has {got:,} bytes, the manifest says {size:,} (truncated or rewritten)"
    for name in REQUIRED:
        if name not in files:
            return f"{ckpt / name} is not in the manifest"
    return None


def scan(out_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(newest checkpoint-N that verifies, [(newer or older checkpoint that does not, why)])."""
    found = sorted((p for p in Path(out_dir).glob("checkpoint-*") if p.is_dir() and step_of(p) is not None),
                   key=step_of, reverse=True)
    good, bad = None, []
    for p in found:
        why = problem(p)
        if why:
            bad.append((p, why))
        elif good is None:
            good = p
    return good, bad


def set_aside(bad: list[tuple[Path, str]]) -> list[Path]:
    """Rename each damaged checkpoint-N to damaged-checkpoint-N (never deleted: a person decides).
    The resumed run would otherwise write over it at step N, or the Trainer's rotation delete it."""
    moved = []
    for p, _ in bad:
        dest = p.with_name(DAMAGED_PREFIX + p.name)
        n = 1
        while dest.exists():
            dest, n = p.with_name(f"{DAMAGED_PREFIX}{p.name}.{n}"), n + 1
        p.rename(dest)
        moved.append(dest)
    return moved


def size_of(ckpt: Path) -> int:
    """Bytes of one checkpoint on disk (every file, the manifest included)."""
    return sum(f.stat().st_size for f in Path(ckpt).rglob("*") if f.is_file())
