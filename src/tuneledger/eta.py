"""The ETA of a `tuneledger train` command, part by part, from what the dry-run measured; and after
the train, what the dry-run predicted beside what happened.

Parts, in seconds, in the order the command spends them (PARTS):

    python_start_s  interpreter start and imports, until the verb's first line runs
    preflight_s     the preflight checks (logging backend, bitsandbytes, disk, model config)
    data_s          tokenization, or the cache load (train finds the cache its dry-run made)
    launch_s        torchrun until rank 0's worker runs (process spawn, imports, process group)
    model_load_s    dataset and tokenizer open, model load, 4-bit quantization, LoRA
    setup_s         Trainer set-up until the first step begins (optimizer, DDP, first batches)
    compile_s       torch_compile only: what compiling costs the train, which finds the dry-run's
                    kernels in inductor's cache (launch puts it under cache_dir): measured after the
                    dry-run's steps by compiling again from that cache (probes.time_warm_compile).
                    The dry-run's own, cold, compile (what its first `dryrun_warmup_steps` steps
                    took beyond their count x the median s/step: dynamo and inductor compiling the
                    decoder layer, and recompiling once for dynamic shapes) is kept as
                    cold_compile_s; a train is predicted with it when the warm one is missing.
                    0 when nothing is compiled
    warmup_steps_s  the run's first `dryrun_warmup_steps` steps: their count x the median s/step. Not
                    their own dry-run times: a dry-run on a fresh machine pays one-off first-use
                    costs there (CUDA's kernel cache, first shapes) that the train after it does
                    not. On an H200 its first five steps took 16.0 s against 7.6 s in the train;
                    the median predicted 6.9 s (bench/results/h200-2026-11-30-eta). The measured
                    times stay in the ledger as `warmup_measured_s`.
    steps_s         every other step: their count x the median s/step of the measured steps
    saves_s         checkpoints (every save_steps, and the final one) x the measured save time
    eval_s          evaluation; 0 while no evaluation is configured (the hook for it)
    finish_s        after the final save until the command returns (result gather, teardown, the
                    final adapter copied to the run's root and the first loss-plot draw, which the
                    dry-run times itself: checkpoints.time_publish, trainer.time_loss_plot; the
                    later draws, one per save, are in saves_s)

The measured steps are real steps of the run, drawn from evenly spaced positions of its own data
order (see `step_positions`), so their median is the typical step of the whole run; one-off stalls
(allocator growth, a stray pause) move a mean over a few dozen steps but not the median. The range
is the 5th-95th percentile of that median over 2,000 bootstrap resamples of the measured steps.
docs/eta.md argues the choice with measurements.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from tuneledger.ledger import fmt_h, plural, spread, step_durations

PARTS = ("python_start_s", "preflight_s", "data_s", "launch_s", "model_load_s", "setup_s", "compile_s",
         "warmup_steps_s", "steps_s", "saves_s", "eval_s", "finish_s")
STARTUP = PARTS[:7]
# Settings that change what the dry-run measures but not the run it predicts.
NOT_COMPARED = ("dryrun_steps", "dryrun_warmup_steps", "memory_cap_gib", "resume_from_checkpoint")
BOOTSTRAP_DRAWS = 2000


def process_age_s() -> float:
    """Seconds since this process started: the interpreter's start and the imports before the
    verb's first line. On Linux from /proc/self/stat's start time in clock ticks since boot
    against CLOCK_BOOTTIME (10 ms resolution); psutil's create_time() is a fallback, whose
    whole-second boot time can put the start up to 1 s off."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        start_ticks = int(fields[19])  # field 22 of stat(5), counted after the command name
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        import psutil

        return max(0.0, time.time() - psutil.Process().create_time())


def n_saves(total_steps: int, save_steps: int) -> int:
    """Checkpoints a run of `total_steps` writes: every save_steps, plus the final one that
    transformers' Trainer writes at the last step when it is not on a multiple."""
    if total_steps <= 0 or save_steps <= 0:
        return 0
    return total_steps // save_steps + (1 if total_steps % save_steps else 0)


