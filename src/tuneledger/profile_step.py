"""TUNELEDGER_PROFILE_STEP (and TUNELEDGER_MEMORY_STEP's step number), read once by the launcher
(dry-run and train) before any rank starts: a bad value is refused with a sentence instead of a traceback in every rank, a step the run never
reaches is said instead of a silent "no profile", and a profiled step among a dry-run's measured
steps is said, since the profiler's own bookkeeping slows it (profile.py)."""

from __future__ import annotations

import os

from tuneledger.config import ConfigError

ENV = "TUNELEDGER_PROFILE_STEP"
MEMORY_ENV = "TUNELEDGER_MEMORY_STEP"  # memory_step.py: what is live at one step's peak


def requested() -> int | None:
    """The optimizer step (1-based) that $TUNELEDGER_PROFILE_STEP asks to profile, None when unset
    or empty. Raises ConfigError for anything but a whole number >= 1."""
    return step_number(ENV, "the optimizer step to profile")


def memory_requested() -> int | None:
    """The optimizer step (1-based) that $TUNELEDGER_MEMORY_STEP asks to split the peak memory of
    (memory_step.py), None when unset or empty. Raises ConfigError as requested()."""
    return step_number(MEMORY_ENV, "the optimizer step whose peak memory to split")


def step_number(name: str, what: str) -> int | None:
    """$name as an optimizer step (1-based), None when unset or empty (TUNELEDGER_SYNC_DEBUG's too).
    Raises ConfigError for anything but a whole number >= 1, saying what the step is for (`what`)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        step = int(raw)
    except ValueError:
        step = 0
    if step < 1:
        raise ConfigError(f"{name}={raw!r}: not a step number; set it to a whole number >= 1 ({what}, 1-based), "
                          f"or unset it")
    return step


def notes(step: int | None, total_steps: int, warmup_steps: int | None = None) -> list[str]:
    """What to say before the ranks start about profiling `step` of a run of `total_steps` optimizer
    steps; `warmup_steps`: a dry-run's (its steps after them are the measured ones), None for train.
    [] when there is nothing to say."""
    if step is None:
        return []
    if step > total_steps:
        return [f"note: {ENV}={step}: this run makes {total_steps} steps, so no step is profiled "
                f"(set it to 1-{total_steps})"]
    if warmup_steps is not None and step > warmup_steps:
        return [f"note: {ENV}={step}: step {step} is one of the measured steps, and the profiler's own "
                "bookkeeping slows it: the median s/step moves little, the mean step and tokens/s on the mean "
                f"more (the ledger's profiled_step). Profile a warm-up step (<= {warmup_steps}) to keep the "
                "measured steps clean, or add a step (dryrun_steps) and read the profile only"]
    return []
