"""Step progress of a run, one plain line at a time, from rank 0.

The ranks' output reaches the user through the launcher's pipe and train.log / dryrun.log, where a
redrawn bar (tqdm's carriage returns) becomes one line per redraw; plain lines read the same in a
terminal, a pipe and a log. Dry-run and train print the same line:

    dry-run preset A (1 of 4): step 3/6, 14.2 s/step so far; this preset ~43 s more, the dry-run ~5 min 10 s more

s/step so far = wall time since this process's first step began / steps done since. The dry-run's
remaining time adds, for each preset still to run, the mean wall time of the presets already run
(launch, model load, steps and save), or this preset's own projected time when it is the first.
"""

from __future__ import annotations

import time

from transformers import TrainerCallback

from tuneledger.ledger import fmt_h


def progress_line(label: str, step: int, total: int, s_per_step: float, *, later_presets: int = 0,
                  earlier_s: list[float] | None = None, preset_elapsed_s: float | None = None) -> str:
    """The progress line; `step` of `total` steps done at `s_per_step`. For a dry-run, the presets
    still to run after this one and the wall times of those already run give its own ETA."""
    left = max(0, total - step) * s_per_step
    if not later_presets and preset_elapsed_s is None:
        return f"{label}: step {step}/{total}, {s_per_step:.2f} s/step so far; ETA {fmt_h(left)}"
    text = f"{label}: step {step}/{total}, {s_per_step:.2f} s/step so far; this preset ~{fmt_h(left)} more"
    per_preset = sum(earlier_s) / len(earlier_s) if earlier_s else (preset_elapsed_s or 0.0) + left
    return text + f", the dry-run ~{fmt_h(left + later_presets * per_preset)} more"


class StepProgress(TrainerCallback):
    """Prints `progress_line` on rank 0 after the first step, the last, and at most every `every_s` between.

    `job["progress"]` (optional): {"label", "later_presets", "earlier_s", "started_wall"} from the launcher.
    `dryrun`: the line counts the presets ("this preset ..., the dry-run ..."); a training's says ETA.
    """

    def __init__(self, label: str, every_s: float = 10.0, later_presets: int = 0, earlier_s: list[float] | None = None,
                 started_wall: float | None = None, dryrun: bool = False):
        self.label, self.every_s, self.dryrun = label, every_s, dryrun
        self.later_presets, self.earlier_s, self.started_wall = later_presets, earlier_s or [], started_wall
        self._t0: float | None = None
        self._first_step = 0
        self._last_print = 0.0

    def on_train_begin(self, args, state, control, **kw):
        # Between the launch line and the first step line lie the ranks' start and the model load.
        if state.is_world_process_zero:
            ready = f" after {time.time() - self.started_wall:.0f} s (start-up and model load)" if self.started_wall else ""
            print(f"{self.label}: ready{ready}; {state.max_steps - state.global_step} steps to run", flush=True)

    def on_step_begin(self, args, state, control, **kw):
        if self._t0 is None:
            self._t0, self._first_step = time.perf_counter(), state.global_step

    def on_step_end(self, args, state, control, **kw):
        if not state.is_world_process_zero or self._t0 is None:
            return
        now = time.perf_counter()
        step, total = state.global_step, state.max_steps
        if not (step == self._first_step + 1 or step >= total or now - self._last_print >= self.every_s):
            return
        self._last_print = now
        per_step = (now - self._t0) / max(1, step - self._first_step)
        elapsed = time.time() - self.started_wall if self.started_wall and self.dryrun else None
        print(progress_line(self.label, step, total, per_step, later_presets=self.later_presets,
                            earlier_s=self.earlier_s, preset_elapsed_s=elapsed), flush=True)
