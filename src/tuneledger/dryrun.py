"""`tuneledger dryrun`: a real training run of N optimizer steps per preset, measured, with an ETA.

For each preset (A-D, or `--preset all`), on every visible GPU through torchrun (gloo processes
on a CPU): load the model as training would, train `dryrun_steps` steps, time each part, save one
real checkpoint, and predict the whole `train` command (eta.py): its start-up as measured here,
the run's own first steps, then real steps of the run drawn across it, saves and teardown. `all`
ranks the presets by measured tokens/s, because the field report's author predicted B and C would
halve the time and measurement proved him wrong.

Writes runs/<run_name>/dryrun.json and dryrun.md (versions, GPUs, topology, config, data hash);
how the ledger reads, in dryrun.md and the terminal, is dryrun_report.py.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tuneledger import unsloth_backend
from tuneledger import eta as eta_
from tuneledger import env_levers, profile_step
from tuneledger import ledger
from tuneledger.checkpoints import time_publish
from tuneledger.config import DDP_PRESETS, ConfigError, JobConfig, describe, resolve
from tuneledger.config_load import add_preset_option, from_cli
from tuneledger.dryrun_report import finding, markdown, print_table
from tuneledger.dryrun_row import entry, verdict
from tuneledger.files import says_disk_full, write_text_atomic
from tuneledger.machine_facts import topology, versions
from tuneledger.launch import BeforeRanks, SignalHold, StoppedBeforeStart, Terminated, processes, run_workers, sigterm_raises
from tuneledger.ledger import CAP_24GB_GIB
from tuneledger.model import PreflightError, locate_model
from tuneledger.model_location import synthetic_model
from tuneledger.dryrun_keep import (earlier_presets, keep_earlier_log, kept_log_words, mark_log, put_back,
                                    put_back_earlier, start_log)
from tuneledger.preflight_checks import check_data
from tuneledger.nodes import Nodes, from_args, summary
from tuneledger.nodes import add_arguments as add_node_arguments
from tuneledger.data_report import run_data_hash
from tuneledger.prepare import load_prepared, prepare_eval, prepare_for_training
from tuneledger.runlock import RunLock, RunLocked
from tuneledger.sharding import peak_by_world
from tuneledger.words import count_at_least



# A preset row's `skipped` when its run met a full disk (measure_presets); _run reads it back.
DISK_FULL = "disk full: "


def preset_config(items: list[str], preset: str) -> JobConfig:
    # The preset sits between the file and the user's own key=value overrides.
    return from_cli([i for i in items if not i.startswith("preset=")] + [f"preset={preset}"])


def run_one(cfg: JobConfig, prep_path: Path, nproc: int, cpu: bool, out_root: Path, log: Path,
            cap_gib: float | None = None, nodes: Nodes = Nodes(), progress: dict | None = None,
            eval_path: Path | None = None, stats: dict | None = None
            ) -> tuple[int, dict | None, bool, str | None]:
    """One torchrun of the worker in dry-run mode; returns (exit code, result or None, ran out of
    memory, the failed rank's disk-full error or None).

    With `cap_gib`, each process's CUDA allocator is capped there (the 24 GB-card proof). With
    several nodes, only node 0 clears the (shared) preset folder; the others keep their job file
    beside it, where that cannot delete it. `progress` goes to the worker's step lines
    (progress.StepProgress). With `stats`, the worker replays the real run's steps (its first ones,
    then some across the run); the result gets the launcher's start and exit times (`launcher`)
    for the ETA's parts. The preset's earlier folder (its result.json) is kept until this run has
    succeeded, also through Ctrl-C, SIGTERM or (at the next run) a kill -9; a failed run's folder
    is left beside it as `<preset>.failed` until the preset is measured again.
    """
    name = f"{cfg.preset}{'-cap' if cap_gib else ''}"
    run_dir = out_root / "dryrun" / name
    earlier, failed = run_dir.with_name(f"{name}.earlier"), run_dir.with_name(f"{name}.failed")
    if nodes.first:
        shutil.rmtree(earlier, ignore_errors=True)  # (put back at the dry-run's start: put_back_earlier)
        if run_dir.exists():
            run_dir.rename(earlier)  # a rename: it needs no room on a full disk
    if cap_gib:
        cfg = cfg.model_copy(update={"memory_cap_gib": cap_gib})
    job = {"mode": "dryrun", "config": cfg.model_dump(), "data_path": str(prep_path), "out_dir": str(run_dir),
           "result_path": str(run_dir / "result.json"), "cpu": cpu, "eval_data_path": str(eval_path) if eval_path else None,
           "progress": {**(progress or {}), "started_wall": datetime.now(timezone.utc).timestamp()}}
    job_path = run_dir / "job.json" if nodes.first else out_root / "dryrun" / f"job-{name}{nodes.suffix()}.json"
    if stats:
        job.update(total_steps=ledger.total_steps(stats, cfg), steps_per_epoch=stats["steps_per_epoch"])
    t_launch = time.time()
    outcome: dict = {}
    try:
        rc = run_workers(job, job_path, nproc, log, nodes, rdzv_id=f"{cfg.run_name}-dryrun-{name}", outcome=outcome)
    except BaseException:  # Ctrl-C or SIGTERM mid-preset: the earlier result goes back where it was
        if nodes.first and earlier.exists():
            put_back(earlier, run_dir, failed)
        raise
    t_exit = time.time()
    result = json.loads((run_dir / "result.json").read_text()) if rc == 0 and (run_dir / "result.json").exists() else None
    if result is not None:
        result["launcher"] = {"t_launch": t_launch, "t_exit": t_exit, "publish_s": time_publish(run_dir)}
    # The checkpoint was written only to be timed and weighed; its size is in the result.
    for ckpt in run_dir.glob("checkpoint-*"):
        shutil.rmtree(ckpt, ignore_errors=True)
    oom = any(run_dir.glob("oom-rank*.json"))
    if nodes.first and result is None and earlier.exists():
        put_back(earlier, run_dir, failed)
    elif nodes.first and result is not None:
        shutil.rmtree(earlier, ignore_errors=True)
        shutil.rmtree(failed, ignore_errors=True)  # an older failure, now measured
    full = next((c for c in outcome.get("causes") or [] if says_disk_full(c)), None)
    return rc, result, oom, full


def plan(items: list[str], names: list[str], world: int, device_type: str = "cuda") -> list[tuple[str, JobConfig | ConfigError]]:
    """Each preset's resolved config, or the config error that rules it out at this world size
    (or, on `device_type`, a lever its own settings cannot run: speed.check_preset_levers)."""
    out: list[tuple[str, JobConfig | ConfigError]] = []
    base = from_cli(items)
    if base.batch_from_accumulation:
        # A LLaMA-Factory config gives the accumulation: its global batch is fixed from the config's own
        # micro-batch, so the presets (other micro-batches) are compared at the same global batch.
        items = [*items, f"global_batch_size={resolve(base, world).global_batch_size}", "gradient_accumulation_steps=null"]
    for name in names:
        try:
            cfg = resolve(preset_config(items, name), world)
            if cfg.grouped_lora:  # true only (unset runs where it applies): torch is imported only for a lever that needs the check
                from tuneledger.speed import check_preset_levers
                check_preset_levers(cfg, device_type, name)
            unsloth_backend.check_preset(cfg, device_type, name)  # D packs, F shards: per resolved preset
            out.append((name, cfg))
        except ConfigError as e:
            out.append((name, e))
    return out


def measure_presets(args: argparse.Namespace, planned: list[tuple[str, JobConfig | ConfigError]], nproc: int, cpu: bool,
                    prep: Any, stats: dict, out_root: Path, log: Path, rows: list[dict], results: dict,
                    nodes: Nodes = Nodes(), eval_path: Path | None = None,
                    startup: dict | None = None) -> None:
    """Run each preset, appending its ledger row to `rows` and its raw result to `results`.
    nproc: this node's processes; the world size is nodes x nproc."""
    world = nodes.world_size(nproc)
    runnable = [name for name, cfg in planned if not isinstance(cfg, ConfigError)]
    for name, cfg in planned:
        if isinstance(cfg, ConfigError):
            print(f"preset {name}: skipped: {cfg}")
            rows.append({"preset": name, "skipped": str(cfg)})
            continue
        index = runnable.index(name) + 1
        print(f"\n=== [{index}/{len(runnable)}] {describe(cfg, world)}", flush=True)
        # The step lines' estimate covers this preset only (progress.py says why), and counts those after it.
        progress = {"label": f"dry-run preset {name} ({index} of {len(runnable)})", "later_presets": len(runnable) - index}
        started = datetime.now(timezone.utc)
        # The 24 GB proof costs nothing extra: the measured run itself runs under the cap, and only
        # a preset that runs out of memory there is run again uncapped for its throughput.
        fit_check = not cpu and not args.no_fit_check
        rc, result, oom, full = run_one(cfg, prep.path, nproc, cpu, out_root, log, cap_gib=CAP_24GB_GIB if fit_check else None,
                                        nodes=nodes, progress=progress, eval_path=eval_path, stats=stats)
        if fit_check and oom:
            print(f"preset {name}: out of memory under the {CAP_24GB_GIB:g} GiB cap: does not fit a 24 GB card; "
                  "measuring again uncapped", flush=True)
            started = datetime.now(timezone.utc)
            rc, result, _, full = run_one(cfg, prep.path, nproc, cpu, out_root, log, nodes=nodes, progress=progress,
                                          eval_path=eval_path, stats=stats)
        ended = datetime.now(timezone.utc)
        if full:
            # The presets after it would meet the same full disk after their model load: say it once.
            later = runnable[index:]
            print(f"preset {name}: the disk is full (the worker error above)"
                  + (f"; {', '.join(later)} after it {'is' if len(later) == 1 else 'are'} not measured" if later else ""),
                  flush=True)
            rows.append({"preset": name, "skipped": DISK_FULL + full})
            rows += [{"preset": n, "skipped": "not measured: the disk was full"} for n in later]
            return
        if result is None:
            print(f"preset {name}: worker failed (exit {rc}); see {log}")
            rows.append({"preset": name, "skipped": f"worker failed with exit code {rc}, see {log}"})
            continue
        row = entry(cfg, result, stats, world, startup)
        row["run_utc"] = [started.isoformat(), ended.isoformat()]
        peak_gib = max((m["peak_allocated"] or 0) for m in row["memory_mib"]) / 1024
        if cpu:
            row["fits_24gb"], row["fits_24gb_note"] = None, "n/a (CPU)"
        elif not fit_check:
            row["fits_24gb"], row["fits_24gb_note"] = None, f"unproved ({peak_gib:.1f} GiB peak, --no-fit-check)"
        elif oom:
            row["fits_24gb"], row["fits_24gb_note"] = False, f"no (out of memory under {CAP_24GB_GIB:g} GiB; needs {peak_gib:.1f})"
        else:
            row["fits_24gb"], row["fits_24gb_note"] = True, f"yes (ran under a {CAP_24GB_GIB:g} GiB cap)"
            retries = max(r.get("alloc_retries") or 0 for r in result["ranks"])
            if retries:
                row["fits_24gb_note"] += f"; {retries} allocator retries: the cap slowed it"
        row["world_size"] = world
        # a measured step with the profiler or the allocator history on: slower than the others
        row.update(profile_step.measured_steps(cfg.dryrun_warmup_steps, cfg.dryrun_steps, cuda=not cpu))
        row["per_gpu_peak"] = peak_by_world(row)  # DDP's measured beside F's predicted (sharding.py)
        rows.append(row)
        results[name] = result
        sp = row["step_spread"]
        print(f"preset {name}: {row['s_per_step']:.3f} s/step (median; p10-p90 {sp['p10']:.3f}-{sp['p90']:.3f}), "
              f"{row['tokens_per_s']:,.0f} tokens/s ({row['tokens_per_s_per_gpu']:,.0f}/GPU), "
              f"ETA of `train` {eta_.fmt_eta(row['eta'])}: {eta_.fmt_parts(row['eta'])}", flush=True)
        memory = eta_.memory_line(result["ranks"], None)
        if memory:
            print(f"preset {name}: {memory}", flush=True)
        if row["fits_24gb"] and row["alloc_retries"]:
            print(f"preset {name}: measured under the {CAP_24GB_GIB:g} GiB cap with {row['alloc_retries']} allocator retries: "
                  "its s/step may read slower than an uncapped train; --no-fit-check measures it uncapped", flush=True)


