"""`tuneledger train`: the full run, pure DDP, one process per GPU, resumable.

Checks first (preflight), then prepares the data once in this process (the ranks only load the
cache), then starts the ranks with torchrun. A run started again with the same run_name resumes
from its last complete checkpoint (`resume_from_checkpoint: auto`; `never` starts over, a path
picks one). Logs carry loss, tokens/s and the ETA; TensorBoard events go to
runs/<run_name>/tensorboard. Writes runs/<run_name>/train.json at the end. A stop signal
(SIGTERM, Ctrl-C, SIGHUP) before any rank has trained a step ends it with one line saying so and
exit 128 + the signal (143 for SIGTERM); after that, the ranks finish their step and save.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from datetime import datetime, timezone
from typing import Any

from tuneledger import env_levers, profile_step, unsloth_backend
from tuneledger import eta as eta_
from tuneledger.checkpoints import FINAL, MANIFEST, REQUIRED, problem, publish_final, scan, set_aside, set_aside_ones
from tuneledger.config import JobConfig, describe, resolve
from tuneledger.config_load import add_preset_option, from_cli
from tuneledger.files import write_text_atomic
from tuneledger.launch import BeforeRanks, StoppedBeforeStart, processes, run_workers, used_gpus
from tuneledger.ledger import plural, total_steps
from tuneledger.model import PreflightError, locate_model, read_model_config
from tuneledger.nodes import add_arguments as add_node_arguments
from tuneledger.nodes import from_args, summary
from tuneledger.preflight_checks import check_data, checkpoint_estimate
from tuneledger.runlock import RunLock, RunLocked
from tuneledger.prepare import prepare_eval, prepare_for_training
from tuneledger.words import count_at_least


def run(args: argparse.Namespace) -> int:
    startup = {"python_start_s": eta_.process_age_s()}
    out: Path | None = None
    # A stop signal before the ranks start (the checks, the data, the checkpoint checks) is said, not
    # a silent exit 143; once torchrun runs, run_workers' own handlers stop the ranks cleanly.
    with BeforeRanks() as before:
        try:
            base = from_cli(args.items)
            nodes = from_args(args)
            locate_model(base.model_name_or_path)  # at once, before torch loads
            check_data(base)  # and a dataset that is not there
            env_levers.check()  # a bad A/B variable or profile step: one sentence here, not a traceback per rank
            cpu, nproc = processes(args.cpu, args.nproc)
            world = nodes.world_size(nproc)  # the global batch is fixed over every node's ranks
            cfg = resolve(base, world)
            if cfg.grouped_lora:  # torch is imported only for a lever that needs the check
                from tuneledger.speed import check_preset_levers
                check_preset_levers(cfg, "cpu" if cpu else "cuda")
            unsloth_backend.check_preset(cfg, "cpu" if cpu else "cuda")  # D packs, F shards: per resolved preset
            out = cfg.out_dir
            # Each node's launcher holds its own lock in the shared run folder (run.lock, run-node1.lock).
            with RunLock(out, f"run{nodes.suffix()}.lock") as lock:
                if lock.stale:
                    print(f"note: {out / 'run.lock'} was left by pid {lock.stale.get('pid')} on {lock.stale.get('host')} "
                          "(it is not running any more); taking it over")
                return _run_locked(cfg, cpu, nproc, nodes, startup, before)
        except RunLocked as e:
            print(f"tuneledger train: {e}", file=sys.stderr)
            return 1
        except StoppedBeforeStart as stop:
            before.restore()  # a second signal now ends the command as it would have before
            print(stopped_before_line(stop.name, "while preparing the checks, the data and the run folder", out),
                  file=sys.stderr, flush=True)
            return 128 + stop.signum


def stopped_before_line(signal_name: str, when: str, out: Path | None) -> str:
    """The one line of a train stopped by a signal before any rank trained a step: nothing trained,
    no checkpoint saved, and what the same command does next. Its exit is 128 + the signal's number,
    as any interrupted command's (143 for SIGTERM, 130 for Ctrl-C; docs/runs-and-output.md)."""
    good = scan(out)[0] if out is not None and out.is_dir() else None
    then = f"the same command resumes from {good.name}" if good else "the same command starts it"
    return (f"tuneledger train: stopped by {signal_name} before training began, {when}: nothing was trained and no "
            f"checkpoint was saved; {then}.")


