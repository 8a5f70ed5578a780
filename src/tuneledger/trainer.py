"""The per-rank worker that torchrun starts: setup(), then main(), then fit().

    python -m torch.distributed.run --nproc-per-node N -m tuneledger.trainer JOB.json

JOB.json is written by `tuneledger train` / `tuneledger dryrun` (launch.py) and holds the
resolved config, the path of the tokenized dataset (prepared before torchrun, so no rank ever
tokenizes) and the mode. Each rank trains with transformers' Trainer; rank 0 writes the result.

Timing (both modes, the same way): StepTimer records CUDA events (no host sync) at each
micro-batch boundary, before and after the optimizer and at step end, and reads them once after
training; wall-clock marks of the worker's phases (`timeline`) let the launcher split the command
into the ETA's parts (eta.py). In mode "dryrun" the steps are real steps of the full run, replayed
from their positions in its data order (`replay_order`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import resource
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from tuneledger import quiet

quiet.install()  # before transformers and peft import bitsandbytes, which logs at import
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from tuneledger.checkpoints import CONFIG, DATA, MANIFEST, best_checkpoint, last_checkpoint, size_of, unhealthy, write_manifest
from tuneledger.config import JobConfig
from tuneledger.ledger import compiled, run_loss
from tuneledger.nodes import check_same_nodes, host_name
from tuneledger.perms import apply_umask
from tuneledger.progress import StepProgress
from tuneledger.safeload import checkpoint_loading


# ------------------------------------------------------------------------------------- timing
class Clock:
    """Timestamps on the GPU's timeline (CUDA events) or the host's (CPU runs). Resolved lazily."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


class StepTimer(TrainerCallback):
    """Per optimizer step: micro-batch times (forward+backward), optimizer time, host data wait.

    The last micro-batch of a step carries DDP's gradient all-reduce (and any wait for a slower
    rank); the others run under `no_sync`. `summary()` synchronises once and returns lists in s.
    """

    def __init__(self, clock: Clock, device: torch.device | None = None):
        self.clock = clock
        self.device = device
        self.steps: list[dict] = []
        self._cur: dict | None = None
        self._host_end: float | None = None
        self.save_s: list[float] = []
        self.saves: list[dict] = []  # {"after_step": steps done, "s": seconds, "wall_end": UTC s}

    def on_step_begin(self, args, state, control, **kw):
        now = time.perf_counter()
        # Host time between steps: the Trainer fetches the next step's micro-batches here.
        wait = now - self._host_end if self._host_end is not None else 0.0
        self._cur = {"marks": [self.clock.mark()], "data_wait_s": wait, "wall_begin": time.time()}

    def on_substep_end(self, args, state, control, **kw):
        if self._cur:
            self._cur["marks"].append(self.clock.mark())

    def on_pre_optimizer_step(self, args, state, control, **kw):
        if self._cur:
            self._cur["marks"].append(self.clock.mark())
            self._cur["n_micro"] = len(self._cur["marks"]) - 1

    def on_step_end(self, args, state, control, **kw):
        if self._cur:
            self._cur["marks"].append(self.clock.mark())
            self._cur["wall_end"] = time.time()  # UTC seconds, to join the GPU monitor's samples
            if self.device is not None and self.device.type == "cuda":
                # Cumulative: a step where it grows is one where the allocator freed its cache and
                # retried (a stall of seconds, from fragmentation). A host-side counter, no sync.
                self._cur["alloc_retries"] = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)
            self.steps.append(self._cur)
            self._cur = None
        self._host_end = time.perf_counter()

    def on_save(self, args, state, control, **kw):
        now = time.perf_counter()
        self.save_s.append(now - self._host_end)
        self.saves.append({"after_step": len(self.steps), "s": now - self._host_end, "wall_end": time.time()})
        self._host_end = now  # the next step's data wait starts after the save, not before it

    def summary(self) -> list[dict]:
        """Per step: step_s, micro_s (list), optimizer_s, data_wait_s (host), and t_begin/t_end,
        the step's bounds in s since the first step began (so a window's wall time includes the
        gaps between steps)."""
        if self.clock.cuda:
            torch.cuda.synchronize()
        out = []
        origin = self.steps[0]["marks"][0] if self.steps else None
        for s in self.steps:
            m, n = s["marks"], s["n_micro"]
            micro = [self.clock.seconds(m[i], m[i + 1]) for i in range(n)]
            out.append({"step_s": self.clock.seconds(m[0], m[-1]), "micro_s": micro,
                        "optimizer_s": self.clock.seconds(m[n], m[-1]), "data_wait_s": s["data_wait_s"],
                        "t_begin": self.clock.seconds(origin, m[0]), "t_end": self.clock.seconds(origin, m[-1]),
                        "wall_begin": s["wall_begin"], "wall_end": s["wall_end"], "alloc_retries": s.get("alloc_retries")})
        return out


