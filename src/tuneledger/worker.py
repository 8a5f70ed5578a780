"""The per-rank worker that torchrun starts: setup(), then main(), then fit().

    python -m torch.distributed.run --nproc-per-node N -m tuneledger.worker JOB.json

JOB.json is written by `tuneledger train` / `tuneledger dryrun` (launch.py) and holds the
resolved config, the path of the tokenized dataset (prepared before torchrun, so no rank ever
tokenizes) and the mode. Each rank trains with transformers' Trainer (trainer.py); rank 0 writes
the result. What guards the run is guards.py; what measures it is probes.py.

Timing (both modes, the same way): StepTimer records CUDA events (no host sync) at each
micro-batch boundary, before and after the optimizer and at step end, and reads them once after
training; wall-clock marks of the worker's phases (`timeline`) let the launcher split the command
into the ETA's parts (eta.py). In mode "dryrun" the steps are real steps of the full run, replayed
from their positions in its data order (`replay_order`).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

from tuneledger import allocator, env_levers, profile_step, unsloth_backend

unsloth_backend.import_first()  # use_unsloth: Unsloth patches transformers and peft as it imports, so first

import torch  # noqa: E402

from tuneledger import quiet  # noqa: E402
from tuneledger.checkpoints import best_checkpoint, last_checkpoint  # noqa: E402
from tuneledger.config import JobConfig  # noqa: E402
from tuneledger.files import disk_full, write_text_atomic  # noqa: E402
from tuneledger.guards import CrashAfterStep, NonFiniteGuard, SealCheckpoint, StopOnSignal  # noqa: E402
from tuneledger.launch import set_parent_death_signal  # noqa: E402
from tuneledger.ledger import compiled, run_loss  # noqa: E402
from tuneledger.nodes import check_same_nodes, host_name  # noqa: E402
from tuneledger.probes import (Clock, EvalCounter, StepTimer, SyncDebug, bench_allreduce, bench_matmul_tflops, replay_order,  # noqa: E402
                               time_warm_compile)
from tuneledger.progress import LogLine, StepProgress  # noqa: E402
from tuneledger.rows import make_collator, padding_mask_lever  # noqa: E402
from tuneledger.trainer import LedgerTrainer, LogLastStep, PlotLoss, time_loss_plot, training_args  # noqa: E402


def why_no_allocator_history(cuda: bool) -> str:
    """Why TUNELEDGER_MEMORY_STEP can record nothing in this process ("" when it can): no CUDA, or
    torch's allocator is cudaMallocAsync, asked for by either variable torch reads. The launcher
    says it once for what it can foresee (profile_step.all_notes); the ranks only what it could not."""
    if not cuda:
        return allocator.NO_CUDA
    if torch.cuda.get_allocator_backend() == "cudaMallocAsync":
        return allocator.ASYNC
    return ""


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


def peer_lost(exc: BaseException) -> bool:
    """True if `exc` says another rank went away under a collective (gloo: "Connection closed by
    peer", "Connection reset by peer"; NCCL: "remote process exited", "Broken pipe")."""
    text = str(exc)
    return any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "remote process exited",
                                   "Broken pipe"))


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
        write_text_atomic(job["result_path"], json.dumps(result, indent=1))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()  # else torch warns at exit, on every rank
    return 0


