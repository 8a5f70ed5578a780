"""`tuneledger tune`: the fastest settings that fit, found by measurement.

The space (tune_space.py) is micro-batch x gradient checkpointing x packing at the fixed global
batch, presets A-D among its points. Each candidate is measured by a short dry-run of the real job,
a subprocess `tuneledger dryrun ... --preset X output_dir=<output_dir>/tune/cand-k` whose dryrun.json
is read back: the same data, collator, data order and lengths as the dry-run and train. Before
each candidate the space is pruned against the per-GPU memory budget (tune_space.prune) and the
time budget is checked. Writes <output_dir>/tune/tune.json, tune.md and tune.png (tune_report.py
words them). A stop (SIGTERM, Ctrl-C, SIGHUP) writes what was measured, marked as cut short; a
candidate's dry-run dies with tune (PR_SET_PDEATHSIG), kill -9 included.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tuneledger import env_levers, ledger
from tuneledger import tune_space as ts
from tuneledger.config import ConfigError, JobConfig, resolve
from tuneledger.config_load import from_cli, parse_overrides
from tuneledger.launch import die_with_parent, processes
from tuneledger.runlock import RunLock, RunLocked
from tuneledger.tune_report import (cpu_budget_note, error_tail, fits_word, fmt_s, mark_stopped, markdown, memory_line,
                                    no_pick_snippet, plot, stop_name, stop_text, stopped_finding, why)
from tuneledger.words import count_at_least


def card_memory_gib(nproc: int) -> float | None:
    """The smallest total memory (GiB) of the first `nproc` GPUs by nvidia-smi; None without it.
    Asked from nvidia-smi so this launcher holds no CUDA context."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20).stdout
        mib = [float(x) for x in text.split() if x.strip().replace(".", "").isdigit()][:nproc]
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None
    return min(mib) / 1024 if mib else None


def measure_row(row: dict, budget_gib: float | None, cpu: bool, oom: bool = False) -> dict:
    """The numbers tune keeps of one dry-run ledger row: tokens/s (median step; p10-p90 range),
    s/step, peak memory per GPU in GiB (peak allocated; a CPU run: None, its RSS in MiB beside it),
    fits (None on a CPU: memory not checked), GPU busy % (NVML, when sampled), MFU, the verdict."""
    gpu = max((m.get("peak_allocated") or 0) for m in row["memory_mib"]) / 1024
    rss = max((m.get("peak_rss") or 0) for m in row["memory_mib"])
    lo, hi = ledger.tokens_per_s_range(row)
    fits = None if cpu or budget_gib is None else (not oom and gpu <= budget_gib)
    d = row.get("diagnosis") or {}
    keep = ("tokens_per_s", "tokens_per_step", "s_per_step", "step_spread", "steps_measured", "warmup_steps_excluded",
            "tokens_per_s_per_gpu", "mfu", "split")
    return {**{k: row.get(k) for k in keep}, "tokens_per_s_p10": lo, "tokens_per_s_p90": hi,
            "peak_gib": gpu or None, "peak_rss_mib": rss or None, "fits": fits,
            "gpu_busy_pct": (row.get("gpu_window") or {}).get("util_mean_pct"),
            "bottleneck": d.get("bottleneck"), "verdict": d.get("line"), "lever": d.get("lever"),
            "eta_s": (row.get("eta") or {}).get("total_s"), "levers": (row.get("model") or {}).get("levers")}


def run_candidate(c: ts.Candidate, k: int, items: list[str], args: argparse.Namespace, cpu: bool, nproc: int,
                  tune_dir: Path, cap_gib: float | None) -> tuple[dict | None, bool, str]:
    """One candidate's dry-run as a subprocess; returns (its ledger row or None, ran out of memory, log path)."""
    out = tune_dir / f"cand-{k}"
    log = tune_dir / f"cand-{k}.log"
    cmd = [sys.executable, "-m", "tuneledger", "dryrun", *items, *c.overrides(), f"output_dir={out}",
           *([f"memory_cap_gib={cap_gib:g}"] if cap_gib else []),
           "--preset", c.presets[0] if c.presets else "A", "--nproc", str(nproc), "--no-fit-check", *(["--cpu"] if cpu else [])]
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        # The kernel sends the dry-run SIGTERM when tune dies, however (kill -9 included): it stops its
        # torchrun and ranks as on any SIGTERM, rather than measuring on as an orphan into this cand-k.
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, preexec_fn=die_with_parent)
        try:
            proc.wait()
        except KeyboardInterrupt:  # tune was stopped: stop the candidate's dry-run (and its ranks) too
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
    led_path = out / "dryrun.json"
    oom = any(out.glob("dryrun/*/oom-rank*.json"))
    row = None
    if led_path.exists():
        rows = [r for r in json.loads(led_path.read_text())["presets"] if "s_per_step" in r]
        row = rows[0] if rows else None
    return row, oom, str(log)