class LedgerTrainer(Trainer):
    """transformers' Trainer plus a count of real (non-pad) tokens and tokens/s + ETA in the logs.

    The token count accumulates on the device (no sync per micro-batch) and is read at logging
    steps and at the end. `floating_point_ops` is replaced by 6·N·tokens with N counted once:
    the stock one walks every parameter on every micro-batch, a host cost at small micro-batches.
    """

    def __init__(self, *a, n_params: int = 0, **kw):
        super().__init__(*a, **kw)
        self.n_params = n_params
        self.replay = False  # dry-run: train_dataset is already in the real run's order (replay_order)
        self.tokens = torch.zeros((), dtype=torch.int64, device=self.args.device)
        self.step_tokens: list[torch.Tensor] = []  # running count at each step end (no sync)
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=self.args.device)
        self.step_losses: list[torch.Tensor] = []  # each step's loss on this rank (no sync)
        self._log_tokens, self._log_time, self._log_step = 0, time.perf_counter(), 0
        self.add_callback(TokenSnapshot(self))

    def _get_train_sampler(self, train_dataset=None):
        if self.replay:
            from torch.utils.data import SequentialSampler

            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)
        return super()._get_train_sampler(train_dataset)

    def training_step(self, model, inputs, num_items_in_batch=None):
        mask = inputs.get("attention_mask")
        self.tokens += mask.sum() if mask is not None else inputs["input_ids"].numel()
        loss = super().training_step(model, inputs, num_items_in_batch)
        # The micro-batch losses of a step add up to the step's loss, as the Trainer logs it
        # (each is scaled by the step's token count or the accumulation); kept on the device.
        self.loss_sum += loss.detach().float()
        return loss

    # Optimizer, scheduler and RNG state: loaded so that no code in them can run (safeload.py).
    def _load_optimizer_and_scheduler(self, checkpoint):
        with checkpoint_loading():
            return super()._load_optimizer_and_scheduler(checkpoint)

    def _load_rng_state(self, checkpoint):
        with checkpoint_loading():
            return super()._load_rng_state(checkpoint)

    def _save_checkpoint(self, model, trial):
        # A folder saved over (resume_from_checkpoint=never in a used run dir) is unsealed first,
        # so a kill mid-save cannot leave an old manifest vouching for a mix of files.
        if self.is_world_process_zero():
            (Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}" / MANIFEST).unlink(missing_ok=True)
        # A full disk mid-save: name the path, the bytes needed and free; the last good checkpoint stays.
        try:
            super()._save_checkpoint(model, trial)
        except Exception as e:
            if not disk_full(e):
                raise
            ckpt = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
            seal = next((c for c in self.callback_handler.callbacks if isinstance(c, SealCheckpoint)), None)
            if self.is_world_process_zero():
                shutil.rmtree(ckpt, ignore_errors=True)  # half-written: no use, and it holds space
            raise DiskFullError(errno.ENOSPC, disk_full_message(ckpt, seal and seal.bytes, seal and seal.good)) from e

    def floating_point_ops(self, inputs) -> int:
        return 6 * self.n_params * inputs["input_ids"].numel()

    def log(self, logs: dict, *args, **kw) -> None:
        if "train_runtime" in logs:
            # The end-of-run metrics: their train_loss reads low after a resume (ledger.run_loss);
            # `tuneledger train` prints the whole run's loss itself, once.
            logs.pop("train_loss", None)
        if "loss" in logs and self.state.global_step:
            seen = int(self.tokens.item())
            now = time.perf_counter()
            dt = now - self._log_time
            if dt > 0 and seen > self._log_tokens:
                # Rank 0's tokens x world size: an estimate for the log line (the dry-run ledger
                # sums every rank's own count).
                logs["tokens_per_s"] = round((seen - self._log_tokens) * self.args.world_size / dt, 1)
                per_step = dt / max(1, self.state.global_step - self._log_step)
                left = max(0, self.state.max_steps - self.state.global_step)
                logs["eta_h"] = round(left * per_step / 3600, 3)
            self._log_tokens, self._log_time, self._log_step = seen, now, self.state.global_step
        super().log(logs, *args, **kw)


