"""Step progress of a run, one plain line at a time, from rank 0.

The ranks' output reaches the user through the launcher's pipe and train.log / dryrun.log, where a
redrawn bar (tqdm's carriage returns) becomes one line per redraw; plain lines read the same in a
terminal, a pipe and a log. Dry-run and train print the same line:

    dry-run preset A (1 of 4): step 3/6, 14.20 s/step so far; this preset ~0 min 43 s more (3 more presets after it, not in this estimate: each steps at its own speed)

s/step so far = wall time since this process's first step began / the steps this process has done
(global_step now - global_step at on_train_begin: after a resume from checkpoint-500, step 501 is
its first, not its 501st); ETA = that x (max_steps - global_step). A dry-run's
estimate covers the running preset only, and says so: the presets differ in micro-batch,
gradient checkpointing and packing, and one's step time does not predict another's (on a 2-core
CPU, presets after A stepped twice as slow, so "the rest take as long as A" promised 3 minutes
where 6 were needed). Each preset's own line gives its own estimate once it runs.
"""

from __future__ import annotations

import time

from transformers import TrainerCallback

from tuneledger.ledger import fmt_h, plural


def progress_line(label: str, step: int, total: int, s_per_step: float, *, later_presets: int = 0,
                  dryrun: bool = False, first: bool = True) -> str:
    """The progress line; `step` of `total` steps done at `s_per_step` (s). A dry-run's (`dryrun`)
    names, on a preset's `first` line only, the `later_presets` still to run after this one, which
    its estimate leaves out (said once: the lines after it would repeat it word for word)."""
    left = max(0, total - step) * s_per_step
    if not dryrun:
        return f"{label}: step {step}/{total}, {s_per_step:.2f} s/step so far; ETA {fmt_h(left)}"
    text = f"{label}: step {step}/{total}, {s_per_step:.2f} s/step so far; this preset ~{fmt_h(left)} more"
    if not first:
        return text
    if not later_presets:
        return text + " (the last)"
    return text + f" ({plural(later_presets, 'more preset')} after it, not in this estimate: each steps at its own speed)"


class StepProgress(TrainerCallback):
    """Prints `progress_line` on rank 0 after the first step, the last, and at most every `every_s` between.

    `job["progress"]` (optional): {"label", "later_presets", "started_wall"} from the launcher.
    `dryrun`: the line says "this preset ..." and counts the presets after it; a training's says ETA.
    `earlier_s` is accepted and unused: the worker (worker.py) still passes it, and the wall times
    of earlier presets no longer go into the estimate (see the module's docstring).
    """

    def __init__(self, label: str, every_s: float = 10.0, later_presets: int = 0, earlier_s: list[float] | None = None,
                 started_wall: float | None = None, dryrun: bool = False):
        self.label, self.every_s, self.dryrun = label, every_s, dryrun
        self.later_presets, self.started_wall = later_presets, started_wall
        self._t0: float | None = None
        self._first_step: int | None = None  # global_step when this process began: the checkpoint's on a resume
        self._last_print = 0.0

    def on_train_begin(self, args, state, control, **kw):
        self._first_step = state.global_step  # the steps before it were another process's, at its own speed
        # Between the launch line and the first step line lie the ranks' start and the model load.
        if state.is_world_process_zero:
            ready = f" after {time.time() - self.started_wall:.0f} s (start-up and model load)" if self.started_wall else ""
            print(f"{self.label}: ready{ready}; {state.max_steps - state.global_step} steps to run", flush=True)

    def on_step_begin(self, args, state, control, **kw):
        if self._t0 is None:
            self._t0 = time.perf_counter()
            if self._first_step is None:  # no on_train_begin seen
                self._first_step = state.global_step

    def on_step_end(self, args, state, control, **kw):
        if not state.is_world_process_zero or self._t0 is None:
            return
        now = time.perf_counter()
        step, total = state.global_step, state.max_steps
        if not (step == self._first_step + 1 or step >= total or now - self._last_print >= self.every_s):
            return
        self._last_print = now
        per_step = (now - self._t0) / max(1, step - self._first_step)
        print(progress_line(self.label, step, total, per_step, later_presets=self.later_presets, dryrun=self.dryrun,
                            first=step == self._first_step + 1), flush=True)


# The Trainer's end-of-run metrics: `tuneledger train` prints the run's own summary (its loss over
# the whole run and the command's wall time), so the Trainer's train_runtime line would contradict it.
END_OF_RUN = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos")


def log_line(label: str, step: int, total: int, logs: dict) -> str | None:
    """One line for a Trainer log dict (what PrinterCallback prints raw), or None for the end-of-run
    metrics. Training: `label: step 10/40, loss 1.2345, grad_norm 0.512, lr 9.00e-04, epoch 0.25,
    2,345 tokens/s (rank 0 x world size)` (the ETA is StepProgress's line); evaluation: `label: eval at step 10/40,
    eval_loss 1.2345 in 3.1 s`; keys it does not know follow as key value."""
    logs = dict(logs)
    if any(k in logs for k in END_OF_RUN):
        return None
    parts = []
    if "eval_loss" in logs:
        head = f"{label}: eval at step {step}/{total}"
        parts.append(f"eval_loss {logs.pop('eval_loss'):.4f}")
        if "eval_runtime" in logs:
            parts[-1] += f" in {logs.pop('eval_runtime'):.1f} s"
        for k in ("eval_samples_per_second", "eval_steps_per_second"):
            logs.pop(k, None)
    else:
        head = f"{label}: step {step}/{total}"
    for key, fmt in (("loss", "loss {:.4f}"), ("grad_norm", "grad_norm {:.3g}"), ("learning_rate", "lr {:.2e}"),
                     ("epoch", "epoch {:.2f}"), ("tokens_per_s", "{:,.0f} tokens/s (rank 0 x world size)")):
        if isinstance(logs.get(key), (int, float)):
            parts.append(fmt.format(logs.pop(key)))
    logs.pop("eta_h", None)  # StepProgress's line gives the ETA, from the steps of this process
    parts += [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in logs.items()]
    return f"{head}, {', '.join(parts)}" if parts else None


class LogLine(TrainerCallback):
    """Prints each Trainer log as `log_line` on rank 0, in place of transformers' PrinterCallback,
    whose raw dicts (`{'loss': 1.23, 'grad_norm': ...}`) read as debug output in train.log."""

    def __init__(self, label: str):
        self.label = label

    def on_log(self, args, state, control, logs=None, **kw):
        if state.is_world_process_zero and logs:
            line = log_line(self.label, state.global_step, state.max_steps, logs)
            if line:
                print(line, flush=True)
