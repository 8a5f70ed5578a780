"""The window summary: monitor rows (from the sampler or the CSV log) of one time window reduced to
per-GPU figures, a plain dict the ledgers store and the diagnosis reads."""

from __future__ import annotations

import os
import statistics
from datetime import datetime
from typing import Iterable

from tuneledger.diagnose import IMBALANCE_UTIL_PTS
from tuneledger.monitor.rows import iso, parse_time


def _match_gpu(row: dict, gpus: Iterable[int | str] | None) -> bool:
    if gpus is None:
        return True
    for g in gpus:
        s = str(g)
        if s.startswith("GPU-") or s.startswith("MIG-"):
            if row.get("uuid") and str(row["uuid"]).startswith(s):
                return True
        elif row.get("gpu") is not None and str(row["gpu"]) == s:
            return True
    return False


def visible_gpus(env: dict | None = None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a `gpus` filter for summarize_window (indices or UUID prefixes),
    or None when it is unset. NVML indices follow PCI bus order; CUDA's follow it too when the
    GPUs are all alike or CUDA_DEVICE_ORDER=PCI_BUS_ID, so on mixed machines prefer UUIDs."""
    v = (env if env is not None else os.environ).get("CUDA_VISIBLE_DEVICES")
    if v is None:
        return None
    return [s.strip() for s in v.split(",") if s.strip()]


def summarize_window(rows: list[dict], start_iso: str | datetime, end_iso: str | datetime, *,
                     gpus: Iterable[int | str] | None = None,
                     imbalance_util_pts: float = IMBALANCE_UTIL_PTS) -> dict:
    """Reduce monitor rows to per-GPU figures over [start, end] (inclusive, UTC).

    Rows may come from `sample`/InProcessSampler or `read_rows` (several hosts are fine: a GPU is
    (host, index)). `gpus` keeps only those NVML indices or UUID prefixes. Returns:
      gpus: per GPU {host, gpu, uuid, name, samples, unavailable_samples, util_mean_pct,
            util_min_pct, util_max_pct, mem_used_mean_mib, mem_used_max_mib, mem_total_mib,
            mem_peak_frac, power_mean_w};
      util_mean_pct (mean over GPUs of their means), util_spread_pts (max - min of those means),
      mem_used_max_mib, mem_peak_frac (max over GPUs of max used / total), power_total_mean_w,
      samples (distinct timestamps), imbalance (util spread > imbalance_util_pts), and note
      (None, or why figures are missing). Figures are None when no sample was ok.
    Raises ValueError for an unreadable time or end before start.
    """
    t0, t1 = parse_time(start_iso), parse_time(end_iso)
    if t1 < t0:
        raise ValueError(f"window ends ({iso(t1)}) before it starts ({iso(t0)})")
    inside = [r for r in rows if t0 <= parse_time(r["timestamp"]) <= t1 and _match_gpu(r, gpus)]
    per: dict[tuple, dict] = {}
    reasons: list[str] = []
    for r in inside:
        if r.get("gpu") is None:  # a "no GPU" row
            reasons.append(str(r.get("error")))
            continue
        g = per.setdefault((r.get("host"), r["gpu"]), {"host": r.get("host"), "gpu": r["gpu"], "uuid": r.get("uuid"),
                                                       "name": r.get("name"), "ok": [], "unavailable": 0})
        if r.get("status") == "ok":
            g["ok"].append(r)
        else:
            g["unavailable"] += 1
            reasons.append(str(r.get("error")))
    out_gpus = []
    for key in sorted(per, key=lambda k: (str(k[0]), k[1])):
        g = per[key]
        ok = g.pop("ok")
        util = [r["util_gpu_pct"] for r in ok if r.get("util_gpu_pct") is not None]
        mem = [r["mem_used_mib"] for r in ok if r.get("mem_used_mib") is not None]
        total = max((r["mem_total_mib"] for r in ok if r.get("mem_total_mib")), default=None)
        power = [r["power_w"] for r in ok if r.get("power_w") is not None]
        out_gpus.append({
            **{k: g[k] for k in ("host", "gpu", "uuid", "name")},
            "samples": len(ok), "unavailable_samples": g["unavailable"],
            "util_mean_pct": statistics.fmean(util) if util else None,
            "util_min_pct": min(util) if util else None, "util_max_pct": max(util) if util else None,
            "mem_used_mean_mib": statistics.fmean(mem) if mem else None,
            "mem_used_max_mib": max(mem) if mem else None, "mem_total_mib": total,
            "mem_peak_frac": max(mem) / total if mem and total else None,
            "power_mean_w": statistics.fmean(power) if power else None,
        })
    means = [g["util_mean_pct"] for g in out_gpus if g["util_mean_pct"] is not None]
    fracs = [g["mem_peak_frac"] for g in out_gpus if g["mem_peak_frac"] is not None]
    powers = [g["power_mean_w"] for g in out_gpus if g["power_mean_w"] is not None]
    spread = max(means) - min(means) if means else None
    imbalance = spread is not None and len(means) > 1 and spread > imbalance_util_pts
    note = None
    if not inside:
        note = "no monitor samples in this window"
    elif not means and not fracs:
        note = f"no GPU sample in this window: {reasons[0] if reasons else 'unavailable'}"
    return {
        "start": iso(t0), "end": iso(t1),
        "samples": len({r["timestamp"] for r in inside}),
        "gpus": out_gpus,
        "util_mean_pct": statistics.fmean(means) if means else None,
        "util_spread_pts": spread,
        "mem_used_max_mib": max((g["mem_used_max_mib"] for g in out_gpus if g["mem_used_max_mib"] is not None), default=None),
        "mem_peak_frac": max(fracs) if fracs else None,
        "power_total_mean_w": sum(powers) if powers else None,
        "imbalance": imbalance,
        "imbalance_rule": f"mean util differs by more than {imbalance_util_pts:g} points between GPUs",
        "note": note,
    }