class LogLastStep(TrainerCallback):
    """Log at the last step too, so the run's loss covers its tail (transformers logs every
    logging_steps only)."""

    def on_step_end(self, args, state, control, **kw):
        if state.global_step >= state.max_steps:
            control.should_log = True


class TokenSnapshot(TrainerCallback):
    """Keeps the trainer's running token count at every step end (a device tensor, no sync)."""

    def __init__(self, trainer: LedgerTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kw):
        self.trainer.step_tokens.append(self.trainer.tokens.clone())
        self.trainer.step_losses.append(self.trainer.loss_sum.clone())
        self.trainer.loss_sum.zero_()


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


def disk_full(exc: BaseException) -> bool:
    """True if `exc` (or what caused it) is ENOSPC: an OSError, or torch's and safetensors' own
    errors, which carry only the text ("file write failed", "No space left on device")."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        text = str(exc)
        if "No space left on device" in text or "file write failed" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def disk_full_message(ckpt: Path, need: int | None, good: Path | None) -> str:
    free = shutil.disk_usage(next((p for p in [ckpt, *ckpt.parents] if p.exists()), Path("."))).free
    return (f"disk full while saving {ckpt}: a checkpoint needs {need:,} bytes" if need else
            f"disk full while saving {ckpt}: a checkpoint needs more") + (
        f", {free:,} bytes are free there. " + (
            f"The last good checkpoint, {good}, is kept. Free space or lower save_total_limit, then run the same "
            "command to resume from it." if good else
            "No checkpoint was saved before it. Free space or lower save_total_limit, then run the same command: it "
            "starts over."))


class SealCheckpoint(TrainerCallback):
    """After every save: the run's config and data hashes go into the checkpoint, then (once every
    rank has written its part) rank 0 writes the manifest last, and only then rotates old
    checkpoints out, counting sealed ones only (the Trainer's own rotation runs before this callback
    and could delete a good checkpoint for one that never gets sealed; it is turned off)."""

    def __init__(self, cfg: JobConfig, data_files: dict[str, str] | None, keep: int | None):
        self.cfg, self.data_files, self.keep = cfg, data_files or {}, keep
        self.good: Path | None = None  # last sealed checkpoint of this run
        self.bytes: int | None = None  # its size on disk

    def on_save(self, args, state, control, **kw):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()  # every rank's rng_state_N.pth is written before the manifest lists it
        if not state.is_world_process_zero:
            return
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
                raise DiskFullError(errno.ENOSPC, disk_full_message(ckpt, self.bytes, self.good)) from e
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


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send `sig` to this process when its parent dies (Linux PR_SET_PDEATHSIG),
    so ranks never train on as orphans after their launcher is killed."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux
    if os.getppid() == 1:  # the parent died before the call
        os.kill(os.getpid(), sig)


class PlotLoss(TrainerCallback):
    """Redraws <output_dir>/training_loss.png at every checkpoint and at the end (rank 0), so an
    interrupted run has its picture too. A drawing error is printed, never raised: a picture must
    not stop a run."""

    def __init__(self, png: Path, title: str):
        self.png, self.title = png, title

    def draw(self, state) -> None:
        if not state.is_world_process_zero:
            return
        try:
            from tuneledger.plots import loss_plot

            loss_plot(state.log_history, self.png, self.title)
        except Exception as e:  # noqa: BLE001
            print(f"WARNING: could not draw {self.png}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    def on_save(self, args, state, control, **kw):
        self.draw(state)

    def on_train_end(self, args, state, control, **kw):
        self.draw(state)


class EvalCounter(TrainerCallback):
    """Eval micro-batches this rank ran: under DDP every rank evaluates its shard (the ledger shows it)."""

    def __init__(self):
        self.batches = 0

    def on_prediction_step(self, args, state, control, **kw):
        self.batches += 1


def split_eval(ds: Any, cfg: JobConfig) -> tuple[Any, Any]:
    """(train, eval) from the prepared dataset: val_size records held out by seed (the same on
    every rank), or (ds, None)."""
    from tuneledger.data import holdout_count

    n = holdout_count(len(ds), cfg.val_size)
    if not n:
        return ds, None
    parts = ds.train_test_split(test_size=n, seed=cfg.seed, shuffle=True)
    return parts["train"], parts["test"]


class SyncDebug(TrainerCallback):
    """Diagnosis: TUNELEDGER_SYNC_DEBUG=N warns (with the stack) at every host-device sync during
    step N, so a step's needless syncs can be found (torch.cuda.set_sync_debug_mode)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step + 1 == self.step:
            torch.cuda.set_sync_debug_mode("warn")

    def on_step_end(self, args, state, control, **kw):
        torch.cuda.set_sync_debug_mode(0)


