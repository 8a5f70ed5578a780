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
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from tuneledger.config import JobConfig
from tuneledger.launch import last_checkpoint


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
        return super().training_step(model, inputs, num_items_in_batch)

    # Resuming on the pinned torch 2.5.1: see trusted_torch_load.
    def _load_optimizer_and_scheduler(self, checkpoint):
        with trusted_torch_load(checkpoint, self.args.output_dir):
            return super()._load_optimizer_and_scheduler(checkpoint)

    def _load_rng_state(self, checkpoint):
        with trusted_torch_load(checkpoint, self.args.output_dir):
            return super()._load_rng_state(checkpoint)

    def floating_point_ops(self, inputs) -> int:
        return 6 * self.n_params * inputs["input_ids"].numel()

    def log(self, logs: dict, *args, **kw) -> None:
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


class TokenSnapshot(TrainerCallback):
    """Keeps the trainer's running token count at every step end (a device tensor, no sync)."""

    def __init__(self, trainer: LedgerTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kw):
        self.trainer.step_tokens.append(self.trainer.tokens.clone())


# What a checkpoint's training depends on: resuming with another value of any of these would
# silently train something else (another global batch shifts the schedule and the epoch count).
# max_steps and num_train_epochs may change: raising them is how a finished run goes on.
RESUME_KEYS = ("model_name_or_path", "dataset", "template", "default_system", "cutoff_len", "placeholders",
               "max_samples", "quantization_bit", "quantization_type", "double_quantization", "lora_rank",
               "lora_alpha", "lora_dropout", "lora_target", "global_batch_size", "learning_rate",
               "lr_scheduler_type", "warmup_ratio", "seed")
CONFIG_IN_CHECKPOINT = "tuneledger_config.json"


