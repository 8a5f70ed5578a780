"""The CUDA caching allocator's settings the ranks get, read the same way by the launcher (which
sets them) and by profile_step (which says whether a step's allocator history will be recorded).

torch reads its settings from PYTORCH_CUDA_ALLOC_CONF; torch 2.8 added the name PYTORCH_ALLOC_CONF
and reads it first, but the pinned image's torch 2.5.1 reads only the old name (and 2.9.1 ignored
CUDA options under the new one, pytorch#183387). So the ranks get one value under both names, and
every torch version reads the same thing. An empty value counts as unset (an empty
PYTORCH_ALLOC_CONF would otherwise shadow the old name on torch >= 2.8 and set nothing).
"""

from __future__ import annotations

from collections.abc import Mapping

OLD, NEW = "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"
# Packed and padded micro-batches vary in shape: the caching allocator fragments (preset D held
# 69 GiB allocated in 138 GiB reserved) and then frees and retries, a stall of seconds.
DEFAULT = "expandable_segments:True"
# Why TUNELEDGER_MEMORY_STEP records nothing: the launcher's and the ranks' words
NO_CUDA, ASYNC = "no CUDA GPU here", "the allocator is cudaMallocAsync, which keeps none"


def rank_conf(environ: Mapping[str, str]) -> tuple[str, str | None]:
    """(the allocator settings the ranks get under both names, a note to print or None). The old
    name's value wins where both are set and differ (what torch 2.5.1 reads; the note says so);
    neither set (or both empty): DEFAULT."""
    old, new = environ.get(OLD, "").strip(), environ.get(NEW, "").strip()
    if old and new and old.replace(" ", "") != new.replace(" ", ""):
        return old, (f"note: {NEW}={new!r} and {OLD}={old!r} differ, and torch versions disagree on which "
                     f"they read: the ranks get {old!r} under both names (set one of them to silence this)")
    return old or new or DEFAULT, None


_said: set[str] = set()


def apply(env: dict[str, str]) -> str | None:
    """Put rank_conf(env)'s value into `env` under both names; return its note, the first time this
    process meets it (a dry-run launches once per preset: said once), else None."""
    value, note = rank_conf(env)
    env[OLD] = env[NEW] = value
    if note in _said:
        return None
    if note:
        _said.add(note)
    return note


def keeps_history(environ: Mapping[str, str]) -> bool:
    """False where the ranks' allocator will be cudaMallocAsync, which keeps no history for
    TUNELEDGER_MEMORY_STEP (memory_step.py)."""
    return "backend:cudamallocasync" not in rank_conf(environ)[0].replace(" ", "").lower()
