"""The ledger: turn a worker's raw timings into the numbers a user plans with, and write them.

Everything here is arithmetic on measured values; nothing is assumed. Formulas:
- steady-state s/step = the median of the measured steps' durations, each including the gap
  before it (data loading, logging); the measured steps follow `dryrun_warmup_steps` and are real
  steps of the run, drawn across it (eta.py says why the median); the p10-p90 spread beside it;
- tokens/s = real (non-pad) tokens per measured step, summed over ranks / s/step;
- MFU = tokens/s x k x N / (world size x peak), k = 4 without gradient checkpointing (forward 2N,
  backward 2N: frozen weights get no weight gradient) and 6 with it (one more forward), N = the
  matmul parameters (lm_head included, embedding not), peak = the bf16 matmul rate measured on
  the same GPU in the same run (the convention of ../shared/notes/h200-baseline.md);
- all-reduce bus bandwidth as nccl-tests: bytes / t x 2 (n - 1) / n;
- ETA: the whole command, start-up to exit, part by part (eta.py).
- two presets tie when their tokens/s ranges (tokens per step / p90 .. / p10 step time) overlap;
  the steps that would separate them are those at which the difference of their mean tokens/s
  is 2 standard errors: n = 4 (cv_a^2 + cv_b^2) / d^2, cv = standard deviation / mean of one
  preset's step times, d = the relative difference of their tokens/s (`steps_to_separate`).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from tuneledger.files import write_text_atomic
from tuneledger.words import plural  # noqa: F401  (ledger.plural, as the verbs import it)

GIB = 2**30
# A 24 GB card (RTX 4090: 24,564 MiB) keeps ~1 GiB for the CUDA context, cuBLAS workspace and NCCL
# buffers, so the allocator may use about 23 GiB; the fit is proved by capping it there.
CAP_24GB_GIB = 23.0


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


def step_durations(steps: list[dict], saves: list[dict]) -> list[float]:
    """Seconds per optimizer step, gaps between steps included (data fetch, logging), saves left
    out. `steps` are StepTimer.summary() rows (t_begin/t_end on the device's timeline), `saves`
    its save rows ({"after_step": n, "s": seconds}): a save after step n sits in step n+1's gap."""
    saved = {s["after_step"]: s["s"] for s in saves}
    out = []
    for i, s in enumerate(steps):
        start = steps[i - 1]["t_end"] if i else s["t_begin"]
        out.append(max(0.0, s["t_end"] - start - saved.get(i, 0.0)))
    return out


def step_tokens(ranks: list[dict]) -> list[int]:
    """Real (non-pad) tokens of each step, summed over ranks, from each rank's running count."""
    per_rank = [[b - a for a, b in zip([0] + r["cum_tokens"][:-1], r["cum_tokens"])] for r in ranks]
    return [sum(t) for t in zip(*per_rank)]


def spread(xs: list[float]) -> dict:
    """median, p10, p90 (nearest rank), mean, trimmed mean (the middle 80%), min, max, sd."""
    if not xs:
        return {}
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    k = int(0.1 * len(s))
    return {"median": statistics.median(s), "p10": pick(0.1), "p90": pick(0.9), "mean": statistics.fmean(s),
            "trimmed_mean": statistics.fmean(s[k:len(s) - k]), "min": s[0], "max": s[-1], "n": len(s),
            "sd": statistics.stdev(s) if len(s) > 1 else 0.0}


def host_probe_median(rank: dict) -> float | None:
    """The median of a rank's host probes (probes.host_probe_us: µs per torch op call), None
    where the run took none (results from before the probe)."""
    xs = [p["us"] for p in rank.get("host_probe") or []]
    return round(statistics.median(xs), 3) if xs else None


def summarize_run(result: dict, warmup: int) -> dict:
    """Steady-state numbers of one dry-run result (worker.fit's return value).

    Returns s_per_step (the median, s) with step_spread and every step's duration, tokens_per_s
    (aggregate, at the median step), tokens_per_s_mean (over the window's wall time: the mean step),
    step_losses (every step's loss, mean over ranks), host_probe_us (rank 0's median host probe,
    µs per torch op call, or None), tokens_per_s_per_gpu, split (mean seconds per
    part and method), memory per rank (MiB), steps measured and excluded, and the run's steps they replayed.
    Raises ValueError when there are not more steps than warm-up steps.
    """
    r0 = result["ranks"][0]
    steps = r0["steps"]
    n = len(steps)
    if n <= warmup:
        raise ValueError(f"dry-run made {n} steps, not more than the {plural(warmup, 'warm-up step')}; raise dryrun_steps")
    steady = steps[warmup:]
    # From the end of the last warm-up step, so the gap before the first steady step counts too.
    window = steps[-1]["t_end"] - (steps[warmup - 1]["t_end"] if warmup else 0.0)
    world = result["world_size"]
    tokens = 0
    for rank in result["ranks"]:
        cum = rank["cum_tokens"]
        tokens += cum[-1] - (cum[warmup - 1] if warmup else 0)
    durations = step_durations(steps, result.get("saves") or [])
    per_step = durations[warmup:]
    # The split below adds up to the window's mean step; s_per_step is the median (the ETA's).
    s_step = window / len(steady)
    s_median = spread(per_step)["median"]

    no_sync = [t for s in steady for t in s["micro_s"][:-1]]
    sync = [s["micro_s"][-1] for s in steady]
    opt = [s["optimizer_s"] for s in steady]
    ar = result.get("allreduce") or {}
    ar_s = ar.get("median_s", 0.0)
    if no_sync:
        fwd_bwd = _mean(no_sync)
        method = "forward+backward measured on no_sync micro-batches"
    else:
        fwd_bwd = max(0.0, _mean(sync) - ar_s)
        method = ("accumulation 1: forward+backward = synchronising micro-batch - measured all-reduce, which also "
                  "holds any wait for a slower rank (sync wait not separable)")
    n_micro = len(steady[0]["micro_s"])
    sync_extra = max(0.0, _mean(sync) - fwd_bwd)
    single = world == 1  # one rank: nothing is all-reduced and no rank waits for another
    parts = {
        "forward_backward_per_micro_s": fwd_bwd,
        "micro_batches_per_step": n_micro,
        "forward_backward_s": fwd_bwd * n_micro,
        "allreduce_s": 0.0 if single else min(ar_s, sync_extra) if no_sync else ar_s,
        # With accumulation 1 every micro-batch synchronises: the wait for a slower rank cannot be
        # told apart from forward+backward, so it is unknown (None), not zero. On one rank what the
        # last micro-batch takes beyond the others is no wait: it stays in other_s.
        "sync_wait_s": 0.0 if single else max(0.0, sync_extra - ar_s) if no_sync else None,
        "optimizer_s": _mean(opt),
    }
    parts["data_wait_s"] = _mean([s["data_wait_s"] for s in steady])
    parts["other_s"] = max(0.0, s_step - sum(parts[k] or 0.0 for k in ("forward_backward_s", "allreduce_s", "sync_wait_s",
                                                                         "optimizer_s", "data_wait_s")))
    parts["method"] = method
    wall0 = steps[warmup - 1]["wall_end"] if warmup else steps[0]["wall_begin"]
    positions = result.get("positions")
    return {
        "steps_measured": len(steady), "warmup_steps_excluded": warmup, "window_s": window,
        "window_utc": [_utc(wall0), _utc(steps[-1]["wall_end"])],
        "s_per_step": s_median, "s_per_step_window_mean": s_step, "step_spread": spread(per_step),
        "step_durations_s": [round(d, 4) for d in durations], "step_tokens": step_tokens(result["ranks"]), "run_steps_replayed": positions,
        "alloc_retries_by_step": [s.get("alloc_retries") for s in steps] if steps[0].get("alloc_retries") is not None else None,
        "tokens_per_s": tokens / len(steady) / s_median, "tokens_per_s_per_gpu": tokens / len(steady) / s_median / world,
        "tokens_per_step": tokens / len(steady),
        "host_probe_us": host_probe_median(r0),
        # What a whole run pays: the window's tokens over its wall time (gaps and slow steps included).
        "tokens_per_s_mean": tokens / window if window > 0 else None,
        # Each step's loss, the mean over ranks (as the Trainer logs it), warm-up steps included.
        "step_losses": [round(sum(x) / len(x), 5) for x in zip(*[r.get("step_losses") or [] for r in result["ranks"]])],
        "split": parts,
        "memory_mib": [{"rank": r["rank"], "gpu": r["gpu_name"], "peak_allocated": r["peak_allocated_mib"],
                        "peak_reserved": r["peak_reserved_mib"], "peak_rss": r.get("peak_rss_mib")} for r in result["ranks"]],
    }


def _utc(t: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(t, timezone.utc).isoformat()


def mfu(tokens_per_s: float, matmul_params: int, gradient_checkpointing: bool, world: int, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1] per GPU, or None without a measured peak (see module doc)."""
    if not peak_flops:
        return None
    k = 6 if gradient_checkpointing else 4
    return tokens_per_s * k * matmul_params / world / peak_flops


def total_steps(stats: dict, cfg: Any) -> int:
    """max_steps, else ceil(ceil(training records / cfg's global batch) x epochs); the training
    records exclude the held-out share (val_size)."""
    if cfg.max_steps and cfg.max_steps > 0:
        return cfg.max_steps
    import math

    train = stats.get("train_records", stats["records"]["valid"])
    return math.ceil(math.ceil(train / cfg.global_batch_size) * cfg.num_train_epochs)


def evaluations(total_steps: int, cfg: Any, steps_per_epoch: int) -> int:
    """How many evaluations a run of `total_steps` makes: every eval_steps (default save_steps), or
    once per epoch; 0 when it does not evaluate."""
    if not cfg.evaluates:
        return 0
    if cfg.eval_strategy == "epoch":
        return max(1, total_steps // max(1, steps_per_epoch))
    return total_steps // (cfg.eval_steps or cfg.save_steps)


def tokens_per_s_range(row: dict) -> tuple[float, float]:
    """(low, high) tokens/s of a ledger row: its tokens per step over its p90 and p10 step times."""
    spread = row["step_spread"]
    return row["tokens_per_step"] / spread["p90"], row["tokens_per_step"] / spread["p10"]


def overlap(a: dict, b: dict) -> bool:
    """Whether two ledger rows' p10-p90 tokens/s ranges overlap: the measurement cannot order them."""
    (a_lo, a_hi), (b_lo, b_hi) = tokens_per_s_range(a), tokens_per_s_range(b)
    return a_lo <= b_hi and b_lo <= a_hi


def steps_to_separate(a: dict, b: dict) -> int | None:
    """Steady steps per preset at which the tokens/s of rows `a` and `b` would differ by 2 standard
    errors of their means (formula in the module doc); None when their means are equal."""
    def cv(row: dict) -> float:
        spread = row["step_spread"]
        # Ledgers written before "sd" was kept: a normal distribution's p90 - p10 is 2.56 sd.
        sd = spread.get("sd", (spread["p90"] - spread["p10"]) / 2.56)
        return sd / row["s_per_step"]

    d = abs(a["tokens_per_s"] - b["tokens_per_s"]) / max(a["tokens_per_s"], b["tokens_per_s"])
    if d == 0:
        return None
    import math

    return max(2, math.ceil(4 * (cv(a) ** 2 + cv(b) ** 2) / d**2))


def separation(a: dict, b: dict, name_a: str, name_b: str) -> str:
    """What a longer dry-run would tell about two tied rows (their p10-p90 ranges overlap), from
    steps_to_separate: the same speed when no practical run would separate them (over 10,000
    steady steps, or equal means); a small real difference when their means already differ by 2
    standard errors over the steps measured; else the steady steps (and dryrun_steps) it takes."""
    need = steps_to_separate(a, b)
    measured = a.get("steps_measured") or 0
    if need is None or need > 10_000:
        return "they run at the same speed: no dry-run of a practical length would tell them apart"
    if need <= measured:
        return (f"their mean steps already differ by 2 standard errors over these {measured} steps, by less than the "
                "step-to-step spread: a real but small difference")
    return (f"about {need:,} steady steps each would separate {name_a} from {name_b} (2 standard errors of the mean "
            f"step time: dryrun_steps={need + (a.get('warmup_steps_excluded') or 0)})")


def run_loss(log_history: list[dict], resumed_step: int = 0) -> dict:
    """The training loss of a whole run from its logged losses (trainer_state's log_history, which a
    resume carries over).

    Each logged loss is the mean over the steps since the previous log (or since the resume, when
    the run resumed in between), so the run's mean is their mean weighted by those step counts.
    transformers' own `train_loss` divides the resumed part's loss sum by every step of the run, so
    after a resume it reads low. Returns {"mean", "last", "last_step", "steps_covered"}; the
    losses are None when nothing was logged.
    """
    total, covered, prev, last, last_step = 0.0, 0, 0, None, 0
    for h in log_history:
        if "loss" not in h or "step" not in h:
            continue
        start = resumed_step if prev < resumed_step < h["step"] else prev
        n = max(0, h["step"] - start)
        total, covered = total + h["loss"] * n, covered + n
        prev, last, last_step = h["step"], h["loss"], h["step"]
    return {"mean": total / covered if covered else None, "last": last, "last_step": last_step, "steps_covered": covered}


def compiled(model_info: dict) -> bool:
    """Whether a worker compiled its decoder layers: its `levers` line (model.load_model)."""
    return str((model_info or {}).get("levers", {}).get("compile", "")).startswith("on")


def fmt_h(seconds: float) -> str:
    h, rem = divmod(int(round(seconds)), 3600)
    return f"{h} h {rem // 60:02d} min" if h else f"{rem // 60} min {rem % 60:02d} s"


def write(out_dir: Path, name: str, ledger: dict, markdown: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    # Whole or not at all: a full disk mid-write keeps the earlier ledger, never a cut one (files.py).
    write_text_atomic(out_dir / f"{name}.json", json.dumps(ledger, indent=1, ensure_ascii=False, default=str))
    write_text_atomic(out_dir / f"{name}.md", markdown)