class CrashAfterStep(TrainerCallback):
    """Fault injection for the resume test: TUNELEDGER_CRASH_AFTER_STEP=N kills the process
    (os._exit, no cleanup, like a machine shutdown) once step N and its checkpoint are done."""

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step == self.step:
            os._exit(3)


# ------------------------------------------------------------------------------------ pieces
def make_collator(cfg: JobConfig, tokenizer: Any, attention: str = "sdpa") -> Any:
    """Padded micro-batches (DataCollatorForSeq2Seq), or padding-free packing of whole samples.

    Packing (DataCollatorWithFlattening) concatenates the micro-batch into one row with
    `position_ids` restarting at 0 per sample and no attention mask, so no sample attends to
    another: varlen kernels (`attention` flash_attention_2 or speed.VARLEN) take the sample bounds
    from the collator (`cu_seq_lens_q`, `max_length_q`: no device sync to find them); SDPA and
    flex derive them from position_ids.
    """
    if cfg.packing:
        from transformers import DataCollatorWithFlattening

        from tuneledger.speed import VARLEN

        return DataCollatorWithFlattening(return_position_ids=True, separator_id=-100,
                                          return_flash_attn_kwargs=attention in ("flash_attention_2", VARLEN))
    from transformers import DataCollatorForSeq2Seq

    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)


