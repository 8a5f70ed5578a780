"""The monitor's sample row: one dict per GPU per sample, keyed by COLUMNS (units in the names,
None = not measured), and its UTC timestamps. Every other part of the monitor reads and writes these."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any

UTC = timezone.utc

# One row per GPU per sample. Empty cell = not measured (no GPU, unsupported counter, error).
COLUMNS = [
    "timestamp",      # ISO 8601 UTC with milliseconds, e.g. 2026-11-29T10:00:05.123Z; one per sample
    "host",
    "gpu",            # NVML index (PCI bus order; CUDA_VISIBLE_DEVICES does not renumber it)
    "uuid",
    "name",
    "status",         # ok | unavailable
    "util_gpu_pct",   # % of the last driver sample period in which any kernel ran
    "util_mem_pct",   # % of that period in which device memory was read or written
    "mem_used_mib",
    "mem_total_mib",
    "power_w",
    "power_limit_w",  # enforced limit
    "temp_c",
    "sm_clock_mhz",
    "pcie_tx_kbps",   # KB/s, NVML's PCIe throughput counters
    "pcie_rx_kbps",
    "throttle",       # clock event reasons joined by '+', e.g. sw_power_cap+sw_thermal; empty = none
    "n_procs",        # compute processes on this GPU
    "procs",          # pid:MiB;pid:MiB ('?' where NVML does not give the memory)
    "sample_ms",      # wall time this sample took, all GPUs together: the monitor's own overhead
    "error",          # why the row is unavailable, or which counters failed
]
INT_COLS = {"gpu", "util_gpu_pct", "util_mem_pct", "temp_c", "sm_clock_mhz", "pcie_tx_kbps", "pcie_rx_kbps", "n_procs"}
FLOAT_COLS = {"mem_used_mib", "mem_total_mib", "power_w", "power_limit_w", "sample_ms"}


def iso(t: datetime) -> str:
    """2026-11-29T10:00:05.123Z (UTC, milliseconds)."""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


_FRACTION = re.compile(r"^(.*[T ]\d\d:\d\d:\d\d)\.(\d+)(.*)$")


def parse_time(value: str | datetime | float) -> datetime:
    """An aware UTC datetime from ISO 8601 ('Z', an offset, or none = UTC), a datetime or an epoch
    in s. Raises ValueError on anything else."""
    if isinstance(value, datetime):
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    if isinstance(value, (int, float)):
        return datetime.fromtimestamp(value, UTC)
    t = str(value).strip()
    if t[-1:] in ("Z", "z"):
        t = t[:-1] + "+00:00"
    m = _FRACTION.match(t)
    if m:  # Python 3.10's fromisoformat takes exactly 3 or 6 fraction digits
        t = f"{m[1]}.{(m[2] + '000000')[:6]}{m[3]}"
    d = datetime.fromisoformat(t)
    return d.replace(tzinfo=UTC) if d.tzinfo is None else d.astimezone(UTC)


def blank_row(ts: str, host: str, **kw: Any) -> dict:
    row = dict.fromkeys(COLUMNS)
    row.update(timestamp=ts, host=host, status="ok")
    row.update(kw)
    return row