def pick_checkpoint(cfg: JobConfig, rename_damaged: bool = True) -> tuple[str | None, str | None]:
    """(checkpoint to resume from, or None; why the run must not start, or None).

    `auto`: the newest checkpoint whose manifest verifies. Damaged newer ones are named in a
    warning and, when `rename_damaged` (node 0 of a job: the nodes share runs/, and two nodes
    renaming the same folder race), renamed to damaged-checkpoint-N (kept; never deleted). If checkpoints exist but
    none verifies, the run refuses rather than silently starting over. A path is used as given
    if it verifies (or is an old checkpoint without a manifest but with every file a resume needs).
    """
    out = cfg.out_dir
    if cfg.resume_from_checkpoint == "never":
        return None, None
    if cfg.resume_from_checkpoint != "auto":
        path = Path(cfg.resume_from_checkpoint)
        why = problem(path)
        if why and (path / MANIFEST).is_file():
            return None, f"resume_from_checkpoint={path} does not verify: {why}"
        missing = [f for f in REQUIRED if not (path / f).is_file()]
        if missing:
            return None, (f"resume_from_checkpoint={path} lacks {', '.join(missing)}: resuming would reset the "
                          "optimizer, the learning-rate schedule or the settings check")
        return str(path), None
    good, bad = scan(out)
    if good is None:
        # Never start over in a folder that holds checkpoints, damaged or set aside: the same
        # command again (a supervisor's restart, a user following the advice) must refuse again.
        aside = [p.name for p in set_aside_ones(out)]
        if bad or aside:
            lines = "\n  ".join([f"{p.name}: {why}" for p, why in bad] + [f"{n}: set aside by an earlier start" for n in aside])
            print(f"WARNING: no checkpoint in {out} verifies (none renamed, none deleted):\n  {lines}",
                  file=sys.stderr, flush=True)
            return None, (f"no checkpoint in {out} verifies, so there is nothing safe to resume from, and the folder holds "
                          f"{plural(len(bad) + len(aside), 'checkpoint')}. Start over with resume_from_checkpoint=never, or point "
                          "resume_from_checkpoint at one you trust")
    if bad:
        if rename_damaged:
            kept = [f"kept as {m.name}" for m in set_aside(bad)]
        else:
            kept = ["left for node 0 to rename"] * len(bad)
        lines = "\n  ".join(f"{p.name}: {why} -> {k}" for (p, why), k in zip(bad, kept))
        print(f"WARNING: {plural(len(bad), 'checkpoint')} in {out} {'does not verify and is' if len(bad) == 1 else 'do not verify and are'} skipped (not deleted):\n  {lines}",
              file=sys.stderr, flush=True)
    return (str(good) if good else None), None


def new_folder(cfg: JobConfig) -> str:
    """How this config names another run folder: output_dir when it sets one (LLaMA-Factory
    configs do), else run_name."""
    return "output_dir" if cfg.output_dir else "run_name"


def failure_line(rc: int, outcome: dict, stopped_cleanly: bool, out: Path, log: Path) -> str:
    """The last line of a train that did not finish: what happened, then what to do, truthfully.

    rc: torchrun's exit code (negative: killed by that signal); outcome: run_workers' outcome;
    stopped_cleanly: the ranks' own result says they stopped at a signal and saved."""
    if outcome.get("killed"):
        what = f"the ranks were killed ({outcome['killed']})"
    elif stopped_cleanly:
        # The ranks saw a signal this launcher never got: torchrun died under them (kill -9).
        what = (f"torchrun exited {rc} without this command being signalled (killed?); the ranks stopped at its "
                "signal and saved")
    else:
        cause = (outcome.get("causes") or [None])[0]
        what = f"a rank failed (exit {rc})" + (f": {cause}" if cause else "")
    good, bad = scan(out)
    aside = set_aside_ones(out)
    if good:
        then = f"The last good checkpoint is {good.name}: the same command resumes from it."
    elif bad or aside:
        then = ("No checkpoint verifies: the same command refuses; start over with resume_from_checkpoint=never, or "
                "point resume_from_checkpoint at one you trust.")
    else:
        then = "No checkpoint was saved: the same command starts over."
    return f"tuneledger train: {what.rstrip('.')}. {then} The log is {log}."