def training_args(cfg: JobConfig, mode: str, out_dir: Path, cuda: bool, report_to: str, save: bool = True,
                  evaluate: bool = False) -> TrainingArguments:
    """transformers' TrainingArguments of a job. With `evaluate` (there is eval data and it is a
    train run), evaluation every eval_steps (default save_steps) or epoch, and the best checkpoint
    tracked by eval loss; the dry-run times one evaluation itself (fit)."""
    dryrun = mode == "dryrun"
    evaluate = evaluate and not dryrun
    # transformers 5 takes the TensorBoard directory from the environment only.
    os.environ.setdefault("TENSORBOARD_LOGGING_DIR", str(out_dir / "tensorboard"))
    return TrainingArguments(
        output_dir=str(out_dir),
        per_device_train_batch_size=cfg.per_device_train_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        learning_rate=cfg.learning_rate,
        lr_scheduler_type=cfg.lr_scheduler_type,
        # transformers 5: a float in [0, 1) is a ratio of total steps, an int a count.
        warmup_steps=cfg.warmup_steps or cfg.warmup_ratio,
        weight_decay=cfg.weight_decay,
        num_train_epochs=cfg.num_train_epochs,
        max_steps=cfg.dryrun_steps if dryrun else cfg.max_steps,
        max_grad_norm=cfg.max_grad_norm,
        optim=cfg.optim if cuda else "adamw_torch",
        bf16=cfg.bf16 and cuda,
        logging_steps=cfg.logging_steps,
        report_to=report_to,
        # The dry-run saves exactly once, at its last step, to time one real checkpoint.
        save_strategy="steps" if save else "no",
        save_steps=cfg.dryrun_steps if dryrun else cfg.save_steps,
        save_total_limit=None,  # SealCheckpoint rotates, after the new checkpoint is sealed
        seed=cfg.seed,
        dataloader_num_workers=cfg.dataloader_num_workers,
        ddp_find_unused_parameters=False,  # LoRA on every linear: every trainable param gets a grad
        ddp_backend="nccl" if cuda else "gloo",
        ddp_timeout=cfg.ddp_timeout,
        use_cpu=not cuda,
        remove_unused_columns=False,
        # The NaN/Inf filter reads every micro-batch's loss on the host: a sync that stops the host
        # running ahead and makes fast ranks wait for slow ones. A NaN then shows in the logs as NaN.
        logging_nan_inf_filter=False,
        gradient_checkpointing=False,  # enabled in model.load_model, non-reentrant
        disable_tqdm=True,  # progress.StepProgress prints plain step lines instead (a bar breaks in a pipe)
        save_only_model=False,
        run_name=cfg.run_name,
        eval_strategy=(cfg.eval_strategy or "steps") if evaluate else "no",
        eval_steps=(cfg.eval_steps or cfg.save_steps) if evaluate else None,
        per_device_eval_batch_size=cfg.per_device_eval_batch_size,
        metric_for_best_model="eval_loss" if evaluate else None,
        greater_is_better=False,
    )


def resolve_report_to(cfg: JobConfig, rank: int) -> str:
    """'tensorboard' if it imports, else 'none' with a warning: logging never kills a run."""
    if cfg.report_to != "tensorboard":
        return "none"
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        return "tensorboard"
    except ImportError as e:
        if rank == 0:
            print(f"WARNING: report_to=tensorboard but it does not import ({e}); training continues without "
                  "TensorBoard. Fix: pip install tensorboard", file=sys.stderr, flush=True)
        return "none"


def bench_matmul_tflops(device: torch.device, n: int = 8192, iters: int = 10) -> float | None:
    """Measured dense bf16 matmul rate of this GPU (TFLOP/s, 2 n^3 per product, median of `iters`),
    the MFU denominator. Random data: zeros run faster and would flatter the peak."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n**3 / sorted(times)[len(times) // 2] / 1e12


def bench_allreduce(nbytes: int, device: torch.device, iters: int = 20) -> dict:
    """Time an all-reduce of `nbytes` (the gradient size) on the training process group.

    Bus bandwidth follows nccl-tests (PERFORMANCE.md): busbw = bytes / t * 2 (n - 1) / n, in GB/s.
    Returns {} on a single rank.
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {}
    n = dist.get_world_size()
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    for _ in range(3):
        dist.all_reduce(x)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    t = times[len(times) // 2]
    return {"bytes": x.numel() * 4, "median_s": t, "algbw_gbs": x.numel() * 4 / t / 1e9,
            "busbw_gbs": x.numel() * 4 / t / 1e9 * 2 * (n - 1) / n}


# ------------------------------------------------------------------------------ dry-run's steps
def replay_order(trainer: LedgerTrainer, ds: Any, total_steps: int, steps_per_epoch: int, warmup: int, measured: int) -> list[int]:
    """Make `trainer` run the real run's own steps: its first `warmup`, then `measured` from evenly
    spaced positions of the rest (eta.step_positions). Returns the positions (0-based steps).

    The real order is read from the Trainer's own training dataloader (accelerate's seedable
    sampler, set to each epoch as the Trainer's loop sets it), before it is dealt to ranks. Step k
    of an epoch is that order's slice [k G, (k+1) G) at global batch G: ranks take micro-batches in
    turn from it. Those slices, one after another and read in order, give every rank the same
    micro-batches, collated the same way, as the real run has at those steps.
    """
    from tuneledger.eta import step_positions

    args = trainer.args
    g = args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps
    positions = step_positions(total_steps, steps_per_epoch, len(ds) // g, warmup, measured)
    loader = trainer.get_train_dataloader()
    batches = getattr(loader.batch_sampler, "batch_sampler", loader.batch_sampler)  # under BatchSamplerShard
    sampler = batches.sampler
    orders: dict[int, list[int]] = {}
    picked: list[int] = []
    for pos in positions:
        epoch, k = divmod(pos, steps_per_epoch)
        if epoch not in orders:
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            orders[epoch] = list(sampler)
        picked += orders[epoch][k * g:(k + 1) * g]
    trainer.train_dataset = ds.select(picked)
    trainer.replay = True
    return positions


# ------------------------------------------------------------------------------- setup/main/fit
def setup(job: dict) -> tuple[JobConfig, torch.device, int, int]:
    cfg = JobConfig(**job["config"])
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available() and not job.get("cpu", False)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        if cfg.memory_cap_gib:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.memory_cap_gib * 2**30 / total), device)
    return cfg, device, rank, local_rank


