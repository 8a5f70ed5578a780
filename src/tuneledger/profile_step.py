"""TUNELEDGER_PROFILE_STEP (and TUNELEDGER_MEMORY_STEP's step number), read once by the launcher
(dry-run and train) before any rank starts: a bad value is refused with a sentence instead of a traceback in every rank, a step the run never
reaches is said instead of a silent "no profile", and a profiled or recorded step among a dry-run's
measured steps is said, since the profiler's or the allocator history's bookkeeping slows it
(profile.py, memory_step.py)."""

from __future__ import annotations

import os

from tuneledger import allocator
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


# What each step variable does to its step: (what the step is, what slows it, the dry-run ledger's key)
SLOWED_BY = {ENV: ("profiled", "the profiler's own bookkeeping", "profiled_step"),
             MEMORY_ENV: ("recorded", "recording every allocation with its Python stack", "memory_step")}


def notes(step: int | None, total_steps: int, warmup_steps: int | None = None, env: str = ENV) -> list[str]:
    """What to say before the ranks start about the step that $env (ENV or MEMORY_ENV) names, in a run
    of `total_steps` optimizer steps; `warmup_steps`: a dry-run's (its steps after them are the
    measured ones), None for train. [] when there is nothing to say."""
    if step is None:
        return []
    done, slows, key = SLOWED_BY[env]
    if step > total_steps:
        return [f"note: {env}={step}: this run makes {total_steps} steps, so no step is {done} "
                f"(set it to 1-{total_steps})"]
    if warmup_steps is not None and step > warmup_steps:
        clean = (f"Name a warm-up step (<= {warmup_steps})" if warmup_steps
                 else "Set dryrun_warmup_steps >= 1 and name step 1")
        return [f"note: {env}={step}: step {step} is one of the measured steps, and {slows} slows it. "
                "The median s/step hardly moves, but the mean s/step rises and the tokens/s on the mean "
                f"step falls (the dry-run ledger names the step as {key}). {clean} to keep the measured "
                "steps clean, or keep this dry-run for the table it writes and measure speed in another"]
    return []


def _steps(cuda: bool) -> dict[str, int | None]:
    # Without CUDA, or with cudaMallocAsync, no allocator history is recorded (the worker says so):
    # its step is not slowed. The value is still checked.
    memory = memory_requested()
    return {ENV: requested(), MEMORY_ENV: memory if cuda and allocator.keeps_history(os.environ) else None}


def all_notes(total_steps: int, warmup_steps: int | None = None, cuda: bool = True) -> list[str]:
    """notes() for both step variables as the environment sets them, on CUDA or not (`cuda`: a CPU run
    records no allocator history). Raises ConfigError as requested()."""
    steps = _steps(cuda)
    said = [n for env, step in steps.items() for n in notes(step, total_steps, warmup_steps, env)]
    if (memory := memory_requested()) and steps[MEMORY_ENV] is None:
        # Said once here, not by every preset's ranks, and whatever the step (one past the end too).
        said.append(no_history_note(memory, allocator.NO_CUDA if not cuda else allocator.ASYNC))
    return said


def no_history_note(step: int, why: str) -> str:
    """The one line for a TUNELEDGER_MEMORY_STEP that cannot record (`why`: allocator.NO_CUDA, .ASYNC)."""
    return f"note: {MEMORY_ENV}={step}: {why}, so no allocator history to split"


def measured_steps(warmup_steps: int, total_steps: int, cuda: bool = True) -> dict[str, int]:
    """The dry-run ledger's keys (profiled_step, memory_step) for a step variable that names one of the
    measured steps (warmup_steps < step <= total_steps): that step was slowed. Raises ConfigError as requested()."""
    return {SLOWED_BY[env][2]: step for env, step in _steps(cuda).items()
            if step and warmup_steps < step <= total_steps}
