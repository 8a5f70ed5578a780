"""`tuneledger train`: the full run, pure DDP, one process per GPU, resumable.

Checks first (preflight), then prepares the data once in this process (the ranks only load the
cache), then starts the ranks with torchrun. A run started again with the same run_name resumes
from its last complete checkpoint (`resume_from_checkpoint: auto`; `never` starts over, a path
picks one). Logs carry loss, tokens/s and the ETA; TensorBoard events go to
runs/<run_name>/tensorboard. Writes runs/<run_name>/train.json at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from datetime import datetime, timezone
from typing import Any

from tuneledger.config import describe, from_cli, resolve
from tuneledger.launch import last_checkpoint, processes, run_workers
from tuneledger.ledger import total_steps
from tuneledger.model import PreflightError
from tuneledger.data import DataError
from tuneledger.stats import prepare_eval, prepare_for_training


def run(args: argparse.Namespace) -> int:
    base = from_cli(args.items)
    cpu, nproc = processes(args.cpu, args.nproc)
    cfg = resolve(base, nproc)
    out = cfg.out_dir
    out.mkdir(parents=True, exist_ok=True)
    try:
        prep = prepare_for_training(cfg, cpu)
        eval_prep = prepare_eval(cfg)
    except (PreflightError, DataError) as e:
        print(f"tuneledger train: {e}", file=sys.stderr)
        return 1
    from tuneledger.trainer import resume_conflicts  # torch: only once a run is asked for

    resume = None if cfg.resume_from_checkpoint == "never" else (
        last_checkpoint(out) if cfg.resume_from_checkpoint == "auto" else cfg.resume_from_checkpoint)
    if resume:
        state = json.loads((Path(resume) / "trainer_state.json").read_text())
        conflicts = resume_conflicts(resume, cfg)
        if conflicts:
            print(f"tuneledger train: {resume} was trained with other settings than this run asks for:\n  "
                  + "\n  ".join(conflicts) + "\nResuming would silently train something else. Use another run_name "
                  "for the new settings, or resume_from_checkpoint=never to start this folder over.", file=sys.stderr)
            return 2
        if state.get("max_steps") and state["global_step"] >= state["max_steps"]:
            print(f"{out} is already trained: {resume} is step {state['global_step']} of {state['max_steps']}. "
                  "Use another run_name for a new run, or raise max_steps / num_train_epochs to go on.")
            return 0
        print(f"resuming from {resume} (step {state['global_step']})")
    steps = total_steps(prep.report, cfg)
    held = prep.report.get("eval_records", 0)
    print(f"data: {prep.report['records']['valid']:,} records, {prep.report['tokens']['trained']:,} tokens; "
          f"{steps:,} optimizer steps, a checkpoint every {cfg.save_steps}"
          + (f"; {held:,} records held out for evaluation (val_size={cfg.val_size:g}, seed {cfg.seed})" if held else ""))
    if cfg.evaluates:
        every = "each epoch" if cfg.eval_strategy == "epoch" else f"every {cfg.eval_steps or cfg.save_steps} steps"
        print(f"evaluation {every}, micro-batch {cfg.per_device_eval_batch_size}; the best checkpoint is the one with "
              "the lowest eval loss (make export RUN=... CHECKPOINT=best)")
    print(describe(cfg, nproc), flush=True)
    job = {"mode": "train", "config": cfg.model_dump(), "data_path": str(prep.path), "out_dir": str(out),
           "result_path": str(out / "train.json"), "cpu": cpu,
           "eval_data_path": str(eval_prep.path) if eval_prep else None}
    # GPU samples for the run's own window, as the dry-run takes them (from this launcher process).
    sampler = None
    if not cpu:
        from tuneledger.monitor import InProcessSampler

        sampler = InProcessSampler(interval=5.0, out_dir=out / "monitor").start()
    started = datetime.now(timezone.utc)
    rc = run_workers(job, out / "job.json", nproc, out / "train.log")
    rows = sampler.stop() if sampler else []
    if rc != 0:
        print(f"tuneledger train: a rank failed (exit {rc}); the log is {out / 'train.log'}. "
              "Start the same command again to resume from the last checkpoint.", file=sys.stderr)
        return rc
    result = json.loads((out / "train.json").read_text())
    if rows:
        from tuneledger.dryrun import used_gpus
        from tuneledger.monitor import summarize_window

        gpu = summarize_window(rows, started, datetime.now(timezone.utc), gpus=used_gpus(nproc))
        result["gpu_window"] = gpu
        (out / "train.json").write_text(json.dumps(result, indent=1))
        util, mem = gpu["util_mean_pct"], gpu["mem_peak_frac"]
        print(f"GPUs over the run: util {'-' if util is None else f'{util:.0f}%'} mean, memory peak "
              f"{'-' if mem is None else f'{mem:.0%}'} of the GPU{', IMBALANCED' if gpu['imbalance'] else ''}; "
              f"samples in {out / 'monitor'}")
    print(f"done: {result['global_step']} steps, mean logged loss {result['train_loss']:.4f} (last "
          f"{result['last_logged_loss']}), last checkpoint "
          f"{result['checkpoint']}{' (resumed from ' + result['resumed_from'] + ')' if result['resumed_from'] else ''}")
    if result.get("eval"):
        last = result["eval"][-1]
        print(f"eval loss {last['eval_loss']:.4f} at step {last['step']} ({len(result['eval'])} evaluations of "
              f"{result['eval_records']:,} records); best checkpoint {result['best_checkpoint'] or '- (no checkpoint at an eval step)'}"
              + (f", eval loss {result['best_eval_loss']:.4f}" if result["best_checkpoint"] else ""))
    if cfg.plot_loss and (out / "training_loss.png").is_file():
        print(f"loss plot: {out / 'training_loss.png'}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("train", help="the full DDP LoRA/QLoRA run; resumes from the last checkpoint")
    p.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]")
    p.add_argument("--nproc", type=int, help="processes (default: every visible GPU; 2 gloo processes on a CPU)")
    p.add_argument("--cpu", action="store_true", help="train on the CPU through gloo even if GPUs are visible")
    p.set_defaults(func=run)