def say_unmeasured(k: int, n: int, c: ts.Candidate) -> None:
    """The progress line of the k-th of n candidates that is not measured: its status and why."""
    print(f"tune [{k}/{n}] {c.short}: {c.status}: {c.reason}", flush=True)


def search(cands: list[ts.Candidate], items: list[str], args: argparse.Namespace, cpu: bool, nproc: int,
           tune_dir: Path, budget_s: float | None, budget_gib: float | None, first: int = 1, spent: float = 0.0,
           total: int | None = None, walls: list[float] | None = None) -> dict:
    """Measure the candidates in order, pruning before each and stopping at the time budget (the
    whole search's `budget_s`, of which `spent` seconds went before this call); the k-th is cand-k
    (`first`: the first one's k, for the lever variants measured after the space). Progress lines
    count [k/total] (`total`: the whole search's, lever variants included; default: these), and each
    candidate gets its line, one the budget stopped included, so the count never jumps. `walls`: the
    wall seconds of the candidates measured before this call (the lever phase gets the space's), so
    "the first candidate always runs" holds once per search, not once per call. The candidate
    measuring has status "measuring" (a stop names it). Returns the names of the pruned candidates
    (each one's reason is on it), the elapsed seconds and the walls, these calls' appended."""
    t0 = time.monotonic()
    walls = list(walls or [])
    pruned: list[ts.Candidate] = []
    cap = budget_gib if (args.memory_gib and not cpu) else None  # an OOM under the cap proves "does not fit"
    n = total or first - 1 + len(cands)
    for k, c in enumerate(cands, first):
        if c.status != "planned":  # its number is said with why, so the count runs on without a gap
            say_unmeasured(k, n, c)
            continue
        done = [d for d in cands if d.status in ("measured", "out of memory")]
        for p in ts.prune(cands, done, budget_gib):
            pruned.append(p)
            print(f"tune: pruned {p.short}: {p.reason}", flush=True)
        if c.status != "planned":
            continue
        elapsed = time.monotonic() - t0
        left = None if budget_s is None else budget_s - spent - elapsed
        typical = sum(walls) / len(walls) if walls else 0.0
        if left is not None and walls and (left <= 0 or left < typical):  # the first always runs
            for rest in cands[k - first:]:
                if rest.status == "planned":
                    rest.status, rest.reason = "not measured", (f"the {fmt_s(budget_s)} budget ran out ({fmt_s(max(0, left))} "
                                                                f"left, a candidate takes ~{fmt_s(typical)})")
            for j, rest in enumerate(cands[k - first:], k):
                say_unmeasured(j, n, rest)
            break
        what = f" = preset {'/'.join(c.presets)}" if c.presets else ""
        print(f"tune [{k}/{n}] {c.label}{what}: measuring; "
              + (f"{fmt_s(left)} of the {fmt_s(budget_s)} budget left" if left is not None else "no time budget")
              + (f", ~{fmt_s(typical)} per candidate" if walls else ""), flush=True)
        t1 = time.monotonic()
        c.status, c.result = "measuring", {"dir": str(tune_dir / f"cand-{k}"), "log": str(tune_dir / f"cand-{k}.log")}
        row, oom, log = run_candidate(c, k, items, args, cpu, nproc, tune_dir, cap)
        walls.append(time.monotonic() - t1)
        c.result = {"dir": str(tune_dir / f"cand-{k}"), "log": log, "wall_s": walls[-1]}
        if row is None:
            c.status = "out of memory" if oom else "failed"
            c.reason = (f"the dry-run failed ({error_tail(Path(log).read_text(errors='replace'))}); see {log}" if not oom else
                        f"out of memory under the {cap:g} GiB cap" if cap else "out of memory on the card")
            c.result["fits"] = False if oom else None
            print(f"tune [{k}/{n}] {c.short}: {c.reason}", flush=True)
            continue
        c.result.update(measure_row(row, budget_gib, cpu, oom))
        c.status = "measured"
        r = c.result
        mem = f"{r['peak_gib']:.1f} GiB" if r["peak_gib"] else (f"{r['peak_rss_mib']:,} MiB RSS" if r["peak_rss_mib"] else "-")
        print(f"tune [{k}/{n}] {c.short}: {r['tokens_per_s']:,.0f} tokens/s (p10-p90 {r['tokens_per_s_p10']:,.0f}-"
              f"{r['tokens_per_s_p90']:,.0f}), peak {mem}, fits {fits_word(r['fits'])}, {walls[-1]:.0f} s", flush=True)
    return {"pruned": [p.short for p in pruned], "elapsed_s": time.monotonic() - t0, "walls": walls}