def _run_locked(cfg: JobConfig, cpu: bool, nproc: int, nodes: Any, startup: dict, before: BeforeRanks | None = None) -> int:
    world = nodes.world_size(nproc)
    out = cfg.out_dir
    try:
        prep = prepare_for_training(cfg, cpu, startup, world, ranks_here=nproc)
        eval_prep = prepare_eval(cfg)
    except PreflightError as e:  # a DataError is bad input: cli.main says it and exits 2
        print(f"tuneledger train: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 1)
    out.mkdir(parents=True, exist_ok=True)  # only now: a start that failed its checks leaves no empty run
    from tuneledger.guards import data_changes, resume_conflicts  # torch: only once a run is asked for

    resume, refusal = pick_checkpoint(cfg, rename_damaged=nodes.first)
    if refusal:
        print(f"tuneledger train: {refusal}", file=sys.stderr)
        return 2
    steps = total_steps(prep.report, cfg)
    for note in profile_step.all_notes(steps, cuda=not cpu):
        print(note, flush=True)
    if resume:
        state = json.loads((Path(resume) / "trainer_state.json").read_text())
        conflicts = resume_conflicts(resume, cfg)
        changed = data_changes(resume, prep.report["data_files"])
        if conflicts:  # and the data too, when it changed: every reason in one refusal
            print(f"tuneledger train: {resume} was trained with other settings than this run asks for:\n  "
                  + "\n  ".join(conflicts + [f"data: {c}" for c in changed])
                  + f"\nResuming would silently train something else. Use another {new_folder(cfg)} "
                  "for the new settings, or resume_from_checkpoint=never to start this folder over.", file=sys.stderr)
            return 2
        if changed and not cfg.resume_on_changed_data:
            print(f"tuneledger train: the data changed since {resume} was saved:\n  " + "\n  ".join(changed)
                  + f"\nResuming would go on training on other data than the run so far. Use another {new_folder(cfg)}, "
                  "resume_from_checkpoint=never to start over, or resume_on_changed_data=true to resume anyway.",
                  file=sys.stderr)
            return 2
        if changed:
            print("WARNING: resuming on changed data (resume_on_changed_data=true):\n  " + "\n  ".join(changed),
                  file=sys.stderr)
        # The requested length, not the checkpoint's: raising max_steps / num_train_epochs goes on.
        if state["global_step"] >= steps:
            print(f"{out} is already trained: {resume} is step {state['global_step']} of {steps}. "
                  f"Use another {new_folder(cfg)} for a new run, or raise max_steps / num_train_epochs to go on.")
            return 0
        print(f"resuming from {resume} (step {state['global_step']} of {steps})")
    held = prep.report.get("eval_records", 0)
    print(f"data: {prep.report['records']['valid']:,} records, {prep.report['tokens']['trained']:,} tokens; "
          f"{plural(steps, 'optimizer step')}, "
          + (f"a checkpoint every {cfg.save_steps} steps and at the end" if cfg.save_steps < steps
             else f"one checkpoint, at the end (save_steps={cfg.save_steps})")
          + (f"; {held:,} records held out for evaluation (val_size={cfg.val_size:g}, seed {cfg.seed})" if held else ""))
    if cfg.evaluates:
        every = "each epoch" if cfg.eval_strategy == "epoch" else f"every {cfg.eval_steps or cfg.save_steps} steps"
        print(f"evaluation {every}, micro-batch {cfg.per_device_eval_batch_size}; the best checkpoint is the one with "
              "the lowest eval loss (make export RUN=... CHECKPOINT=best)")
    print(describe(cfg, world) + (f" ({nodes.nnodes} nodes x {nproc})" if nodes.multi else ""), flush=True)
    job = {"mode": "train", "config": cfg.model_dump(), "data_path": str(prep.path), "out_dir": str(out),
           "result_path": str(out / "train.json"), "cpu": cpu, "resume": resume,
           "eval_data_path": str(eval_prep.path) if eval_prep else None,
           "data_files": prep.report["data_files"],
           "checkpoint_bytes_estimate": checkpoint_estimate(cfg, read_model_config(cfg.model_name_or_path))[0],
           # An LF config names its run by output_dir; its run_name is our default, "run".
           "progress": {"label": f"train {cfg.output_dir or cfg.run_name}", "started_wall": datetime.now(timezone.utc).timestamp()}}
    result_path = out / "train.json"
    if nodes.first:
        result_path.unlink(missing_ok=True)  # a stale one must not pass for this run's result
    # GPU samples for the run's own window, as the dry-run takes them (from this launcher process).
    sampler = None
    if not cpu:
        from tuneledger.monitor.sampler import InProcessSampler

        sampler = InProcessSampler(interval=5.0, out_dir=out / "monitor").start()
    started = datetime.now(timezone.utc)
    log = out / f"train{nodes.suffix()}.log"
    t_launch = time.time()
    outcome: dict = {}
    rc = run_workers(job, out / f"job{nodes.suffix()}.json", nproc, log, nodes, rdzv_id=cfg.run_name, outcome=outcome)
    if before is not None:
        before.restore()  # the ranks have run: the rest of the command keeps the signals' earlier handlers
    t_exit = time.time()
    rows = sampler.stop() if sampler else []
    if outcome.get("before_training") and not result_path.is_file():
        # Signalled while torchrun or the ranks were starting: the ranks stopped before any step.
        print(stopped_before_line(outcome["signal"], outcome["before_training"], out), file=sys.stderr, flush=True)
        return 128 + signal.Signals[outcome["signal"]].value
    # torchrun exits non-zero when it was signalled itself (Slurm without B: signals every process),
    # even though the ranks stopped cleanly and saved: their result says so.
    stopped_cleanly = rc != 0 and result_path.is_file() and \
        (json.loads(result_path.read_text()).get("stopped") or {}).get("reason") == "signal"
    if rc != 0 and (not stopped_cleanly or outcome.get("killed") or not outcome.get("signal")):
        print(failure_line(rc, outcome, stopped_cleanly, out, log), file=sys.stderr)
        return rc if rc > 0 else 128 - rc
    if not nodes.first:  # torchrun returns once every node's ranks are done; node 0 writes the ledger
        print(f"node {nodes.node_rank}: this node's ranks are done; node 0 completes {result_path}")
        return 0
    if not result_path.exists():
        print(f"tuneledger train: the ranks finished but {result_path} is missing: rank 0 ran on another node. "
              "runs/ must be one folder shared by every node (NFS, a PVC)", file=sys.stderr)
        return 1
    result = json.loads(result_path.read_text())
    if nodes.multi:
        result["nodes"] = summary(nodes, nproc, result, out / "nccl")
        write_text_atomic(result_path, json.dumps(result, indent=1))
        print(f"nodes: {nodes.nnodes} x {plural(nproc, 'process', 'processes')}: {', '.join(result['nodes']['hosts'])}; NCCL: "
              f"{result['nodes']['nccl'] or 'n/a (gloo, or NCCL_DEBUG set elsewhere)'}")
    stopped = result.get("stopped") or {}
    if stopped.get("reason") == "nonfinite":
        good, bad = scan(out)
        known = (f"the last good checkpoint (files, loss, grad norm and weights checked) is {good}" if good else
                 "no checkpoint is known good" + (f" ({bad[0][0].name}: {bad[0][1]})" if bad else " (none was saved)"))
        print(f"tuneledger train: loss {stopped['loss']} / grad norm {stopped['grad_norm']} at step {stopped['step']} "
              f"(finite until step {stopped['last_finite_step']}): stopped, that step not saved; {known}. Lower "
              f"learning_rate (now {cfg.learning_rate:g}) or check the data, then start over: resume_from_checkpoint=never "
              f"in {out}, or a new folder ({'output_dir' if cfg.output_dir else 'run_name'}=...).",
              file=sys.stderr)
        return 3
    total_mib = None
    if rows:
        from tuneledger.monitor.summary import summarize_window

        gpu = summarize_window(rows, started, datetime.now(timezone.utc), gpus=used_gpus(nproc))
        result["gpu_window"] = gpu
        write_text_atomic(result_path, json.dumps(result, indent=1))
        util = gpu["util_mean_pct"]
        total_mib = max((g["mem_total_mib"] or 0) for g in gpu["gpus"]) if gpu["gpus"] else None
        print(f"GPUs over the run: util {'-' if util is None else f'{util:.0f}%'} mean"
              f"{', IMBALANCED' if gpu['imbalance'] else ''}; samples in {out / 'monitor'}")
    memory = eta_.memory_line(result["ranks"], total_mib)
    if memory:
        print(memory)
    if cfg.report_to == "tensorboard" and result.get("report_to") != "tensorboard":
        print("WARNING: report_to=tensorboard, but this run wrote no TensorBoard event file; train.json says "
              "report_to: none", file=sys.stderr)
    if stopped.get("reason") == "signal":
        if result.get("checkpoint"):  # the run's root always holds its newest adapter, as `export RUN` reads it
            publish_final(Path(result["checkpoint"]), out, finished=False)
        # The signal this command got (Ctrl-C is SIGINT), not the SIGTERM it passed on to the ranks.
        print(f"stopped by {outcome.get('signal') or stopped['signal']} after step {stopped['step']}: saved {result['checkpoint']}. "
              "The same command resumes from it.")
        return 0
    print(f"done: {result['global_step']} steps; {loss_text(result)}; last checkpoint "
          f"{result['checkpoint']}{' (resumed from ' + result['resumed_from'] + ')' if result['resumed_from'] else ''}")
    if result.get("checkpoint"):
        publish_final(Path(result["checkpoint"]), out, finished=True)
        print(f"final adapter and tokenizer also at {out}/ (LLaMA-Factory's layout: adapter_model.safetensors, "
              f"adapter_config.json; {FINAL} names the checkpoint)")
    if result.get("eval"):
        last = result["eval"][-1]
        print(f"eval loss {last['eval_loss']:.4f} at step {last['step']} ({len(result['eval'])} evaluations of "
              f"{result['eval_records']:,} records); best checkpoint {result['best_checkpoint'] or '- (no checkpoint at an eval step)'}"
              + (f", eval loss {result['best_eval_loss']:.4f}" if result["best_checkpoint"] else ""))
    if cfg.plot_loss and (out / "training_loss.png").is_file():
        print(f"loss plot: {out / 'training_loss.png'}")
    try:  # bookkeeping after a finished run: its failure must not mark the run as failed
        check_eta(result, cfg, startup, prep.report, nodes.world_size(nproc), cpu, t_launch, t_exit)
    except Exception as e:  # noqa: BLE001 (any fault of the check; the run's checkpoint is already saved)
        result["eta_check"] = {"skipped": f"the ETA check failed: {type(e).__name__}: {e}"}
        print(f"warning: ETA check skipped: {type(e).__name__}: {e}", file=sys.stderr)
    write_text_atomic(result_path, json.dumps(result, indent=1))
    return 0


def loss_text(result: dict) -> str:
    """The run's one loss line: the step-weighted mean of its logged losses and the last one."""
    if result.get("train_loss") is None:
        return "no loss was logged"
    covered, steps = result.get("loss_steps_covered"), result["global_step"]
    over = f"the run's {steps} steps" if covered in (None, steps) else f"the {covered} logged of the run's {steps} steps"
    return (f"loss {result['train_loss']:.4f} (mean over {over}), last {result['last_logged_loss']:.4f} "
            f"at step {result.get('last_logged_step', steps)}")


def check_eta(result: dict, cfg: Any, startup: dict, stats: dict, nproc: int, cpu: bool, t_launch: float, t_exit: float) -> None:
    """Put this command's parts (`timing`) in the result, and beside them what the dry-run of the
    same settings (runs/<run_name>/dryrun.json) predicted (`eta_check`); print the error once."""
    row, source = eta_.find_prediction(cfg.out_dir / "dryrun.json", cfg.model_dump(), nproc, stats["cache_key"], cpu)
    # The warm-up / other steps split as the dry-run made it, so the parts compare one to one.
    warmup = row["eta"]["warmup_steps"] if row else cfg.dryrun_warmup_steps
    from tuneledger.ledger import compiled, host_probe_median

    act = eta_.actual(startup, result, t_launch, t_exit, time.time(), warmup, compiled(result["model"]),
                      wall_s=eta_.process_age_s())
    result["timing"] = act
    # Without a prediction to check, the command's own time is still worth its line.
    took = eta_.took(act["total_s"], act.get("unaccounted_s", 0.0))
    if result.get("resumed_from"):
        result["eta_check"] = {"skipped": "resumed: the dry-run predicted the whole run, this command ran part of it"}
        print(f"{took[0].upper()}{took[1:]}; no ETA check: a resumed run is part of what the dry-run predicted")
        return
    if row is None:
        result["eta_check"] = {"skipped": source}
        print(f"ETA check: none ({source}); `tuneledger dryrun` with the same settings first predicts this command; {took}")
        return
    result["eta_check"] = eta_.check(row["eta"], act, source, (row.get("host_probe_us"), host_probe_median(result["ranks"][0])))
    print(eta_.check_line(result["eta_check"]))


def add_parser(sub: Any) -> None:
    p = sub.add_parser("train", help="the full DDP LoRA/QLoRA run; resumes from the last checkpoint")
    p.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]")
    add_preset_option(p)
    p.add_argument("--nproc", type=count_at_least(1), help="processes (default: every visible GPU; 2 gloo processes on a CPU)")
    p.add_argument("--cpu", action="store_true", help="train on the CPU through gloo even if GPUs are visible")
    add_node_arguments(p)
    p.set_defaults(func=run)

