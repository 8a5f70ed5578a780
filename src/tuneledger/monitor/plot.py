"""The monitor's plot: per-GPU utilisation, memory, power and temperature over time to a PNG, with
labelled windows (from --window or a ledger's "windows")."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Iterable

from tuneledger.monitor.rows import UTC, parse_time

_ISO_RE = r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d(?::\d\d(?:\.\d+)?)?(?:Z|z|[+-]\d\d:?\d\d)?"
_WINDOW = re.compile(rf"^(?P<label>.*?):(?P<start>{_ISO_RE}):(?P<end>{_ISO_RE})$")


def parse_window(text: str) -> tuple[str, datetime, datetime]:
    """'preset A:2026-11-29T10:00:00Z:2026-11-29T10:02:00Z' -> (label, start, end). The label may
    hold colons; the times are ISO 8601 (no zone = UTC). Raises ValueError."""
    m = _WINDOW.match(text.strip())
    if not m:
        raise ValueError(f"window {text!r} is not LABEL:START:END with ISO times, e.g. "
                         "'preset A:2026-11-29T10:00:00Z:2026-11-29T10:02:00Z'")
    start, end = parse_time(m["start"]), parse_time(m["end"])
    if end <= start:
        raise ValueError(f"window {text!r} ends before it starts")
    return m["label"] or "window", start, end


def windows_from_ledger(path: str | Path) -> list[tuple[str, datetime, datetime]]:
    """The "windows" list ({label, start, end}, ISO UTC) of a ledger JSON. Raises ValueError."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read ledger JSON ({e})") from None
    wins = data.get("windows") if isinstance(data, dict) else None
    if not isinstance(wins, list):
        raise ValueError(f"{path}: no \"windows\" list of {{label, start, end}}")
    out = []
    for i, w in enumerate(wins):
        try:
            out.append((str(w.get("label") or f"window {i}"), parse_time(w["start"]), parse_time(w["end"])))
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"{path}: windows[{i}] needs ISO 'start' and 'end' ({e})") from None
    return out


def plot(rows: list[dict], out: str | Path, windows: Iterable[tuple[str, datetime, datetime]] = (),
         title: str | None = None) -> Path:
    """Per-GPU utilisation, memory, power and temperature over time, to a PNG (Agg backend).

    Windows are shaded on every panel and labelled on the top one. Unavailable samples show as
    gaps in the lines and red marks along the bottom of the utilisation panel. Raises ValueError
    when no row is an ok GPU sample.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.dates import AutoDateLocator, DateFormatter
    from matplotlib.figure import Figure

    nan = float("nan")
    series: dict[tuple, dict] = {}
    bad_times = []
    for r in rows:
        t = parse_time(r["timestamp"])
        if r.get("gpu") is None or r.get("status") != "ok":
            bad_times.append(t)
            if r.get("gpu") is None:
                continue
        s = series.setdefault((str(r.get("host")), r["gpu"]), {k: [] for k in ("t", "util", "mem", "total", "power", "limit", "temp")})
        ok = r.get("status") == "ok"
        val = lambda k, scale=1.0: (r[k] * scale if ok and r.get(k) is not None else nan)  # noqa: E731
        s["t"].append(t)
        s["util"].append(val("util_gpu_pct"))
        s["mem"].append(val("mem_used_mib", 1 / 1024))
        s["total"].append(val("mem_total_mib", 1 / 1024))
        s["power"].append(val("power_w"))
        s["limit"].append(val("power_limit_w"))
        s["temp"].append(val("temp_c"))
    if not any(v == v for s in series.values() for v in s["mem"]):
        why = next((r.get("error") for r in rows if r.get("error")), "no rows")
        raise ValueError(f"no GPU sample to plot ({why})")

    hosts = {k[0] for k in series}
    fig = Figure(figsize=(12, 10), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(4, 1, sharex=True)
    panels = [("util", None, "GPU utilisation (%)"), ("mem", "total", "memory used (GiB; dashed: total)"),
              ("power", "limit", "power (W; dashed: limit)"), ("temp", None, "temperature (°C)")]
    for i, key in enumerate(sorted(series, key=lambda k: (k[0], k[1]))):
        s = series[key]
        label = f"{key[0]} GPU {key[1]}" if len(hosts) > 1 else f"GPU {key[1]}"
        color = f"C{i % 10}"
        for ax, (k, ref, _) in zip(axes, panels):
            ax.plot(s["t"], s[k], color=color, lw=1.2, label=label if k == "util" else None)
            if ref:
                ax.plot(s["t"], s[ref], color=color, lw=0.8, ls="--", alpha=0.6)
    axes[0].set_ylim(-3, 103)
    try:  # the diagnosis's util thresholds, so the verdict can be read off the plot
        from tuneledger.diagnose import load_thresholds
        th = load_thresholds()
        for y, what in ((th.compute_util_pct, "compute-bound"), (th.host_util_pct, "host-bound below")):
            axes[0].axhline(y, color="grey", lw=0.7, ls=":")
            axes[0].text(0.003, y, f"{y:g}%: {what}", transform=axes[0].get_yaxis_transform(), fontsize=7,
                         va="bottom", color="grey")
    except Exception:
        pass  # a bad thresholds file must not cost the plot
    if bad_times:
        axes[0].plot(bad_times, [0] * len(bad_times), "x", color="red", ms=5, label="unavailable")
    for ax, (_, _, ylabel) in zip(axes, panels):
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    for j, (label, start, end) in enumerate(windows):
        for ax in axes:
            ax.axvspan(start, end, color=f"C{(j + 3) % 10}", alpha=0.12, lw=0)
        axes[0].text(start, 1.01, label, transform=axes[0].get_xaxis_transform(), fontsize=8, va="bottom")
    axes[0].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    days = sorted({t.date() for s in series.values() for t in s["t"]})
    axes[-1].xaxis.set_major_locator(AutoDateLocator(maxticks=12))
    axes[-1].xaxis.set_major_formatter(DateFormatter("%H:%M:%S" if len(days) == 1 else "%m-%d %H:%M", tz=UTC))
    axes[-1].set_xlabel(f"time (UTC, {days[0]})" if len(days) == 1 else "time (UTC)")
    fig.suptitle(title or f"tuneledger monitor: {', '.join(sorted(hosts))}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