def main(job_path: str) -> int:
    started = time.time()  # the launcher's ETA part "launch" ends here
    job = json.loads(Path(job_path).read_text())
    cfg, device, rank, _ = setup(job)
    set_parent_death_signal()
    # Before any weights load: every rank's node must match rank 0's (GPU model, image, packages).
    cuda = device.type == "cuda"
    check_same_nodes(torch.cuda.get_device_name(device) if cuda else "cpu", "nccl" if cuda else "gloo", cfg.ddp_timeout)
    # From the start, so a preemption during the model load still ends in a clean stop.
    stopper = StopOnSignal(cfg.stop_grace_period_s) if job["mode"] == "train" else None
    report_to = resolve_report_to(cfg, rank)  # before the model loads, so it cannot fail after
    result = fit(cfg, job, device, rank, report_to, stopper)
    result["timeline"]["main"] = started
    if rank == 0:
        Path(job["result_path"]).write_text(json.dumps(result, indent=1))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()  # else torch warns at exit, on every rank
    return 0


def fit(cfg: JobConfig, job: dict, device: torch.device, rank: int, report_to: str,
        stopper: StopOnSignal | None = None) -> dict:
    import datasets
    import torch.distributed as dist

    from tuneledger.model import align_special_tokens, load_model, load_tokenizer

    mode, cuda = job["mode"], device.type == "cuda"
    out_dir = Path(job["out_dir"])
    datasets.disable_progress_bars()
    ds = datasets.load_from_disk(job["data_path"]).select_columns(["input_ids", "labels"])
    ds, eval_ds = split_eval(ds, cfg)
    if job.get("eval_data_path"):
        eval_ds = datasets.load_from_disk(job["eval_data_path"]).select_columns(["input_ids", "labels"])
    if cfg.eval_strategy == "no":
        eval_ds = None
    tokenizer = load_tokenizer(cfg.model_name_or_path)
    t0 = time.perf_counter()
    quiet.quiet_worker_progress()
    model, info = load_model(cfg, device)
    align_special_tokens(model, tokenizer)  # so the Trainer has nothing to align and warn about per rank
    info["load_s"] = round(time.perf_counter() - t0, 2)
    timeline = {"model_loaded": time.time()}

    seal = SealCheckpoint(cfg, job.get("data_files"), cfg.save_total_limit)
    seal.bytes = job.get("checkpoint_bytes_estimate")
    guard = NonFiniteGuard()
    clock = Clock(cuda)
    timer = StepTimer(clock, device)
    args = training_args(cfg, mode, out_dir, cuda, report_to, job.get("save", True), evaluate=eval_ds is not None)
    trainer = LedgerTrainer(model=model, args=args, train_dataset=ds, eval_dataset=eval_ds if mode == "train" else None,
                            data_collator=make_collator(cfg, tokenizer, info["attention"]), processing_class=tokenizer,
                            callbacks=[timer, *([stopper] if stopper else []), guard, seal],
                            n_params=info["total_params"])
    if mode == "train":  # not in a dry-run: a log is a host sync, and would land inside the measured window
        trainer.add_callback(LogLastStep())
    else:
        # The Trainer's raw log dicts: a dry-run replays steps from across the run, so their
        # eta_h and epoch contradict the dry-run's own ETA; StepProgress prints what is true.
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)
    progress = job.get("progress") or {}
    trainer.add_callback(StepProgress(progress.get("label", f"{mode} {cfg.run_name}"), every_s=5.0 if mode == "dryrun" else 30.0,
                                      later_presets=progress.get("later_presets", 0), earlier_s=progress.get("earlier_s"),
                                      started_wall=progress.get("started_wall"), dryrun=mode == "dryrun"))
    eval_counter = EvalCounter()
    trainer.add_callback(eval_counter)
    if mode == "train" and cfg.plot_loss:
        trainer.add_callback(PlotLoss(out_dir / "training_loss.png", f"{cfg.run_name}: {cfg.model_name_or_path}"))
    positions = None
    if mode == "dryrun" and job.get("total_steps"):
        t_order = time.perf_counter()
        positions = replay_order(trainer, ds, job["total_steps"], job["steps_per_epoch"], cfg.dryrun_warmup_steps,
                                 cfg.dryrun_steps - cfg.dryrun_warmup_steps)
        timeline["order_s"] = time.perf_counter() - t_order  # dry-run only: not part of the ETA's set-up
    if os.environ.get("TUNELEDGER_SYNC_DEBUG") and cuda:
        trainer.add_callback(SyncDebug(int(os.environ["TUNELEDGER_SYNC_DEBUG"])))
    if os.environ.get("TUNELEDGER_PROFILE_STEP"):
        from tuneledger.profile import StepProfile

        trainer.add_callback(StepProfile(int(os.environ["TUNELEDGER_PROFILE_STEP"]), out_dir, rank))
    if os.environ.get("TUNELEDGER_CRASH_AFTER_STEP"):
        trainer.add_callback(CrashAfterStep(int(os.environ["TUNELEDGER_CRASH_AFTER_STEP"])))
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    resume = None
    if mode == "train" and cfg.resume_from_checkpoint != "never":
        # The launcher picked the verified checkpoint (and set damaged ones aside); never re-pick here.
        resume = job["resume"] if "resume" in job else last_checkpoint(out_dir)
        if resume and rank == 0:
            print(f"resuming from {resume}", flush=True)
    wall0, wall_started = time.perf_counter(), time.time() - 1  # 1 s: file systems with coarse mtimes
    try:
        out = trainer.train(resume_from_checkpoint=resume)
    except torch.cuda.OutOfMemoryError as e:
        # Tell the launcher why (the dry-run's 24 GB proof reads this), then die at once: torchrun
        # then stops the other ranks instead of leaving them waiting in an all-reduce.
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"oom-rank{rank}.json").write_text(json.dumps({"rank": rank, "error": str(e).splitlines()[0],
                                                                   "memory_cap_gib": cfg.memory_cap_gib}))
        print(f"rank {rank}: CUDA out of memory{f' under the {cfg.memory_cap_gib:g} GiB cap' if cfg.memory_cap_gib else ''}",
              file=sys.stderr, flush=True)
        os._exit(75)
    wall = time.perf_counter() - wall0
    timeline["train_returned"] = time.time()
    if compiled(info):
        from tuneledger.speed import compile_stats

        info["levers"]["compile_stats"] = compile_stats()
    t_eval = time.perf_counter()
    eval_timing = time_eval(trainer, eval_ds, cfg) if mode == "dryrun" and eval_ds is not None else None
    # dry-run only (its ETA adds the run's evaluations as their own part): not part of the finish
    timeline["eval_timing_s"] = time.perf_counter() - t_eval

    steps = timer.summary()
    tokens = [int(t) for t in torch.stack(trainer.step_tokens).tolist()] if trainer.step_tokens else []
    step_losses = [round(x, 5) for x in torch.stack(trainer.step_losses).tolist()] if trainer.step_losses else []
    local = {
        "rank": rank, "host": host_name(), "device": str(device),
        "gpu_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "peak_allocated_mib": round(torch.cuda.max_memory_allocated(device) / 2**20) if cuda else None,
        "peak_reserved_mib": round(torch.cuda.max_memory_reserved(device) / 2**20) if cuda else None,
        "alloc_retries": torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if cuda else 0,
        "memory_cap_gib": cfg.memory_cap_gib,
        # The process's peak resident memory (MiB; Linux reports KiB): the CPU runs' memory figure.
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "steps": steps, "cum_tokens": tokens, "eval_batches": eval_counter.batches, "step_losses": step_losses,
    }
    world = dist.get_world_size() if dist.is_initialized() else 1
    per_rank = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(per_rank, local)
    else:
        per_rank = [local]
    grad_bytes = info["trainable_params"] * 4  # LoRA weights and their grads are fp32
    t_bench = time.perf_counter()
    allreduce = bench_allreduce(grad_bytes, device) if mode == "dryrun" else {}
    peak = bench_matmul_tflops(device) if mode == "dryrun" and rank == 0 else None
    ckpt = last_checkpoint(out_dir)
    ckpt_bytes = sum(f.stat().st_size for f in Path(ckpt).rglob("*") if f.is_file()) if ckpt else 0
    if mode == "dryrun":
        timeline["benches_s"] = time.perf_counter() - t_bench  # dry-run only: not part of the ETA's finish
    # The whole run's loss from the logged losses (the history is restored on resume): see ledger.run_loss.
    loss = run_loss(trainer.state.log_history, int(Path(resume).name.split("-")[-1]) if resume else 0)
    # The ledger names TensorBoard only if this run wrote event files (not if it merely asked).
    tb_dir = Path(os.environ.get("TENSORBOARD_LOGGING_DIR", out_dir / "tensorboard"))
    events = [f for f in tb_dir.rglob("events.out.tfevents.*") if f.stat().st_mtime >= wall_started] if tb_dir.is_dir() else []
    report_to = "tensorboard" if report_to == "tensorboard" and (events or rank != 0) else "none"
    evals = [{"step": h["step"], "eval_loss": h["eval_loss"]} for h in trainer.state.log_history if "eval_loss" in h]
    best = best_checkpoint(out_dir) if mode == "train" and evals else None
    return {
        "mode": mode, "world_size": world, "model": info, "wall_s": wall, "global_step": out.global_step,
        "train_loss": loss["mean"], "last_logged_loss": loss["last"], "last_logged_step": loss["last_step"],
        "loss_steps_covered": loss["steps_covered"], "ranks": per_rank, "save_s": timer.save_s, "checkpoint": ckpt,
        "checkpoint_bytes": ckpt_bytes, "allreduce": allreduce, "report_to": report_to,
        "tensorboard_dir": str(tb_dir) if report_to == "tensorboard" else None,
        "config": cfg.model_dump(), "resumed_from": resume, "peak_tflops": peak,
        "stopped": guard.tripped or (stopper and stopper.stopped) or None,
        "eval_records": len(eval_ds) if eval_ds is not None else 0, "eval": evals, "eval_timing": eval_timing,
        "best_checkpoint": best[0] if best else None, "best_eval_loss": best[1] if best else None,
        "saves": timer.saves, "timeline": timeline, "positions": positions,
    }


def time_eval(trainer: Any, eval_ds: Any, cfg: JobConfig) -> dict:
    """Seconds of one evaluation pass over a sample of the eval records (two eval micro-batches per
    rank), for the dry-run's ETA: s_per_record x eval records x evaluations."""
    world = trainer.args.world_size
    n = min(len(eval_ds), 2 * cfg.per_device_eval_batch_size * world)
    t0 = time.perf_counter()
    trainer.evaluate(eval_dataset=eval_ds.select(range(n)))
    dt = time.perf_counter() - t0
    return {"records": n, "s": dt, "s_per_record": dt / n, "eval_records": len(eval_ds)}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
