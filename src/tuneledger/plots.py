"""Pictures: the training loss of a run, and the dry-run's preset comparison (matplotlib, no display).

    loss_plot(log_history, png)   training_loss.png: logged train loss by step, eval loss when there is one
    dryrun_plot(rows, png)        dryrun.png: tokens/s per preset with p10-p90 bars, peak memory vs a 24 GB card

Both write to <png>.tmp.png and rename, so a run killed while drawing leaves the previous picture whole.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

GB24_GIB = 24 * 1e9 / 2**30  # a 24 GB card (RTX 4090) is 22.4 GiB; the line is drawn there


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only; raises ImportError without matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a training node
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, png: Path) -> Path:
    """Write `fig` to `png` through a temporary file and a rename (a reader never sees half a picture)."""
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    tmp = png.with_name(png.stem + ".tmp.png")
    try:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
        os.replace(tmp, png)
    except BaseException:
        # No half picture, and no earlier run's picture beside the new ledger as if it were its own.
        tmp.unlink(missing_ok=True)
        png.unlink(missing_ok=True)
        raise
    return png


def picture(draw: Any, *args: Any, **kw: Any) -> Path | None:
    """draw(*args, **kw) (a drawing function whose second argument is its PNG path), or None with a
    warning naming that path: a picture (matplotlib missing, a drawing error) never costs the ledger
    of what was measured."""
    try:
        return draw(*args, **kw)
    except Exception as e:  # noqa: BLE001
        with contextlib.suppress(OSError):
            Path(args[1]).unlink(missing_ok=True)
        print(f"WARNING: no picture {args[1]}: {type(e).__name__}: {e}; the ledger is written without it "
              "(an earlier picture there is removed)", file=sys.stderr)
        return None


def loss_series(log_history: list[dict]) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(train, eval) loss points (step, loss) of a Trainer's log_history, in step order."""
    train = [(h["step"], h["loss"]) for h in log_history if "loss" in h and "step" in h]
    evals = [(h["step"], h["eval_loss"]) for h in log_history if "eval_loss" in h and "step" in h]
    return sorted(train), sorted(evals)


def loss_plot(log_history: list[dict], png: Path, title: str = "") -> Path | None:
    """Draw the logged train loss (and eval loss) by optimizer step into `png`; None when nothing is logged yet."""
    train, evals = loss_series(log_history)
    if not train and not evals:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        # One logged step is a point, not a line: a line of one point draws nothing.
        ax.plot(*zip(*train), label="train loss", color="tab:blue", linewidth=1.2, alpha=0.9,
                marker="o" if len(train) < 3 else None)
    if evals:
        ax.plot(*zip(*evals), label="eval loss", color="tab:orange", marker="o", linewidth=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title or "training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    try:
        return save_figure(fig, png)
    finally:
        plt.close(fig)


def dryrun_plot(rows: list[dict], png: Path, title: str = "") -> Path | None:
    """The preset comparison of a dry-run ledger's rows (ledger.summarize_run + dryrun_row.entry):
    left, aggregate tokens/s with a bar from the p10 to the p90 step time's rate (tokens per step /
    step time); right, peak allocated memory per rank (GiB; on CPU runs the peak resident memory)
    against a 24 GB card. None when no preset was measured."""
    done = [r for r in rows if "tokens_per_s" in r]
    if not done:
        return None
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = [f"preset {r['preset']}" for r in done]
    rate = [r["tokens_per_s"] for r in done]
    lo, hi = [], []
    for r in done:
        spread, per_step = r.get("step_spread") or {}, r.get("tokens_per_step") or 0
        # Slow steps (p90 step time) give the low rate, fast ones (p10) the high one.
        lo.append(per_step / spread["p90"] if spread.get("p90") else r["tokens_per_s"])
        hi.append(per_step / spread["p10"] if spread.get("p10") else r["tokens_per_s"])
    err = [[max(0.0, v - a) for v, a in zip(rate, lo)], [max(0.0, b - v) for v, b in zip(rate, hi)]]
    left.bar(names, rate, yerr=err, capsize=6, color="tab:blue")
    left.set_ylabel("tokens/s (all ranks)")
    left.set_title("throughput, bars p10-p90 of step time")
    # GPU runs: peak allocated CUDA memory. CPU runs have none; their peak resident memory (RSS) is
    # drawn instead, labelled so, against the same line.
    cpu = all(not m.get("peak_allocated") for r in done for m in r.get("memory_mib") or [{}])
    key = "peak_rss" if cpu else "peak_allocated"
    peaks = [max((m.get(key) or 0) for m in r.get("memory_mib") or [{}]) / 1024 for r in done]
    right.bar(names, peaks, color=["tab:red" if p > GB24_GIB else "tab:green" for p in peaks])
    right.axhline(GB24_GIB, color="black", linestyle="--", linewidth=1)
    right.text(-0.4, GB24_GIB, " 24 GB card", va="bottom")
    right.set_ylabel(("peak RSS" if cpu else "peak allocated") + " GiB per rank")
    right.set_ylim(0, max(peaks + [GB24_GIB]) * 1.15)
    right.set_title("peak process memory (CPU run: RAM, not GPU)" if cpu else "peak GPU memory")
    fig.suptitle(title or "dry-run")
    try:
        return save_figure(fig, png)
    finally:
        plt.close(fig)