def fit(cfg: JobConfig, job: dict, device: torch.device, rank: int, report_to: str,
        stopper: StopOnSignal | None = None) -> dict:
    import datasets
    import torch.distributed as dist

    from tuneledger.model import align_special_tokens, load_model
    from tuneledger.tokenizer_load import load_tokenizer

    mode, cuda = job["mode"], device.type == "cuda"
    out_dir = Path(job["out_dir"])
    datasets.disable_progress_bars()
    # The prepared data is a sealed cache: a transform's cache file written beside it (datasets'
    # default) would make the next run call it damaged. Transforms here write to a temporary folder.
    datasets.disable_caching()
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

    seal = SealCheckpoint(cfg, job.get("data_files"), cfg.save_total_limit, dryrun=job["mode"] == "dryrun")
    seal.bytes = job.get("checkpoint_bytes_estimate")
    guard = NonFiniteGuard()
    clock = Clock(cuda)
    timer = StepTimer(clock, device)
    args = training_args(cfg, mode, out_dir, cuda, report_to, job.get("save", True), evaluate=eval_ds is not None,
                         layer_classes=info["layer_classes"])
    if cfg.sharded:
        from tuneledger.sharding import describe as sharding_line

        info["levers"]["sharding"] = sharding_line(args)
    drop_mask, line = padding_mask_lever(cfg, tokenizer)
    info["levers"]["drop_padding_mask"] = line
    trainer = LedgerTrainer(model=model, args=args, train_dataset=ds, eval_dataset=eval_ds if mode == "train" else None,
                            data_collator=make_collator(cfg, tokenizer, info["attention"]), processing_class=tokenizer,
                            callbacks=[timer, *([stopper] if stopper else []), guard, seal],
                            n_params=info["total_params"], drop_padding_mask=drop_mask)
    # The Trainer's raw log dicts: in train, LogLine prints them as lines; in a dry-run, which replays
    # steps from across the run, their eta_h and epoch contradict the dry-run's own ETA and
    # StepProgress prints what is true (disable_tqdm=True always makes PrinterCallback the printer).
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    progress = job.get("progress") or {}
    if mode == "train":  # not in a dry-run: a log is a host sync, and would land inside the measured window
        trainer.add_callback(LogLastStep())
        trainer.add_callback(LogLine(progress.get("label", f"train {cfg.run_name}")))
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
    if (step := env_levers.sync_debug_step()) and cuda:  # checked by the launcher (env_levers.check)
        trainer.add_callback(SyncDebug(step))
    if profiled := profile_step.requested():  # the launcher already refused a bad value
        from tuneledger.profile import StepProfile

        trainer.add_callback(StepProfile(profiled, out_dir, rank))
    no_history = why_no_allocator_history(cuda)
    if (recorded := profile_step.memory_requested()) and not no_history:  # likewise checked by the launcher
        from tuneledger.memory_step import MemoryStep

        trainer.add_callback(MemoryStep(recorded, out_dir, rank))
    elif recorded and rank == 0 and cuda and allocator.keeps_history(os.environ):  # else the launcher said it, once
        print(profile_step.no_history_note(recorded, no_history), flush=True)
    if os.environ.get("TUNELEDGER_CRASH_AFTER_STEP"):
        trainer.add_callback(CrashAfterStep(int(os.environ["TUNELEDGER_CRASH_AFTER_STEP"])))
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    resume = None
    if mode == "train" and cfg.resume_from_checkpoint != "never":
        # The launcher picked the verified checkpoint (and set damaged ones aside); never re-pick here.
        resume = job["resume"] if "resume" in job else last_checkpoint(out_dir)  # the launcher says which
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
        from tuneledger.compiled import compile_stats

        info["levers"]["compile_stats"] = compile_stats()
    if str(info["levers"].get("use_unsloth_gc", "")).startswith("on"):
        from tuneledger import offload

        info["levers"]["use_unsloth_gc"] += offload.measured()
    warm_compile = None
    if mode == "dryrun" and compiled(info):
        t_warm = time.perf_counter()
        warm_compile = time_warm_compile(trainer)
        timeline["warm_compile_s"] = time.perf_counter() - t_warm  # dry-run only: not part of the finish
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
        "steps": steps, "host_probe": timer.host_probe, "cum_tokens": tokens, "eval_batches": eval_counter.batches, "step_losses": step_losses,
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
    plot_timing = time_loss_plot(out_dir / ".eta-probe-loss.png", job.get("total_steps", 0) // max(1, cfg.logging_steps)) \
        if mode == "dryrun" and rank == 0 and cfg.plot_loss else None
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
        "saves": timer.saves, "timeline": timeline, "positions": positions, "warm_compile": warm_compile,
        "plot_timing": plot_timing,
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


def split_eval(ds: Any, cfg: JobConfig) -> tuple[Any, Any]:
    """(train, eval) from the prepared dataset: val_size records held out by seed (the same on
    every rank), or (ds, None)."""
    from tuneledger.data import holdout_count

    n = holdout_count(len(ds), cfg.val_size)
    if not n:
        return ds, None
    # datasets' train_test_split(seed=...) split, by its own algorithm (a permutation from
    # numpy's default_rng(seed), the first n held out), so runs and resumes hold out the same
    # records as before. It is not called: on a dataset loaded from disk it writes its index
    # mapping as cache-*.arrow into the sealed cache folder, which the next run then finds damaged
    # and tokenizes again (keep_in_memory=True is refused there). select() keeps it in memory.
    import numpy as np

    order = np.random.default_rng(cfg.seed).permutation(len(ds))
    return ds.select(order[n:]), ds.select(order[:n])


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


if __name__ == "__main__":
    try:
        code = main(sys.argv[1])
    except BaseException as e:
        if disk_full(e):
            # Each rank that meets a full disk would print some 40 lines of torch.save's and peft's
            # frames; the message (guards.DiskFullError names the checkpoint and the bytes) is what
            # the user acts on.
            print(f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
            os._exit(1)
        if peer_lost(e):
            # Another rank died (its own error is in the log): this one's 30 lines in a collective
            # say only that it was waiting for it.
            print(f"rank {os.environ.get('RANK', '?')}: stopped: another rank died while this one waited for it in a "
                  f"collective ({str(e).splitlines()[0][:120]})", file=sys.stderr, flush=True)
            os._exit(1)
        raise
    # The result is written and the process group destroyed: nothing is left to do. Interpreter
    # teardown of torch's C++ threads aborted 1 in ~10 FSDP2 runs over gloo (torch 2.13: "terminate
    # called without an active exception", SIGABRT), which failed a run that had finished; the
    # Trainer has closed its TensorBoard writer and every file is flushed by then.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
