"""The fault guards of a training run: what keeps every checkpoint trustworthy and every run stoppable.

- `SealCheckpoint`: after each save, the run's config and data hashes go into the checkpoint and
  the manifest is written last (checkpoints.py), before old checkpoints rotate out;
- `NonFiniteGuard`: a NaN/Inf loss or grad norm stops the run before it saves; a collapse warns;
- `StopOnSignal`: SIGTERM/SIGINT finishes the step, saves and exits 0 on every rank;
- a full disk mid-save (`disk_full`, `DiskFullError`): the message names the path and the bytes;
- `resume_conflicts` and `data_changes`: what a resume would silently change (settings, data);
- `CrashAfterStep`: fault injection for the resume test.
A rank dies with its launcher through launch.set_parent_death_signal. docs/faults.md has each fault
and what it leaves.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from tuneledger import quiet
from tuneledger.files import disk_full

quiet.install()  # before transformers imports bitsandbytes, which logs at import
from transformers import TrainerCallback  # noqa: E402

from tuneledger.checkpoints import CONFIG, DATA, size_of, unhealthy, write_manifest  # noqa: E402
from tuneledger.config import JobConfig  # noqa: E402
from tuneledger.perms import apply_umask  # noqa: E402


# What a checkpoint's training depends on: resuming with another value of any of these would
# silently train something else (another global batch shifts the schedule and the epoch count).
# max_steps and num_train_epochs may change: raising them is how a finished run goes on.
RESUME_KEYS = ("model_name_or_path", "dataset", "template", "default_system", "cutoff_len", "placeholders",
               "max_samples", "quantization_bit", "quantization_type", "double_quantization", "lora_rank",
               "lora_alpha", "lora_dropout", "lora_target", "global_batch_size", "learning_rate",
               "lr_scheduler_type", "warmup_ratio", "seed", "val_size")
CONFIG_IN_CHECKPOINT = CONFIG


class DiskFullError(OSError):
    """A save ran out of disk. The message names the path, the bytes needed and the bytes free."""


def disk_full_message(ckpt: Path, need: int | None, good: Path | None, dryrun: bool = False) -> str:
    """The line a save that met a full disk ends with: the path, the bytes needed (when a save was
    weighed) and free, and what the same command does next (`dryrun`: the dry-run's timed save)."""
    free = shutil.disk_usage(next((p for p in [ckpt, *ckpt.parents] if p.exists()), Path("."))).free
    return (f"disk full while saving {ckpt}: a checkpoint needs {need:,} bytes" if need else
            f"disk full while saving {ckpt}: a checkpoint needs more") + (
        f", {free:,} bytes are free there. " + (
            "The dry-run times one real save: free space, then run the same command again." if dryrun else
            f"The last good checkpoint, {good}, is kept. Free space or lower save_total_limit, then run the same "
            "command to resume from it." if good else
            "No checkpoint was saved before it. Free space or lower save_total_limit, then run the same command: it "
            "starts over."))


class SealCheckpoint(TrainerCallback):
    """After every save: the run's config and data hashes go into the checkpoint, then (once every
    rank has written its part) rank 0 writes the manifest last, and only then rotates old
    checkpoints out, counting sealed ones only (the Trainer's own rotation runs before this callback
    and could delete a good checkpoint for one that never gets sealed; it is turned off)."""

    def __init__(self, cfg: JobConfig, data_files: dict[str, str] | None, keep: int | None, dryrun: bool = False):
        self.cfg, self.data_files, self.keep, self.dryrun = cfg, data_files or {}, keep, dryrun
        self.good: Path | None = None  # last sealed checkpoint of this run
        self.bytes: int | None = None  # its size on disk

    def on_save(self, args, state, control, **kw):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()  # every rank's rng_state_N.pth is written before the manifest lists it
        if state.is_world_process_zero:
            self._seal(args, state, kw)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # Every rank knows the last good checkpoint, so a rank that meets a full disk at the next
            # save says what rank 0 would (a trial's rank 1 said "no checkpoint was saved" while rank 0
            # said checkpoint-10 was kept). One small broadcast per save.
            shared = [str(self.good) if self.good else None, self.bytes]
            dist.broadcast_object_list(shared, src=0)
            self.good, self.bytes = (Path(shared[0]) if shared[0] else None), shared[1]

    def _seal(self, args, state, kw) -> None:
        """Rank 0: seal the checkpoint just saved, then rotate (see the class)."""
        ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if not ckpt.is_dir():
            return
        try:
            (ckpt / CONFIG).write_text(json.dumps(self.cfg.model_dump(), indent=1, ensure_ascii=False))
            (ckpt / DATA).write_text(json.dumps({"data_files": self.data_files}, indent=1, ensure_ascii=False))
            health = step_health(kw.get("model"), state)
            write_manifest(ckpt, state.global_step, health)
        except Exception as e:
            if disk_full(e):
                shutil.rmtree(ckpt, ignore_errors=True)  # half-written: no use, and it holds space
                raise DiskFullError(errno.ENOSPC, disk_full_message(ckpt, self.bytes, self.good, self.dryrun)) from e
            raise
        apply_umask(ckpt)  # safetensors wrote adapter_model.safetensors 0600
        bad = unhealthy(health)
        if bad:  # sealed, so it shows in scans with its reason; it must not rotate good ones out
            print(f"WARNING: {ckpt.name} is saved but not good: {bad}. Older checkpoints are kept.",
                  file=sys.stderr, flush=True)
            return
        self.good, self.bytes = ckpt, size_of(ckpt)
        from transformers.trainer_utils import rotate_checkpoints

        rotate_checkpoints(output_dir=args.output_dir, save_total_limit=self.keep, use_mtime=False)


def step_health(model: Any, state: Any) -> dict:
    """The health a checkpoint is sealed with: the step's logged loss and grad norm (the guard
    forces a log at every save step) and the adapter's largest |weight| and finiteness (one
    reduction per trainable tensor and one host sync, at save time only)."""
    logged = next((h for h in reversed(state.log_history) if "loss" in h and h.get("step") == state.global_step), {})
    out = {"loss": logged.get("loss"), "grad_norm": logged.get("grad_norm"), "max_abs_weight": None,
           "finite_weights": None}
    params = [p for p in model.parameters() if p.requires_grad] if model is not None else []
    if params:
        import torch

        with torch.no_grad():
            m = torch.stack([p.detach().abs().max().float() for p in params]).max().item()
        out["finite_weights"] = math.isfinite(m)
        out["max_abs_weight"] = m if math.isfinite(m) else None
    return out


def resume_conflicts(checkpoint: str | Path, cfg: JobConfig) -> list[str]:
    """Settings of `cfg` that differ from those the checkpoint was trained with (RESUME_KEYS).
    A checkpoint without its config cannot be checked: that is a conflict too, never a pass."""
    saved_path = Path(checkpoint) / CONFIG_IN_CHECKPOINT
    if not saved_path.is_file():
        return [f"{saved_path} is missing, so the settings it was trained with cannot be checked"]
    saved, now = json.loads(saved_path.read_text()), cfg.model_dump()
    return [f"{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}" for k in RESUME_KEYS if saved.get(k) != now.get(k)]


def data_changes(checkpoint: str | Path, data_files: dict[str, str]) -> list[str]:
    """Data files whose sha256 differs from the one the checkpoint was trained on (same path, other
    contents), naming both hashes. A checkpoint that recorded no hashes gives no finding."""
    saved_path = Path(checkpoint) / DATA
    if not saved_path.is_file():
        return []
    saved = json.loads(saved_path.read_text()).get("data_files", {})
    return [f"{f}: checkpoint trained on sha256 {saved[f]}, the file now has sha256 {h}"
            for f, h in data_files.items() if f in saved and saved[f] != h]


class NonFiniteGuard(TrainerCallback):
    """Stops a run whose loss or grad norm is NaN/Inf before it saves, and warns of a collapse.

    Checked at every log (the logged loss is the mean over every rank and every step since the
    last log, so one NaN anywhere shows) and forced at every save step: no NaN checkpoint is
    written, so none can rotate a good one out. Every rank sees the same logged numbers and
    stops at the same step. Collapse: the grad norm 0 (<= 1e-8) for COLLAPSE_LOGS logs in a row
    (weights blown to a saturated state, as with learning_rate=1e6): a warning, the run goes on.
    """

    COLLAPSE_LOGS = 3

    def __init__(self):
        self.last_finite_step = 0
        self.tripped: dict | None = None
        self.flat: list[tuple[int, float]] = []
        self.warned = False

    def on_step_end(self, args, state, control, **kw):
        if control.should_save:
            control.should_log = True  # the check runs on the numbers of exactly this step

    def on_log(self, args, state, control, logs=None, **kw):
        logs = logs or {}
        if "loss" not in logs:
            return
        loss, gnorm = logs["loss"], logs.get("grad_norm")
        if not math.isfinite(loss) or (gnorm is not None and not math.isfinite(gnorm)):
            self.tripped = {"reason": "nonfinite", "step": state.global_step, "loss": loss, "grad_norm": gnorm,
                            "last_finite_step": self.last_finite_step}
            control.should_save = False
            control.should_training_stop = True
            if state.is_world_process_zero:
                print(f"ERROR: loss {loss} / grad norm {gnorm} at step {state.global_step} (finite until step "
                      f"{self.last_finite_step}): training stopped, this step is not saved.", file=sys.stderr, flush=True)
            return
        self.last_finite_step = state.global_step
        # A zero gradient is the collapse itself (the loss then stays where it is, batch to batch).
        self.flat = self.flat + [(state.global_step, loss)] if gnorm is not None and gnorm <= 1e-8 else []
        if len(self.flat) >= self.COLLAPSE_LOGS and not self.warned and state.is_world_process_zero:
            self.warned = True
            losses = [x for _, x in self.flat]
            print(f"WARNING: training has collapsed: grad norm 0 from step {self.flat[0][0]} to {state.global_step}, "
                  f"loss {min(losses):.4g}..{max(losses):.4g}. Nothing is being learned; "
                  f"learning_rate={args.learning_rate} is likely far too high.", file=sys.stderr, flush=True)


class StopOnSignal(TrainerCallback):
    """SIGTERM / SIGINT (a scheduler's preemption, Ctrl-C): finish the step, save, stop, exit 0.

    The handler only notes the signal. At every step end the ranks agree on it through a small
    all-reduce on a gloo group (a host-side integer: no GPU sync), so all of them stop after the
    same step and the Trainer saves that step. A watchdog ends the process if that has not
    happened within `grace_s` (a hung peer, or a parent that died).
    """

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.signal: str | None = None
        self.stopped: dict | None = None
        self.group = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._note)

    def _note(self, signum, frame):
        if self.signal is None:
            self.signal = signal.Signals(signum).name
            watchdog = threading.Timer(self.grace_s, self._expire)
            watchdog.daemon = True
            watchdog.start()

    def _expire(self):
        print(f"rank {os.environ.get('RANK', 0)}: not stopped {self.grace_s:g} s after {self.signal} "
              "(stop_grace_period_s); exiting without a save", file=sys.stderr, flush=True)
        os._exit(124)

    def on_train_begin(self, args, state, control, **kw):
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            self.group = dist.new_group(backend="gloo")

    def on_step_end(self, args, state, control, **kw):
        import torch.distributed as dist

        flag = torch.tensor([1 if self.signal else 0], dtype=torch.int32)
        if self.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item() and not self.stopped:
            self.stopped = {"reason": "signal", "signal": self.signal or "signal on another rank",
                            "step": state.global_step}
            control.should_save = True
            control.should_training_stop = True
            if state.is_world_process_zero:
                print(f"{self.stopped['signal']}: stopping after step {state.global_step}; saving it", flush=True)


class CrashAfterStep(TrainerCallback):
    """Fault injection for the resume test: TUNELEDGER_CRASH_AFTER_STEP=N kills the process
    (os._exit, no cleanup, like a machine shutdown) once step N and its checkpoint are done."""

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step == self.step:
            os._exit(3)
