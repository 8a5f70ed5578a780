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
import time
from pathlib import Path
from datetime import datetime, timezone
from typing import Any

from tuneledger import eta as eta_
from tuneledger.config import add_preset_option, describe, from_cli, resolve
from tuneledger.launch import last_checkpoint, processes, run_workers
from tuneledger.ledger import total_steps
from tuneledger.model import PreflightError
from tuneledger.data import DataError
from tuneledger.stats import prepare_for_training


def run(args: argparse.Namespace) -> int:
    startup = {"python_start_s": eta_.process_age_s()}
    base = from_cli(args.items)
    cpu, nproc = processes(args.cpu, args.nproc)
    cfg = resolve(base, nproc)
    out = cfg.out_dir
    out.mkdir(parents=True, exist_ok=True)
    try:
        prep = prepare_for_training(cfg, cpu, startup)
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
    print(f"data: {prep.report['records']['valid']:,} records, {prep.report['tokens']['trained']:,} tokens; "
          f"{steps:,} optimizer steps, a checkpoint every {cfg.save_steps}")
    print(describe(cfg, nproc), flush=True)
    job = {"mode": "train", "config": cfg.model_dump(), "data_path": str(prep.path), "out_dir": str(out),
           "result_path": str(out / "train.json"), "cpu": cpu}
    # GPU samples for the run's own window, as the dry-run takes them (from this launcher process).
    sampler = None
    if not cpu:
        from tuneledger.monitor import InProcessSampler

        sampler = InProcessSampler(interval=5.0, out_dir=out / "monitor").start()
    started = datetime.now(timezone.utc)
    t_launch = time.time()
    rc = run_workers(job, out / "job.json", nproc, out / "train.log")
    t_exit = time.time()
    rows = sampler.stop() if sampler else []
    if rc != 0:
        print(f"tuneledger train: a rank failed (exit {rc}); the log is {out / 'train.log'}. "
              "Start the same command again to resume from the last checkpoint.", file=sys.stderr)
        return rc
    result = json.loads((out / "train.json").read_text())
    total_mib = None
    if rows:
        from tuneledger.dryrun import used_gpus
        from tuneledger.monitor import summarize_window

        gpu = summarize_window(rows, started, datetime.now(timezone.utc), gpus=used_gpus(nproc))
        result["gpu_window"] = gpu
        util = gpu["util_mean_pct"]
        total_mib = max((g["mem_total_mib"] or 0) for g in gpu["gpus"]) if gpu["gpus"] else None
        print(f"GPUs over the run: util {'-' if util is None else f'{util:.0f}%'} mean"
              f"{', IMBALANCED' if gpu['imbalance'] else ''}; samples in {out / 'monitor'}")
    memory = eta_.memory_line(result["ranks"], total_mib)
    if memory:
        print(memory)
    print(f"done: {result['global_step']} steps, mean logged loss {result['train_loss']:.4f} (last "
          f"{result['last_logged_loss']}), last checkpoint "
          f"{result['checkpoint']}{' (resumed from ' + result['resumed_from'] + ')' if result['resumed_from'] else ''}")
    check_eta(result, cfg, startup, prep.report, nproc, cpu, t_launch, t_exit)
    (out / "train.json").write_text(json.dumps(result, indent=1))
    return 0


def check_eta(result: dict, cfg: Any, startup: dict, stats: dict, nproc: int, cpu: bool, t_launch: float, t_exit: float) -> None:
    """Put this command's parts (`timing`) in the result, and beside them what the dry-run of the
    same settings (runs/<run_name>/dryrun.json) predicted (`eta_check`); print the error once."""
    row, source = eta_.find_prediction(cfg.out_dir / "dryrun.json", cfg.model_dump(), nproc, stats["cache_key"], cpu)
    # The warm-up / other steps split as the dry-run made it, so the parts compare one to one.
    warmup = row["eta"]["warmup_steps"] if row else cfg.dryrun_warmup_steps
    act = eta_.actual(startup, result, t_launch, t_exit, time.time(), warmup)
    result["timing"] = act
    if result.get("resumed_from"):
        result["eta_check"] = {"skipped": "resumed: the dry-run predicted the whole run, this command ran part of it"}
        return
    if row is None:
        result["eta_check"] = {"skipped": source}
        print(f"ETA check: none ({source}); `tuneledger dryrun` with the same settings first predicts this command")
        return
    result["eta_check"] = eta_.check(row["eta"], act, source)
    print(eta_.check_line(result["eta_check"]))


def add_parser(sub: Any) -> None:
    p = sub.add_parser("train", help="the full DDP LoRA/QLoRA run; resumes from the last checkpoint")
    p.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]")
    add_preset_option(p)
    p.add_argument("--nproc", type=int, help="processes (default: every visible GPU; 2 gloo processes on a CPU)")
    p.add_argument("--cpu", action="store_true", help="train on the CPU through gloo even if GPUs are visible")
    p.set_defaults(func=run)

