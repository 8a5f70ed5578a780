"""transformers' Trainer as the worker runs it: `LedgerTrainer` (real tokens counted, each step's
loss kept on the device, checkpoint state loaded safely, a full disk named), its callbacks and a
job's TrainingArguments. The collator and what it tells of the rows: rows.py.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from tuneledger import quiet

quiet.install()  # before transformers and peft import bitsandbytes, which logs at import
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from tuneledger.checkpoints import MANIFEST  # noqa: E402
from tuneledger.compiled import cudagraphs_on  # noqa: E402
from tuneledger.config import JobConfig  # noqa: E402
from tuneledger.files import disk_full  # noqa: E402
from tuneledger.guards import DiskFullError, SealCheckpoint, disk_full_message  # noqa: E402
from tuneledger.rows import known_rows  # noqa: E402
from tuneledger.safeload import checkpoint_loading  # noqa: E402
from tuneledger.train_mode import TrainWalk  # noqa: E402


class LedgerTrainer(Trainer):
    """transformers' Trainer plus a count of real (non-pad) tokens and tokens/s + ETA in the logs.

    The token count accumulates on the device (no sync per micro-batch) and is read at logging
    steps and at the end. `floating_point_ops` is replaced by 6·N·tokens with N counted once:
    the stock one walks every parameter on every micro-batch, a host cost at small micro-batches.
    """

    def __init__(self, *a, n_params: int = 0, drop_padding_mask: bool = False, **kw):
        super().__init__(*a, **kw)
        self.n_params = n_params
        self.drop_padding_mask = drop_padding_mask  # padding_mask_lever's decision
        self.cudagraphs = cudagraphs_on()  # the model is compiled before the trainer is made
        self._trainable: list[torch.nn.Parameter] | None = None  # under CUDA graphs: _grads_before_backward
        self.train_walk = TrainWalk()  # model.train() at each micro-batch without its walk (train_mode.py)
        self.replay = False  # dry-run: train_dataset is already in the real run's order (replay_order)
        self.tokens = torch.zeros((), dtype=torch.int64, device=self.args.device)
        self.step_tokens: list[torch.Tensor] = []  # running count at each step end (no sync)
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=self.args.device)
        self.step_losses: list[torch.Tensor] = []  # each step's loss on this rank (no sync)
        self._log_tokens, self._log_time, self._log_step = 0, time.perf_counter(), 0
        self.add_callback(TokenSnapshot(self))
        self.add_callback(StepsFromArgs())

    def _get_train_sampler(self, train_dataset=None):
        if self.replay:
            from torch.utils.data import SequentialSampler

            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)
        return super()._get_train_sampler(train_dataset)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.cudagraphs:  # a new micro-batch: the graphs' outputs of the last one may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
            self._grads_before_backward(model)
        mask = inputs.get("attention_mask")
        self.tokens += mask.sum() if mask is not None else inputs["input_ids"].numel()
        kind = None  # what known_rows tells transformers of the rows, so that it need not ask the GPU
        if self.drop_padding_mask and mask is not None:
            inputs = {k: v for k, v in inputs.items() if k != "attention_mask"}
            kind = "padded"
        elif mask is None and "position_ids" in inputs:  # the packing collator's rows (make_collator)
            kind = "packed"
        with self.train_walk.skipped(model), known_rows(kind) if kind else nullcontext():
            loss = super().training_step(model, inputs, num_items_in_batch)
        # The micro-batch losses of a step add up to the step's loss, as the Trainer logs it
        # (each is scaled by the step's token count or the accumulation); kept on the device.
        self.loss_sum += loss.detach().float()
        return loss

    def _grads_before_backward(self, model) -> None:
        # AccumulateGrad keeps the first micro-batch's gradient itself as .grad when .grad is None;
        # under CUDA graphs that tensor is a graph output, overwritten by the next replay ("accessing
        # tensor output of CUDAGraphs that has been overwritten", bench/results/h100-2026-12-06f-call2).
        # A .grad that exists takes an in-place add instead: zeros, one fill per step.
        if self._trainable is None:
            self._trainable = [p for p in model.parameters() if p.requires_grad]
        for p in self._trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        if self.args.fsdp:  # on a GPU accelerate has turned the plugin on itself
            from tuneledger import sharding

            sharding.enable_on_cpu(self)

    # Optimizer, scheduler and RNG state: loaded so that no code in them can run (safeload.py).
    def _load_optimizer_and_scheduler(self, checkpoint):
        try:
            return self._load_optimizer_and_scheduler_safely(checkpoint)
        finally:
            if checkpoint:
                self._lr_from_this_schedule()

    def _lr_from_this_schedule(self) -> None:
        # The optimizer's saved LR is the old schedule's at the saved step: a finished run given a
        # higher max_steps would train its next step at the old schedule's end (0 for cosine). This
        # run's schedule, for the new total, sets it instead (the same value when nothing changed).
        sched = self.lr_scheduler
        if not isinstance(sched, torch.optim.lr_scheduler.LambdaLR):  # transformers' schedules all are
            return
        lrs = [base * fn(sched.last_epoch) for fn, base in zip(sched.lr_lambdas, sched.base_lrs)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        sched._last_lr = lrs

    def _load_optimizer_and_scheduler_safely(self, checkpoint):
        with checkpoint_loading():
            if not (self.is_fsdp_enabled and checkpoint):
                return super()._load_optimizer_and_scheduler(checkpoint)
            # F reads DDP's layout (sharding.py), so a run resumes from either.
            from tuneledger import sharding

            ckpt = Path(checkpoint)
            if not (ckpt / "optimizer.pt").is_file():
                return None
            sharding.load_optimizer(self.model, self.optimizer, torch.load(ckpt / "optimizer.pt", map_location="cpu"))
            self.lr_scheduler.load_state_dict(torch.load(ckpt / "scheduler.pt", map_location="cpu"))
            return None

    def _save_optimizer_and_scheduler(self, output_dir):
        if not self.is_fsdp_enabled:
            return super()._save_optimizer_and_scheduler(output_dir)
        from tuneledger import sharding

        sharding.save_optimizer(self.model, self.optimizer, Path(output_dir) / "optimizer.pt", self.args.should_save)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), Path(output_dir) / "scheduler.pt")

    def save_model(self, output_dir=None, _internal_call=False):
        if not self.is_fsdp_enabled:
            return super().save_model(output_dir, _internal_call)
        # F: the adapter only, gathered on rank 0 (accelerate's full state dict would gather the
        # whole base to rank 0's memory, and writes the adapter empty for a sharded peft model).
        from tuneledger import sharding

        out = Path(output_dir or self.args.output_dir)
        state = sharding.adapter_state(self.model, self.args.should_save)
        if self.args.should_save:
            sharding.save_adapter(self.model, state, out)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(out)
            torch.save(self.args, out / "training_args.bin")

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if not self.is_fsdp_enabled:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        from tuneledger import sharding

        sharding.load_adapter(model if model is not None else self.model, Path(resume_from_checkpoint))

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
            raise DiskFullError(errno.ENOSPC, disk_full_message(ckpt, seal and seal.bytes, seal and seal.good,
                                                                 bool(seal and seal.dryrun))) from e

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


class StepsFromArgs(TrainerCallback):
    """A resumed run's logging, eval and save intervals are the command's, not its checkpoint's:
    transformers takes them from the checkpoint's trainer_state.json (a trial's `save_steps=2`
    resumed saving every 5, after a line that said every 2). transformers' own TrainerState.compute_steps
    puts them back, a fraction (< 1) of max_steps as it reads it for a fresh run."""

    def on_train_begin(self, args, state, control, **kw):
        state.compute_steps(args, state.max_steps)


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

    def on_train_begin(self, args, state, control, **kw):
        # A resume starts at the checkpoint's step: the logs' rate and eta_h count from here, not
        # from step 0 (which made the first eta_h after a resume read 11 s for 38).
        t = self.trainer
        t._log_tokens, t._log_time, t._log_step = int(t.tokens.item()), time.perf_counter(), state.global_step

    def on_step_end(self, args, state, control, **kw):
        self.trainer.step_tokens.append(self.trainer.tokens.clone())
        self.trainer.step_losses.append(self.trainer.loss_sum.clone())
        self.trainer.loss_sum.zero_()


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


def time_loss_plot(png: Path, points: int) -> dict:
    """Seconds that PlotLoss's drawing costs a train (rank 0, plot_loss on): it draws at every save
    and at the end, the first time importing matplotlib. The dry-run times two draws of a history
    of `points` logged steps (the train's steps / logging_steps, at most 10,000) into `png`, removed
    after: {"first_s": the cold draw, "next_s": a later one}. Before this the ETA left the draws
    out: on one H200 the train's last save took 2.4 s and trainer.train() returned 1.6 s after it
    (bench/results/h200-2026-12-04/call11-eta)."""
    from types import SimpleNamespace

    state = SimpleNamespace(is_world_process_zero=True,
                            log_history=[{"step": i + 1, "loss": 2.0 / (1 + i / 50)} for i in range(max(1, min(points, 10_000)))])
    plot = PlotLoss(png, "ETA probe")
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        plot.draw(state)
        times.append(time.perf_counter() - t0)
    png.unlink(missing_ok=True)
    return {"first_s": times[0], "next_s": times[1], "points": len(state.log_history)}


def loader_workers(requested: int, say: bool = False) -> int:
    """DataLoader workers per rank: `requested` (dataloader_num_workers), at most the cores this
    process may run on (its CPU affinity). More only compete with the ranks for the CPU, and torch
    warns about it from every rank; an LF yaml's 4 on a 2-core box is the common case. `say`: print
    the cap once (rank 0)."""
    from tuneledger.data import num_proc

    cores = num_proc(None)
    if requested <= cores:
        return requested
    if say:
        print(f"dataloader_num_workers={requested} per rank, capped at {cores}: this process may use "
              f"{cores} CPU cores (more workers would only compete for them)", flush=True)
    return cores


def training_args(cfg: JobConfig, mode: str, out_dir: Path, cuda: bool, report_to: str, save: bool = True,
                  evaluate: bool = False, layer_classes: list[str] | None = None) -> TrainingArguments:
    """transformers' TrainingArguments of a job. With `evaluate` (there is eval data and it is a
    train run), evaluation every eval_steps (default save_steps) or epoch, and the best checkpoint
    tracked by eval loss; the dry-run times one evaluation itself (fit). A sharded job (preset F)
    gets FSDP2 over `layer_classes`, the decoder layers (sharding.fsdp_arguments)."""
    from tuneledger.sharding import fsdp_arguments

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
        dataloader_num_workers=loader_workers(cfg.dataloader_num_workers, say=os.environ.get("RANK", "0") == "0"),
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
        **fsdp_arguments(cfg, layer_classes or []),
    )