def step_positions(total_steps: int, steps_per_epoch: int, full_steps_per_epoch: int, warmup: int, measured: int) -> list[int]:
    """Which steps of the real run (0-based, epochs one after another) the dry-run replays.

    The first `warmup` are the run's own first steps (its warm-up: the same batches, so the same
    compilation and allocator growth). The `measured` others are the centres of equal slices of
    the rest of the run, full global batches only (an epoch's short last batch is not typical).
    A run shorter than that repeats its steps in order. Raises ValueError without a full step.
    """
    if full_steps_per_epoch <= 0:
        raise ValueError("the dataset holds less than one global batch: no full step to replay")
    eligible = [s for s in range(max(total_steps, 1)) if s % steps_per_epoch < full_steps_per_epoch] \
        or list(range(full_steps_per_epoch))
    warm = [eligible[i % len(eligible)] for i in range(warmup)]
    rest = eligible[warmup:] or eligible
    if measured <= len(rest):
        return warm + [rest[int((i + 0.5) * len(rest) / measured)] for i in range(measured)]
    return warm + [rest[i % len(rest)] for i in range(measured)]


def median_range(xs: list[float], draws: int = BOOTSTRAP_DRAWS, seed: int = 0) -> tuple[float, float]:
    """5th and 95th percentile of the median over `draws` bootstrap resamples (seeded: the same
    steps give the same range)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(draws))
    return meds[int(0.05 * draws)], meds[int(0.95 * draws) - 1]


def compile_excess(warmup: list[float], median: float) -> float:
    """s the first steps took beyond their count x the median step: compiling, when compiled."""
    return max(0.0, sum(warmup) - len(warmup) * median)


def predict(startup: dict[str, float], warmup: list[float], steady: list[float], total_steps: int, save_steps: int,
            save_s: float, finish_s: float, eval_s: float = 0.0, measured: list[str] | None = None,
            compiled: bool = False, warm_compile_s: float | None = None) -> dict:
    """The whole command's ETA from measured parts (seconds; see the module doc for the parts).

    startup: STARTUP parts; warmup: the run's first steps' durations; steady: the measured steps'
    durations; eval_s: all of the run's evaluations (their count x the time of one); compiled: the
    decoder layers are compiled, so the first steps' excess is start-up (compile_s); warm_compile_s:
    what compiling costs with this run's kernels already in inductor's cache (probes.time_warm_compile),
    which is what a train after its dry-run pays: compile_s then, and the first steps' excess is
    kept as cold_compile_s. Returns parts, total_s with low_s-high_s (the median's bootstrap range), the step
    statistics, and what the mean and trimmed mean would have predicted (kept, so every train
    checks the estimators too). Raises ValueError without a steady step.
    """
    if not steady:
        raise ValueError("no measured step to extrapolate from")
    w = min(len(warmup), total_steps)
    rest = total_steps - w
    stats = spread(steady)
    lo, hi = median_range(steady)
    saves = n_saves(total_steps, save_steps)
    parts = {k: float(startup.get(k) or 0.0) for k in STARTUP}
    cold = compile_excess(warmup[:w], stats["median"]) if compiled else 0.0
    parts["compile_s"] = warm_compile_s if compiled and warm_compile_s is not None else cold
    parts.update({"warmup_steps_s": w * stats["median"], "steps_s": rest * stats["median"], "saves_s": saves * save_s,
                  "eval_s": eval_s, "finish_s": finish_s})
    total = sum(parts.values())
    return {
        "total_steps": total_steps, "warmup_steps": w, "warmup_measured_s": sum(warmup[:w]), "steady_steps": rest,
        "checkpoints": saves, "save_s": save_s, "cold_compile_s": cold if compiled else None,
        "estimator": "median", "s_per_step": stats["median"], "s_per_step_range": [lo, hi], "step_spread": stats,
        "parts": parts, "measured": measured if measured is not None else [k for k in PARTS if k != "eval_s"],
        "total_s": total, "low_s": total + total_steps * (lo - stats["median"]),
        "high_s": total + total_steps * (hi - stats["median"]),
        "total_h": total / 3600,
        "other_estimators": {name: total + total_steps * (stats[name] - stats["median"]) for name in ("mean", "trimmed_mean")},
    }


def fmt_eta(eta: dict) -> str:
    """'3 min 50 s (3 min 35 s - 4 min 10 s)'."""
    return f"{fmt_h(eta['total_s'])} ({fmt_h(eta['low_s'])} - {fmt_h(eta['high_s'])})"


def fmt_parts(eta: dict) -> str:
    """One line: start-up, steps, saves, eval, finish, with the start-up's own parts."""
    p = eta["parts"]
    start = sum(p[k] for k in STARTUP)
    inner = ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {p[k]:.1f}" for k in STARTUP)
    note = ""
    if eta.get("cold_compile_s") is not None and abs(eta["cold_compile_s"] - p["compile_s"]) > 0.05:
        note = f"; compile from the dry-run's cached kernels, {eta['cold_compile_s']:.1f} s cold"
    text = (f"start-up {fmt_h(start)} ({inner} s{note}) + {plural(eta['warmup_steps'], 'warm-up step')} {p['warmup_steps_s']:.1f} s "
            f"+ {eta['steady_steps']} steps x {eta['s_per_step']:.3f} s = {fmt_h(p['steps_s'])} "
            f"+ {plural(eta['checkpoints'], 'save')} x {eta['save_s']:.1f} s")
    if p["eval_s"]:
        text += f" + eval {fmt_h(p['eval_s'])}"
    return text + f" + finish {p['finish_s']:.1f} s"


# ------------------------------------------------------------------------------ run timelines
def worker_parts(result: dict, t_launch: float, t_exit: float) -> dict:
    """launch, model load, set-up, warm-up/other steps, saves and finish of one torchrun, from the
    worker's timeline (rank 0, wall-clock seconds) and the launcher's own start/exit times.

    Work only a dry-run does (replaying the run's order, benchmarks) is taken out, so the parts
    are what a train spends. Step durations come from ledger.step_durations(); `loop_wall_s` is the host's
    wall time from the first step's begin to the last step's end, saves taken out.
    """
    tl = result["timeline"]
    steps, saves = result["ranks"][0]["steps"], result["saves"]
    last_end = max([steps[-1]["wall_end"]] + [s["wall_end"] for s in saves]) if steps else tl["train_returned"]
    first = steps[0]["wall_begin"] if steps else tl["train_returned"]
    saves_in_loop = sum(s["s"] for s in saves if s["after_step"] < len(steps))
    return {
        "launch_s": tl["main"] - t_launch,
        "model_load_s": tl["model_loaded"] - tl["main"],
        "setup_s": first - tl["model_loaded"] - tl.get("order_s", 0.0),
        "durations": step_durations(steps, saves),
        "loop_wall_s": (steps[-1]["wall_end"] - first - saves_in_loop) if steps else 0.0,
        "saves_s": sum(s["s"] for s in saves),
        "save_s": [s["s"] for s in saves],
        "finish_s": t_exit - last_end - tl.get("benches_s", 0.0) - tl.get("eval_timing_s", 0.0) - tl.get("warm_compile_s", 0.0),
    }


def actual(startup: dict[str, float], result: dict, t_launch: float, t_exit: float, t_end: float, warmup: int,
           compiled: bool = False, wall_s: float | None = None) -> dict:
    """What a train command spent, in PARTS (seconds), and its total. compiled: the first steps'
    excess over the median step is compile_s, as predict() splits it. wall_s: the command's own
    wall time, process start to t_end (process_age_s()); then total_s is that, and
    `unaccounted_s` the time it spent between the measured parts (imports between them, result
    writing, the sampler); without it total_s is the parts' sum."""
    w = worker_parts(result, t_launch, t_exit)
    warm = sum(w["durations"][:warmup])
    rest = w["durations"][warmup:]
    comp = compile_excess(w["durations"][:warmup], statistics.median(rest)) if compiled and rest else 0.0
    parts = {k: float(startup.get(k) or 0.0) for k in STARTUP}
    parts.update({"launch_s": w["launch_s"], "model_load_s": w["model_load_s"], "setup_s": w["setup_s"],
                  "compile_s": comp, "warmup_steps_s": warm - comp, "steps_s": max(0.0, w["loop_wall_s"] - warm),
                  "saves_s": w["saves_s"],
                  "eval_s": 0.0, "finish_s": w["finish_s"] + (t_end - t_exit)})
    steps = len(w["durations"])
    summed = sum(parts.values())
    total = wall_s if wall_s is not None else summed
    return {"parts": parts, "total_s": total, "unaccounted_s": total - summed, "steps": steps, "checkpoints": len(w["save_s"]),
            "warmup_steps": min(warmup, steps), "step_spread": spread(w["durations"][warmup:]),
            "durations": [round(d, 4) for d in w["durations"]]}


# ------------------------------------------------------------------------ predicted vs actual
def differences(a: dict, b: dict) -> list[str]:
    """Config keys (NOT_COMPARED aside) whose values differ between two config dicts."""
    keys = (set(a) | set(b)) - set(NOT_COMPARED)
    return sorted(k for k in keys if a.get(k) != b.get(k))


def find_prediction(dryrun_json: Path, config: dict, world_size: int, data_hash: str, cpu: bool) -> tuple[dict | None, str]:
    """The dry-run row of `dryrun_json` measured with these settings, or None and why not."""
    import json

    if not dryrun_json.is_file():
        return None, f"no dry-run ledger at {dryrun_json}"
    try:
        led = json.loads(dryrun_json.read_text())
    except (OSError, ValueError) as e:  # a damaged ledger (a full disk, a kill mid-write): no prediction, not a fault
        return None, f"{dryrun_json} cannot be read ({type(e).__name__}: {e})"
    if not isinstance(led, dict):
        kind = {type(None): "null", list: "list", str: "string", bool: "true/false"}.get(type(led), "number")
        return None, f"{dryrun_json} is not a dry-run ledger (a JSON {kind}, not an object)"
    if not isinstance(led.get("presets"), list) or not isinstance(led.get("world_size"), int) \
            or led.get("backend") not in ("gloo", "nccl"):
        return None, f"{dryrun_json} is not a dry-run ledger (no presets list, whole world size or backend)"
    if led.get("world_size") != world_size or (led.get("backend") == "gloo") != cpu:
        return None, (f"{dryrun_json} measured {led.get('world_size')} x {led.get('backend')} processes; this run has "
                      f"{world_size} x {'gloo' if cpu else 'nccl'}")
    if led.get("data_hash") != data_hash:
        return None, f"{dryrun_json} measured other data (cache {led.get('data_hash')}, this run {data_hash})"
    rows = [r for r in led.get("presets") or [] if isinstance(r, dict) and isinstance(r.get("eta"), dict)
            and "parts" in r["eta"] and isinstance(r.get("config"), dict)]
    if not rows:
        return None, f"{dryrun_json} has no measured preset with an ETA of its parts (an older ledger?)"
    diffs = {r["preset"]: differences(r["config"], config) for r in rows}
    match = next((r for r in rows if not diffs[r["preset"]]), None)
    if match is None:
        near = min(diffs.items(), key=lambda kv: len(kv[1]))
        return None, f"no preset in {dryrun_json} has these settings (preset {near[0]} differs in: {', '.join(near[1])})"
    return match, f"{dryrun_json} (preset {match['preset']}, {led.get('date')})"


def _err(pred: float, act: float) -> float | None:
    """% error of a prediction; None where nothing was predicted (0 s) or nothing happened."""
    return round((pred - act) / act * 100, 1) if act > 0 and pred > 0 else None


def check(pred: dict, act: dict, source: str, host_us: tuple[float | None, float | None] = (None, None)) -> dict:
    """Predicted beside actual, per part and in total; error_pct = (predicted - actual) / actual:
    positive means the dry-run said longer than it took. host_us: the dry-run's and the train's
    median host probe (probes.host_probe_us, µs per torch op call), kept with their ratio
    (train / dry-run) beside the steady steps; see host_line for what the ratio does not say."""
    dry_us, train_us = host_us
    parts = {k: {"predicted_s": round(pred["parts"].get(k, 0.0), 2), "actual_s": round(act["parts"][k], 2),
                 "error_pct": _err(pred["parts"].get(k, 0.0), act["parts"][k])} for k in PARTS}
    steady = act["step_spread"].get("median")
    return {
        "dryrun": source, "parts": parts,
        "total": {"predicted_s": round(pred["total_s"], 1), "low_s": round(pred["low_s"], 1), "high_s": round(pred["high_s"], 1),
                  "actual_s": round(act["total_s"], 1), "error_pct": _err(pred["total_s"], act["total_s"]),
                  "unaccounted_s": round(act.get("unaccounted_s", 0.0), 1),
                  "inside_range": pred["low_s"] <= act["total_s"] <= pred["high_s"]},
        "steady_s_per_step": {"dryrun_median": pred["s_per_step"], "train_median": steady,
                              "error_pct": _err(pred["s_per_step"], steady) if steady else None},
        "other_estimators_error_pct": {k: _err(v, act["total_s"]) for k, v in pred.get("other_estimators", {}).items()},
        "steps": {"predicted": pred["total_steps"], "actual": act["steps"]},
        "host_probe_us": {"dryrun": dry_us, "train": train_us,
                          "train_over_dryrun": round(train_us / dry_us, 3) if dry_us and train_us else None},
    }


def took(total_s: float, unaccounted_s: float = 0.0) -> str:
    """'this command took 2 min 30 s (process start to this line, ...; 2.1 s of it between the
    measured parts)': the command's own wall time (s), as `time` would show it less the exit."""
    return (f"this command took {fmt_h(total_s)} (process start to this line, the interpreter's exit after it "
            "not counted" + (f"; {unaccounted_s:.1f} s of it between the measured parts" if abs(unaccounted_s) >= 0.05 else "")
            + ")")


def check_line(c: dict) -> str:
    t = c["total"]
    where = "inside" if t["inside_range"] else "outside"
    train = c["steady_s_per_step"]["train_median"]
    gap = t.get("unaccounted_s") or 0.0
    return (f"ETA check: the dry-run predicted {fmt_h(t['predicted_s'])} ({fmt_h(t['low_s'])} - {fmt_h(t['high_s'])}); "
            f"{took(t['actual_s'], gap)}: "
            + (f"{t['error_pct']:+.1f}% ({where} the range). " if t["error_pct"] is not None else "no error to compute. ")
            + f"Steady s/step: dry-run {c['steady_s_per_step']['dryrun_median']:.3f}, train "
            + (f"{train:.3f}" if train else "- (no step after the warm-up steps to measure)")
            + ". " + host_line(c.get("host_probe_us") or {}) + "Per part: train.json eta_check")


def host_line(h: dict) -> str:
    """'Host probe: ...' when both runs took one, else ''. Within 5% either way it says 'as fast'.

    The figure is the host's speed at those moments, not the job's, and it is a pointer, not a
    correction: on the idle 2-core dev VM the medians of 20 probes taken seconds apart ranged
    0.91-1.70 µs, in two clusters (bench/results/cpu-2026-12-04-host-probe), and in one H200
    call the probe ran 76% slower in `train` while preset C's host-bound step ran 10% faster
    (bench/results/h200-2026-12-04/call6-etaC). So the line reports the probe's change beside
    the steady step's and draws no conclusion from it."""
    r = h.get("train_over_dryrun")
    if not r:
        return ""
    how = "as fast in both" if abs(r - 1) < 0.05 else f"the probe ran {abs(r - 1) * 100:.0f}% {'slower' if r > 1 else 'faster'} in train"
    return f"Host probe: dry-run {h['dryrun']:.2f}, train {h['train']:.2f} µs per torch op ({how}). "


def memory_line(ranks: list[dict], total_mib: float | None) -> str | None:
    """Allocated and reserved peaks (MiB, the largest rank), and what to do when the caching
    allocator holds much more than the tensors need (fragmentation). None on a CPU run."""
    alloc = max((r.get("peak_allocated_mib") or 0) for r in ranks)
    reserved = max((r.get("peak_reserved_mib") or 0) for r in ranks)
    if not alloc:
        return None
    of = f" of {total_mib / 1024:.0f} GiB" if total_mib else ""
    text = f"memory peak: {alloc / 1024:.1f} GiB allocated, {reserved / 1024:.1f} GiB reserved by the allocator{of}"
    retries = max((r.get("alloc_retries") or 0) for r in ranks)
    if reserved > 1.25 * alloc:
        text += (f". The allocator keeps {(reserved - alloc) / 1024:.1f} GiB of freed blocks (fragmentation from batches "
                 "of varying shape); the run needs the allocated figure")
        if retries or (total_mib and reserved > 0.9 * total_mib):
            text += (f"{f', and it had to free and retry {retries} times' if retries else ''}. Set "
                     "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to let it grow segments instead of caching "
                     "fragments")
    return text