class SaveConfig(TrainerCallback):
    """Writes the run's resolved config into every checkpoint, so a resume can be checked against it."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg

    def on_save(self, args, state, control, **kw):
        if state.is_world_process_zero:
            ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if ckpt.is_dir():
                (ckpt / CONFIG_IN_CHECKPOINT).write_text(json.dumps(self.cfg.model_dump(), indent=1, ensure_ascii=False))


def resume_conflicts(checkpoint: str | Path, cfg: JobConfig) -> list[str]:
    """Settings of `cfg` that differ from those the checkpoint was trained with (RESUME_KEYS)."""
    saved_path = Path(checkpoint) / CONFIG_IN_CHECKPOINT
    if not saved_path.is_file():
        return []
    saved, now = json.loads(saved_path.read_text()), cfg.model_dump()
    return [f"{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}" for k in RESUME_KEYS if saved.get(k) != now.get(k)]


class CrashAfterStep(TrainerCallback):
    """Fault injection for the resume test: TUNELEDGER_CRASH_AFTER_STEP=N kills the process
    (os._exit, no cleanup, like a machine shutdown) once step N and its checkpoint are done."""

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step == self.step:
            os._exit(3)


# ------------------------------------------------------------------------------------ pieces
def make_collator(cfg: JobConfig, tokenizer: Any) -> Any:
    """Padded micro-batches (DataCollatorForSeq2Seq), or padding-free packing of whole samples.

    Packing (DataCollatorWithFlattening) concatenates the micro-batch into one row with
    `position_ids` restarting at 0 per sample and no attention mask; transformers 5 detects the
    boundaries from position_ids (SDPA and flash_attention_2), so no sample attends to another.
    """
    if cfg.packing:
        from transformers import DataCollatorWithFlattening

        return DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)
    from transformers import DataCollatorForSeq2Seq

    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)


def training_args(cfg: JobConfig, mode: str, out_dir: Path, cuda: bool, report_to: str, save: bool = True) -> TrainingArguments:
    dryrun = mode == "dryrun"
    # transformers 5 takes the TensorBoard directory from the environment only.
    os.environ.setdefault("TENSORBOARD_LOGGING_DIR", str(out_dir / "tensorboard"))
    return TrainingArguments(
        output_dir=str(out_dir),
        per_device_train_batch_size=cfg.per_device_train_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        learning_rate=cfg.learning_rate,
        lr_scheduler_type=cfg.lr_scheduler_type,
        warmup_steps=cfg.warmup_ratio,  # transformers 5: a float in [0, 1) is a ratio of total steps
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
        save_total_limit=cfg.save_total_limit,
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
        disable_tqdm=dryrun,
        save_only_model=False,
        run_name=cfg.run_name,
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


@contextlib.contextmanager
def trusted_torch_load(checkpoint: str | None, out_dir: str):
    """Let torch < 2.6 load the optimizer, scheduler and RNG state of this run's own checkpoint.

    transformers 5 refuses torch.load below torch 2.6 because of CVE-2025-32434 (a crafted .pt
    file can run code even with weights_only=True). The pinned image runs torch 2.5.1, so without
    this no run could resume. The refusal is lifted only while loading a checkpoint inside this
    run's own output_dir; any other file still refuses. torch 2.5 also cannot map to the device
    string "cpu:N" that multi-process CPU runs use, so that is mapped to "cpu"; and it needs
    numpy's RNG-state types allow-listed, as transformers does itself from torch 2.6 on.
    """
    import numpy as np
    from packaging.version import Version

    import transformers.trainer as hf_trainer

    old_torch = Version(torch.__version__.split("+")[0]) < Version("2.6")
    own = checkpoint is not None and Path(checkpoint).resolve().is_relative_to(Path(out_dir).resolve())
    if not (old_torch and own):
        yield
        return
    saved_check, saved_load = hf_trainer.check_torch_load_is_safe, torch.load

    def load(f, map_location=None, **kw):
        if isinstance(map_location, torch.device) and map_location.type == "cpu":
            map_location = "cpu"
        return saved_load(f, map_location=map_location, **kw)

    hf_trainer.check_torch_load_is_safe, torch.load = (lambda: None), load
    np_core = getattr(np, "_core", None) or np.core
    numpy_types = [np_core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(numpy_types):
            yield
    finally:
        hf_trainer.check_torch_load_is_safe, torch.load = saved_check, saved_load


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
    report_to = resolve_report_to(cfg, rank)  # before the model loads, so it cannot fail after
    result = fit(cfg, job, device, rank, report_to)
    result["timeline"]["main"] = started
    if rank == 0:
        Path(job["result_path"]).write_text(json.dumps(result, indent=1))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()  # else torch warns at exit, on every rank
    return 0


def fit(cfg: JobConfig, job: dict, device: torch.device, rank: int, report_to: str) -> dict:
    import datasets
    import torch.distributed as dist

    from tuneledger.model import load_model, load_tokenizer

    mode, cuda = job["mode"], device.type == "cuda"
    out_dir = Path(job["out_dir"])
    datasets.disable_progress_bars()
    ds = datasets.load_from_disk(job["data_path"]).select_columns(["input_ids", "labels"])
    tokenizer = load_tokenizer(cfg.model_name_or_path)
    t0 = time.perf_counter()
    model, info = load_model(cfg, device)
    info["load_s"] = round(time.perf_counter() - t0, 2)
    timeline = {"model_loaded": time.time()}

    clock = Clock(cuda)
    timer = StepTimer(clock, device)
    trainer = LedgerTrainer(model=model, args=training_args(cfg, mode, out_dir, cuda, report_to, job.get("save", True)), train_dataset=ds,
                            data_collator=make_collator(cfg, tokenizer), processing_class=tokenizer,
                            callbacks=[timer, SaveConfig(cfg)], n_params=info["total_params"])
    positions = None
    if mode == "dryrun" and job.get("total_steps"):
        t_order = time.perf_counter()
        positions = replay_order(trainer, ds, job["total_steps"], job["steps_per_epoch"], cfg.dryrun_warmup_steps,
                                 cfg.dryrun_steps - cfg.dryrun_warmup_steps)
        timeline["order_s"] = time.perf_counter() - t_order  # dry-run only: not part of the ETA's set-up
    if os.environ.get("TUNELEDGER_CRASH_AFTER_STEP"):
        trainer.add_callback(CrashAfterStep(int(os.environ["TUNELEDGER_CRASH_AFTER_STEP"])))
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    resume = None
    if mode == "train" and cfg.resume_from_checkpoint != "never":
        resume = last_checkpoint(out_dir) if cfg.resume_from_checkpoint == "auto" else cfg.resume_from_checkpoint
        if resume and rank == 0:
            print(f"resuming from {resume}", flush=True)
    wall0 = time.perf_counter()
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

    steps = timer.summary()
    tokens = [int(t) for t in torch.stack(trainer.step_tokens).tolist()] if trainer.step_tokens else []
    local = {
        "rank": rank, "device": str(device),
        "gpu_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "peak_allocated_mib": round(torch.cuda.max_memory_allocated(device) / 2**20) if cuda else None,
        "peak_reserved_mib": round(torch.cuda.max_memory_reserved(device) / 2**20) if cuda else None,
        "alloc_retries": torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if cuda else 0,
        "memory_cap_gib": cfg.memory_cap_gib,
        "steps": steps, "cum_tokens": tokens,
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
    # transformers' training_loss divides the resumed part's loss sum by every step, so after a
    # resume it reads low; the logged losses cover the whole run (the history is restored too).
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {
        "mode": mode, "world_size": world, "model": info, "wall_s": wall, "global_step": out.global_step,
        "train_loss": sum(logged) / len(logged) if logged else out.training_loss,
        "last_logged_loss": logged[-1] if logged else None, "ranks": per_rank, "save_s": timer.save_s, "checkpoint": ckpt,
        "checkpoint_bytes": ckpt_bytes, "allreduce": allreduce, "report_to": report_to,
        "config": cfg.model_dump(), "resumed_from": resume, "peak_tflops": peak,
        "saves": timer.saves, "timeline": timeline, "positions": positions,
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
