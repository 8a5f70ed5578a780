"""The tokenized cache's seal: a content hash of every file, written with it, checked before use.

A bit flipped in the cache's token ids would train on other tokens, and `stats` would report a
hit with the old numbers; one flipped in its labels fails inside the loss (`Target -99 is out of
bounds`) naming nothing. So `seal` hashes every file of the saved dataset and the report beside
it (xxh3-128 from xxhash, a dependency of datasets; blake2b-128 from hashlib without it), and
`check` hashes them again and then reads the ids and labels once (every id in 0..vocab-1, every
label -100 or an id), before a cache counts as a hit. Cost, measured on a 267,259-token cache
(1,479 alpaca records, 3.3 MB of Arrow, page cache warm, one core, best of 5): xxh3-128 0.4 ms
(sha256 would be 2.2 ms, blake2b 3.8 ms), the id/label range check 3.9 ms (memory-mapped load
included), so the whole check is about 4 ms of a hit's 0.36 s prepare().
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

META = "tuneledger.json"

try:
    import xxhash

    ALGO = "xxh3_128"

    def _hasher() -> Any:
        return xxhash.xxh3_128()
except ImportError:  # pragma: no cover - datasets depends on xxhash
    import hashlib

    ALGO = "blake2b_128"

    def _hasher() -> Any:
        return hashlib.blake2b(digest_size=16)


def _digest(path: Path) -> str:
    h = _hasher()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _meta_digest(report: dict, invalid: list) -> str:
    h = _hasher()
    h.update(json.dumps([report, invalid], sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()


def seal(folder: Path, report: dict, invalid: list[dict]) -> dict:
    """The seal of a saved dataset in `folder` (every file but META) and of its report and
    invalid list: {"algo": str, "files": {name: hex digest}, "meta": hex digest}."""
    files = {p.name: _digest(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != META}
    return {"algo": ALGO, "files": files, "meta": _meta_digest(report, invalid)}


def check(folder: Path, vocab_size: int) -> tuple[dict | None, str]:
    """(META's content, "") when the cache in `folder` is whole, else (None, what is damaged).

    The reason names the file: a file whose hash differs from its seal, a file missing or added,
    a META that is not JSON or has no seal, then ids or labels out of range (0..vocab_size-1;
    labels also -100): damage that kept the hash, or a cache written by other code.
    """
    meta = folder / META
    try:
        saved = json.loads(meta.read_text(encoding="utf-8"))
        sealed, report, invalid = saved["seal"], saved["report"], saved["invalid"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"{meta} cannot be read or has no seal ({type(e).__name__})"
    if sealed.get("algo") != ALGO:
        return None, f"{meta} is sealed with {sealed.get('algo')!r}, this install hashes with {ALGO}"
    if _meta_digest(report, invalid) != sealed.get("meta"):
        return None, f"{meta}: the report's hash differs from its seal"
    names = {p.name for p in folder.iterdir() if p.is_file() and p.name != META}
    for name in sorted(names | set(sealed["files"])):
        if name not in names:
            return None, f"{folder / name} is missing"
        if name not in sealed["files"]:
            return None, f"{folder / name} is not in the seal"
        if _digest(folder / name) != sealed["files"][name]:
            return None, f"{folder / name}: content hash differs from the seal written with it"
    bad = out_of_range(folder, vocab_size)
    return (None, bad) if bad else (saved, "")


def out_of_range(folder: Path, vocab_size: int) -> str:
    """Why the ids or labels of the saved dataset in `folder` cannot be trained on with a vocabulary
    of `vocab_size`, or "": an id outside 0..vocab_size-1, a label neither -100 nor such an id."""
    import datasets
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        ds = datasets.load_from_disk(str(folder))  # as the ranks load it: memory-mapped, nothing read yet
        files = [Path(f["filename"]) for f in ds.cache_files]
        if not len(ds) or "input_ids" not in ds.column_names:
            return ""
        # Read batch by batch (read(2), not the memory map): the pages read are the kernel's cache,
        # not this process's memory, so a hit at 800 MB of data stays as small as one at 8.
        ids_lo = ids_hi = lab_lo = lab_hi = None
        for f in files:
            with pa.OSFile(str(f)) as source:
                for batch in pa.ipc.open_stream(source):
                    lo, hi = pc.min_max(pc.list_flatten(batch.column("input_ids"))).values()
                    if lo.is_valid:
                        ids_lo = lo.as_py() if ids_lo is None else min(ids_lo, lo.as_py())
                        ids_hi = hi.as_py() if ids_hi is None else max(ids_hi, hi.as_py())
                    labels = pc.list_flatten(batch.column("labels"))
                    lo, hi = pc.min_max(pc.filter(labels, pc.not_equal(labels, -100))).values()
                    if lo.is_valid:
                        lab_lo = lo.as_py() if lab_lo is None else min(lab_lo, lo.as_py())
                        lab_hi = hi.as_py() if lab_hi is None else max(lab_hi, hi.as_py())
    except Exception as e:  # a damaged Arrow file
        return f"{folder}: cannot be loaded ({type(e).__name__}: {str(e)[:200]})"
    if ids_lo is not None and (ids_lo < 0 or ids_hi >= vocab_size):
        return f"{folder}: input_ids hold {ids_lo if ids_lo < 0 else ids_hi}, outside 0..{vocab_size - 1}"
    if lab_lo is not None and (lab_lo < 0 or lab_hi >= vocab_size):
        return (f"{folder}: labels hold {lab_lo if lab_lo < 0 else lab_hi}, neither -100 nor an id "
                f"in 0..{vocab_size - 1}")
    return ""


def save(ds: Any, path: Path, report: dict, invalid: list[dict], workers: int | None = None,
         shard: str | None = None) -> None:
    """Save `ds` (a datasets.Dataset) and META (report, invalid, seal) as the cache `path`.
    `workers` (datasets' save_to_disk num_proc): copy in that many spawned processes, in Arrow
    files of at most `shard` ("256MB"), so the pages copied are never this process's memory.

    Written in a folder of its own (two runs, or a multi-node job's launchers, may build the same
    key at once) and renamed into place whole; the first to finish wins and the others drop their
    copy. Raises OSError when the folder cannot be written."""
    import os
    import shutil
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{path.name}.tmp-"))
    try:
        ds.save_to_disk(str(tmp), num_proc=workers, max_shard_size=shard if workers else None)
        meta = {"report": report, "invalid": invalid, "seal": seal(tmp, report, invalid)}
        (tmp / META).write_text(json.dumps(meta, ensure_ascii=False), encoding="utf-8")
        os.rename(tmp, path)  # atomic; fails if another process put its copy there first
    except OSError:
        if not (path / META).is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # ours, if another process won the race


def set_aside(path: Path) -> Path:
    """Move a damaged cache out of the way (kept, for a look at what was damaged); its new path."""
    import os
    import time

    aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:  # another process set it aside first
        pass
    return aside