def run(args: argparse.Namespace) -> int:
    # A stop signal while the checks and the data are prepared is said, not a silent exit 143 (as
    # train does); from the first preset on, run_workers' handlers and the partial ledger take over.
    with BeforeRanks() as before:
        try:
            # One dry-run per run folder at a time (train's run.lock is its own): two would write one ledger.
            base, nodes = from_cli(args.items), from_args(args)
            with RunLock(base.out_dir, f"dryrun{nodes.suffix()}.lock",
                         "Two dry-runs in one run directory overwrite each other's ledger (dryrun.json, .md, .log)."):
                with SignalHold() as hold:
                    rc = _run(args, base, nodes, before, hold)
                if hold.held:  # it came after the last preset: the ledger was written first
                    print(f"{signal.Signals(hold.held[0]).name} after the last preset: the ledger was written first", flush=True)
                    return 128 + hold.held[0]
                return rc
        except RunLocked as e:
            print(f"tuneledger dryrun: {e}", file=sys.stderr)
            return 1
        except StoppedBeforeStart as stop:
            before.restore()
            print(f"tuneledger dryrun: stopped by {stop.name} before any preset ran, while preparing the checks and the "
                  "data: nothing was measured and the last ledger is unchanged; the same command starts it again",
                  file=sys.stderr, flush=True)
            return 128 + stop.signum