def try_levers(space: list[ts.Candidate], levers: list[dict[str, str]], info: dict, items: list[str],
               args: argparse.Namespace, cpu: bool, nproc: int, tune_dir: Path, budget_s: float | None,
               budget_gib: float | None, keep: list[ts.Candidate] | None = None) -> list[ts.Candidate]:
    """--levers: the space's pick measured again with each lever setting (ts.lever_variants), in
    what is left of the time budget. Returns the variants (measured, or why not), appended to
    `keep` too before any is measured (a stop mid-way keeps them); adds their elapsed time and
    pruned names to `info`."""
    pick = next((c for c in space if c.short == ts.rank(space)["pick"]), None)
    if pick is None:
        print("tune: no pick to try the levers on", flush=True)
        return []
    from tuneledger.compiled import compile_planned
    from tuneledger.speed import check_levers, check_preset_levers

    variants, device, first = ts.lever_variants(pick, levers), "cpu" if cpu else "cuda", len(space) + 1  # cand-N after the space's
    if keep is not None:  # (`keep` may be `space` itself: `first` is counted before)
        keep += variants
    own = resolve(from_cli([*items, *pick.overrides()]), nproc)  # the pick as measured: its levers' values
    for v in variants:  # with the pick's own settings: a lever it cannot run, or one that would do nothing
        try:
            cfg = resolve(from_cli([*items, *v.overrides()]), nproc)  # a lever at odds with the job's keys: ConfigError
            check_levers(cfg, device)
            check_preset_levers(cfg, device)
        except ValueError as e:
            v.status, v.reason = "not measured", f"cannot run with the pick's settings: {e}"
            continue
        # A variant is skipped only when every lever it sets would change nothing here.
        idle = {"compile_cpp_wrapper": cfg.compile_cpp_wrapper and not compile_planned(cfg.torch_compile, device)
                and "nothing is compiled here: the C++ wrapper would change nothing",
                "absmax_once": cfg.absmax_once and not cfg.absmax_once_applies
                and "no double-quantized weight here: absmax_once would change nothing",
                "drop_padding_mask": cfg.drop_padding_mask and cfg.packing
                and "packed rows have no padding mask: drop_padding_mask would change nothing"}
        # What would run, not the raw values: an unset lever (auto) runs as the pick's own dry-run had it.
        idle.update({k: said for k in v.levers
                     if (said := ts.already_runs(k, v.levers[k], getattr(cfg, k), getattr(own, k), pick.result.get("levers")))})
        if all(idle.get(k) for k in v.levers):
            v.status, v.reason = "not measured", "; ".join(idle[k] for k in v.levers)
    left = None if budget_s is None else budget_s - info["elapsed_s"]
    if left is not None and left <= 0:
        for k, v in enumerate(variants, first):
            if v.status == "planned":
                v.status, v.reason = "not measured", f"the {fmt_s(budget_s)} budget ran out before the levers"
            say_unmeasured(k, first - 1 + len(variants), v)
        return variants
    print(f"tune: the pick {pick.short} with each of {', '.join(ts.lever_text(v) for v in levers)}", flush=True)
    more = search(variants, items, args, cpu, nproc, tune_dir, budget_s, budget_gib, first=first, spent=info["elapsed_s"],
                  walls=info.get("walls"))
    info["elapsed_s"] += more["elapsed_s"]
    info["pruned"] += more["pruned"]
    return variants