def _run(args: argparse.Namespace, base: JobConfig, nodes: Nodes, before: BeforeRanks, hold: SignalHold) -> int:
    startup = {"python_start_s": eta_.process_age_s()}
    locate_model(base.model_name_or_path)  # at once, before torch loads
    check_data(base)  # and a dataset that is not there
    env_levers.check()  # a bad A/B variable or profile step: one sentence here, not a traceback per rank
    cpu, nproc = processes(args.cpu, args.nproc)
    for note in profile_step.all_notes(base.dryrun_steps, base.dryrun_warmup_steps, cuda=not cpu):
        print(note, flush=True)
    world = nodes.world_size(nproc)  # accumulation, MFU and tokens/s per GPU are for the whole job
    names = list(DDP_PRESETS) if args.preset == "ALL" else [args.preset or base.preset or "A"]
    device_type = "cpu" if cpu else "cuda"
    planned = plan(args.items, names, world, device_type)
    errors = [cfg for _, cfg in planned if isinstance(cfg, ConfigError)]
    if len(errors) == len(planned):  # nothing to measure: say why, and leave the last ledger alone
        raise errors[0]
    out_root = base.out_dir
    try:
        prep = prepare_for_training(base, cpu, startup, world, dryrun=True, ranks_here=nproc,
                                    jobs=[cfg for _, cfg in planned if not isinstance(cfg, ConfigError)])
        if not prep.from_cache:
            # The train after this dry-run finds the cache made now: time that load, not the tokenizing.
            t0 = time.perf_counter()
            load_prepared(base, model_checked=True)
            startup["data_s"] = time.perf_counter() - t0
        eval_prep = prepare_eval(base)
    except PreflightError as e:  # a DataError is bad input: cli.main says it and exits 2
        print(f"tuneledger dryrun: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 1)
    stats = prep.report
    owner = run_data_hash(out_root, training_only=True)
    if owner and owner[0] != stats["cache_key"]:
        print(f"tuneledger dryrun: {out_root} is a training run on data {owner[0]} ({owner[1]}), and this dry-run's data "
              f"is {stats['cache_key']}. A run directory belongs to one data hash: give this one another run_name "
              "(RUN=<name>).", file=sys.stderr)
        return 2  # refused as train refuses changed data
    print(f"data: {stats['records']['valid']:,} valid records, {stats['tokens']['trained']:,} tokens, "
          f"{stats['steps_per_epoch']:,} steps/epoch (cache {prep.path})")
    out_root.mkdir(parents=True, exist_ok=True)  # only now: a start that failed its checks leaves no empty run
    log = out_root / f"dryrun{nodes.suffix()}.log"
    if nodes.first:
        put_back_earlier(out_root / "dryrun")
    earlier_log = start_log(log, out_root / "dryrun.json", nodes.first)  # the ledger's log kept readable
    topo = topology() if not cpu else {"link": "n/a (CPU, gloo)", "matrix": ""}
    # NVML from this (launcher) process: it holds no CUDA context, sees every GPU, and its rows go
    # to the same daily CSV the monitor sidecar writes, for `tuneledger monitor plot`.
    sampler = None
    if not cpu:
        from tuneledger.monitor.sampler import InProcessSampler

        sampler = InProcessSampler(interval=0.5, out_dir=out_root / "monitor").start()
    rows, results = [], {}
    before.restore()  # the presets' own stop (run_workers) and the partial ledger from here
    stopped = ""  # Ctrl-C or SIGTERM: the ledger of the presets that finished is still written
    try:
        with sigterm_raises():
            measure_presets(args, planned, nproc, cpu, prep, stats, out_root, log, rows, results, nodes,
                            eval_prep.path if eval_prep else None, startup)
            fits = [r.get("fits_24gb") for r in rows if "s_per_step" in r]
            if args.preset == "ALL" and fits and all(f is False for f in fits):
                # No whole copy per GPU fits a 24 GB card: measure the sharded preset beside them.
                print("\nno DDP preset fits a 24 GB card: measuring preset F (FSDP2, the model sharded over the GPUs)", flush=True)
                names.append("F")
                measure_presets(args, plan(args.items, ["F"], world, device_type), nproc, cpu, prep, stats, out_root, log,
                                rows, results, nodes, eval_prep.path if eval_prep else None, startup)
    except KeyboardInterrupt:
        stopped = "interrupted"
    except (Terminated, SystemExit) as e:  # run_workers turns SIGTERM into SystemExit(143)
        if isinstance(e, SystemExit) and e.code != 143:
            raise
        stopped = "terminated (SIGTERM)"
    hold.start()  # what was measured becomes the ledger before any stop
    done = [r for r in rows if "s_per_step" in r]
    samples = sampler.stop() if sampler else []
    # A stopped command's code (docs/runs-and-output.md): 143 for SIGTERM, 130 for Ctrl-C, as a shell reports them.
    # A full disk stopped the presets: a failed command, whatever was measured before it.
    full = next((r["preset"] for r in rows if str(r.get("skipped", "")).startswith(DISK_FULL)), None)
    rc = 143 if stopped.startswith("terminated") else 130 if stopped == "interrupted" else 0 if done and not full else 1
    if stopped:
        rows += [{"preset": n, "skipped": stopped} for n in names if n not in {r["preset"] for r in rows}]
        if not done and (out_root / "dryrun.json").exists():  # an earlier, whole ledger is worth more than none
            print(f"\n{stopped}: no preset finished; {out_root / 'dryrun.json'} is left as it was"
                  f"{kept_log_words(log, keep_earlier_log(log, earlier_log))}", flush=True)
            return rc
        print(f"\n{stopped}: " + ("writing the ledger of the presets measured so far" if done else
                                  "no preset finished; writing a ledger that says so (there is no earlier one to keep)"), flush=True)
    elif (not done or full) and (out_root / "dryrun.json").exists() and nodes.first:
        # Every preset failed, or the disk filled (each said why above): the earlier, whole ledger
        # stays; this run's rows go beside it, so a fix can be checked against them.
        failed, moved = out_root / "dryrun.failed.json", keep_earlier_log(log, earlier_log)
        text = json.dumps({"presets": rows}, indent=1, ensure_ascii=False, default=str)
        if moved:  # the rows' "see .../dryrun.log" now means this run's log where it went
            text = text.replace(json.dumps(str(log))[1:-1], json.dumps(str(moved))[1:-1])
        what = f"the disk filled during preset {full}" if full else "no preset was measured"
        # Said before the rows are written: on a full disk that write fails, and the logs have moved.
        print(f"\n{what}; {out_root / 'dryrun.json'} is left as it was{kept_log_words(log, moved)}", flush=True)
        write_text_atomic(failed, text)
        print(f"this run's rows are in {failed}", flush=True)
        return rc
    if not nodes.first:
        print(f"node {nodes.node_rank}: {ledger.plural(len(done), 'preset')} ran; node 0 writes the ledger {out_root / 'dryrun.json'}")
        return rc
    for r in done:
        r.update(verdict(r, samples, nproc, cpu))
    first = next(iter(results.values()), None)
    led = {
        "run_name": base.run_name, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "model": base.model_name_or_path,
        # No preset row (stopped before any finished): the model's own config says it (synth.py's marker).
        "synthetic": bool(first["model"]["synthetic"]) if first else synthetic_model(base.model_name_or_path),
        "world_size": world, "backend": "gloo" if cpu else "nccl",
        "gpu": first["ranks"][0]["gpu_name"] if first else ("cpu" if cpu else "?"),
        "topology": topo, "versions": versions(cpu), "dataset": base.dataset, "data_hash": stats["cache_key"],
        "data_files": stats["data_files"], "stats": stats, "global_batch_size": base.global_batch_size,
        "dryrun_steps": base.dryrun_steps, "warmup_steps": base.dryrun_warmup_steps,
        "config": base.model_dump(), "presets": rows, "finding": finding(rows),
        "windows": [{"label": f"preset {r['preset']}", "start": r["window_utc"][0], "end": r["window_utc"][1]} for r in done],
        "verdicts": {r["preset"]: r["diagnosis"]["line"] + " Lever: " + r["diagnosis"]["lever"] for r in done},
    }
    if nodes.multi:
        first_dir = out_root / "dryrun" / (done[0]["preset"] if done else "-")
        led["nodes"] = summary(nodes, nproc, first, first_dir / "nccl")
    png = pictures(led, rows, samples, out_root, f"dry-run {base.run_name}: {world} x")
    dropped = earlier_presets(out_root / "dryrun.json") - {r["preset"] for r in done}
    mark_log(log, led["date"])  # first: a run stopped between the two leaves no ledger with an unmarked log
    ledger.write(out_root, "dryrun", led, markdown(led))
    if dropped:
        print(f"note: the earlier dryrun.json measured {', '.join(sorted(dropped))} too; this one replaces it and holds "
              f"{', '.join(r['preset'] for r in done) or 'none'} (--preset all measures every preset)", flush=True)
    print()
    print_table(led)
    wrote = [out_root / "dryrun.json", out_root / "dryrun.md", *([png] if png else [])]
    print(f"wrote {', '.join(map(str, wrote))} and {log}")
    if full:
        print(f"the disk filled during preset {full}: the ledger holds the presets measured before it; free space "
              "(`df -h`) and run the same command again", flush=True)
    print(f"dry-run: {eta_.took(eta_.process_age_s())}")  # held against the shell's `time`, as train's is
    return rc


def pictures(led: dict, rows: list[dict], samples: list[dict], out_root: Path, title: str) -> Path | None:
    """The dry-run's two pictures beside its ledger: dryrun-gpus.png (the GPU sampler's rows, one
    window per preset; only when NVML gave rows) and dryrun.png (the presets compared). Sets
    led["plot"] and led["comparison_plot"] to the paths drawn; returns dryrun.png's path or None.
    A picture that cannot be drawn is a warning, never an error (plots.picture)."""
    from tuneledger.plots import dryrun_plot, picture

    if samples and any(s.get("status") == "ok" for s in samples):
        from tuneledger.monitor.plot import plot
        from tuneledger.monitor.rows import parse_time

        png = out_root / "dryrun-gpus.png"
        windows = [(w["label"], parse_time(w["start"]), parse_time(w["end"])) for w in led["windows"]]
        if picture(plot, samples, png, windows, title=f"{title} GPU"):
            led["plot"] = str(png)
    png = picture(dryrun_plot, rows, out_root / "dryrun.png", f"{title} {led['gpu']}")
    if png:
        led["comparison_plot"] = str(png)
    return png


def add_parser(sub: Any) -> None:
    p = sub.add_parser("dryrun", help="measure N real training steps per preset: s/step, tokens/s, memory, save, ETA")
    p.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]")
    add_preset_option(p, allow_all=True)
    p.add_argument("--nproc", type=count_at_least(1), help="processes (default: every visible GPU; 2 gloo processes on a CPU)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU through gloo even if GPUs are visible")
    p.add_argument("--no-fit-check", action="store_true", help="skip the capped run that proves a 24 GB fit")
    add_node_arguments(p)
    p.set_defaults(func=run)