def run(args: argparse.Namespace) -> int:
    budget_s = ts.parse_budget(args.budget)  # the options' own checks first: they need no config
    if args.memory_gib is not None and not (math.isfinite(args.memory_gib) and args.memory_gib > 0):
        raise ConfigError(f"--memory-gib {args.memory_gib:g}: must be a finite number above 0 (GiB per GPU)")
    env_levers.check()  # a bad A/B variable or profile step: one sentence, not the same failure in every candidate
    base = from_cli(args.items)
    try:  # one tune per run folder at a time: two would share cand-N and the ledger
        with RunLock(base.out_dir / "tune", "tune.lock",
                     "Two tunes in one run directory overwrite each other's candidates and ledger (cand-N, tune.json)."):
            return _run(args, base, budget_s)
    except RunLocked as e:
        print(f"tuneledger tune: {e}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace, base: JobConfig, budget_s: float | None) -> int:
    from tuneledger.model import locate_model
    from tuneledger.preflight_checks import check_data, run_checks

    steps_given = "dryrun_steps" in parse_overrides([i for i in args.items if "=" in i])
    cpu, nproc = processes(args.cpu, args.nproc)
    world = nproc
    items = ts.base_items(args.items, steps_given)
    if base.batch_from_accumulation:  # LLaMA-Factory's accumulation: fix its global batch, as the dry-run does
        items += [f"global_batch_size={resolve(base, world).global_batch_size}", "gradient_accumulation_steps=null"]
    cfg = from_cli(items)  # the job every candidate shares: a bad key fails here, before any run
    if cfg.sharded or base.preset == "F":
        raise ConfigError("tune searches the DDP settings (micro-batch x gradient checkpointing x packing, presets A-D "
                          "among them); this config asks for preset F / fsdp. Remove fsdp and preset=F to tune, or "
                          "measure F with `tuneledger dryrun --preset F`")
    levers = ts.parse_levers(args.levers)
    for variant in levers:  # a bad value, or a lever this job cannot run, fails here, before any run
        from tuneledger.speed import check_levers  # torch: imported only when levers are asked for

        try:
            check_levers(from_cli([*items, *(f"{k}={v}" for k, v in variant.items())]), "cpu" if cpu else "cuda")
        except ValueError as e:
            raise ConfigError(f"--levers {ts.lever_text(variant)}: {e}") from None
    gb = cfg.global_batch_size
    mbs = ts.parse_micro_batches(args.micro_batches, gb, world)
    space = ts.build_space(gb, world, cfg.cutoff_len, mbs, ts.parse_switch(args.gc, "gc"), ts.parse_switch(args.packing, "packing"))
    locate_model(cfg.model_name_or_path)
    check_data(cfg)
    # What would fail every candidate fails once, here (4-bit on a CPU, a lora_target that is not
    # a layer, no room for a save), not once per candidate; what depends on a candidate's own
    # micro-batch and checkpointing (use_unsloth_gc's host memory) its dry-run checks (jobs=[]).
    run_checks(cfg, cuda=not cpu, dryrun=True, ranks_here=nproc, jobs=[])
    budget_gib = None if cpu else (args.memory_gib or card_memory_gib(nproc))
    tune_dir = cfg.out_dir / "tune"
    tune_dir.mkdir(parents=True, exist_ok=True)
    variants = f" (then the pick with each of {ledger.plural(len(levers), 'lever setting')})" if levers else ""
    print(f"tune: {len(space)} candidates{variants} at global batch {gb} on {ledger.plural(world, 'rank')}; {memory_line(cpu, budget_gib)}; "
          f"time budget {fmt_s(budget_s) if budget_s else 'none'}; each a dry-run of {cfg.dryrun_steps} steps", flush=True)
    if note := cpu_budget_note(cpu, args.memory_gib):
        print(note, flush=True)
    stopped: list[int] = []
    t0 = time.monotonic()

    def as_interrupt(signum, frame):  # SIGTERM and SIGHUP end the search as Ctrl-C does
        stopped.append(signum)
        raise KeyboardInterrupt

    saved = {sig: signal.signal(sig, as_interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    stop = None  # tune.json's `stopped`: a search cut short by a signal is not the search's answer
    try:
        info = search(space, items, args, cpu, nproc, tune_dir, budget_s, budget_gib, total=len(space) + len(levers))
        if levers:
            try_levers(space, levers, info, items, args, cpu, nproc, tune_dir, budget_s, budget_gib, keep=space)
    except KeyboardInterrupt:
        stopped.append(stopped[0] if stopped else signal.SIGINT)
        print(f"\n{stop_name(stopped[0])}: the running candidate was stopped; writing the tune ledger of the candidates "
              "measured so far", flush=True)
        info = {"pruned": [c.short for c in space if c.status == "pruned"], "elapsed_s": time.monotonic() - t0}
        stop = mark_stopped(space, stopped[0])
    ranking = ts.rank(space)
    pick = next((c for c in space if c.short == ranking["pick"]), None)
    said = stop_text(stop)
    led: dict[str, Any] = {
        "run_name": cfg.run_name, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
        "model": cfg.model_name_or_path, "world_size": world, "backend": "gloo" if cpu else "nccl",
        "global_batch_size": gb, "cutoff_len": cfg.cutoff_len, "dryrun_steps": cfg.dryrun_steps,
        "warmup_steps": cfg.dryrun_warmup_steps, "memory_budget_gib": budget_gib, "budget_s": budget_s,
        "elapsed_s": info["elapsed_s"], "micro_batches": mbs, "candidates": [c.as_dict() for c in space],
        "pruned": info["pruned"], "not_measured": [c.short for c in space if c.status not in ("measured", "pruned", "failed",
                                                                                         "out of memory")],
        "stopped": stop, "ranking": ranking, "pick": pick.as_dict() if pick else None,
        "snippet": ts.snippet(pick, gb, world, budget_gib, said) if pick else no_pick_snippet(space, stop),
        "finding": stopped_finding(ts.finding(ranking, space), stop), "why": why(ranking, space),
        "levers_tried": [ts.lever_text(v) for v in levers], "memory_gib_asked": args.memory_gib,
    }
    png = plot(space, tune_dir / "tune.png", f"tune {cfg.run_name}: {ledger.plural(world, 'rank')}, global batch {gb}", budget_gib)
    if png:
        led["plot"] = str(png)
    ledger.write(tune_dir, "tune", led, markdown(led))
    print("\n" + markdown(led).split("## The pick", 1)[1].split("\n![", 1)[0].strip())
    print(f"wrote {tune_dir / 'tune.json'}, {tune_dir / 'tune.md'}{', ' + str(png) if png else ''}")
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    if stopped:
        return 128 + int(stopped[-1])  # an interrupted command's code (docs/runs-and-output.md)
    return 0 if pick else 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser("tune", help="search micro-batch x checkpointing x packing by short dry-runs: the fastest that fits")
    p.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]")
    p.add_argument("--nproc", type=count_at_least(1), help="processes (default: every visible GPU; 2 gloo processes on a CPU)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU through gloo even if GPUs are visible")
    p.add_argument("--memory-gib", type=float, help="per-GPU memory budget in GiB (default: the card's own memory)")
    p.add_argument("--budget", help="time budget of the search: 90s, 10m, 1h (default: none)")
    p.add_argument("--micro-batches", help="micro-batches to search, e.g. 1,2,4,8 (default: 1, 2, 4, ... dividing global/world)")
    p.add_argument("--gc", default="both", help="gradient checkpointing searched: on, off or both (default both)")
    p.add_argument("--packing", default="both", help="packing searched: on, off or both (default both)")
    p.add_argument("--levers", help="speed levers to try on the pick, one variant per comma, '+' within one: "
                                    "compile_cpp_wrapper=true,grouped_lora=false+absmax_once=false (keys: " + ", ".join(ts.LEVER_KEYS) + ")")
    p.set_defaults(func=run)
