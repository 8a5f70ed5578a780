"""`tuneledger monitor`: sample every GPU through NVML into a daily CSV, and plot it.

    tuneledger monitor [--interval 5] [--out runs/monitor] [--count N] [--host NAME]
    tuneledger monitor plot CSV [CSV ...] [--out PNG] [--window "LABEL:START:END"] [--ledger JSON]

Every --interval seconds, one row per GPU (COLUMNS; units are in the names) is appended to
<out>/<host>-<YYYY-MM-DD>.csv, the UTC date of the sample, header first, flushed after every
sample. A new UTC day opens a new file. NVML is read through nvidia-ml-py (`pynvml`).

The sampler never raises: when NVML is missing (no driver, a container without GPUs), when a call
fails or a GPU falls off the bus, it prints one warning to stderr, writes rows with status
"unavailable" and the reason in `error`, and tries NVML again at the next sample. SIGTERM and
SIGINT end it after the current sample, with exit code 0. It runs at nice +10, so it never
competes with a data loader for a core.

Library use (the dry-run and train ledgers): `InProcessSampler` samples in a daemon thread,
`read_window` reads the sidecar's rows for a time window (`read_rows`: whole CSVs), and
`summarize_window` reduces rows to per-GPU figures for a window.

Exit codes: 0 stopped by --count, SIGTERM or SIGINT (or plot written); 1 plot: no GPU rows, a bad
--window or --ledger.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import socket
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable

UTC = timezone.utc
MIB = 2**20

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
_INT_COLS = {"gpu", "util_gpu_pct", "util_mem_pct", "temp_c", "sm_clock_mhz", "pcie_tx_kbps", "pcie_rx_kbps", "n_procs"}
_FLOAT_COLS = {"mem_used_mib", "mem_total_mib", "power_w", "power_limit_w", "sample_ms"}

# NVML clock event ("throttle") reason bits; the values are NVML's, stable across versions.
THROTTLE_BITS = [
    (0x1, "gpu_idle"), (0x2, "app_clocks"), (0x4, "sw_power_cap"), (0x8, "hw_slowdown"),
    (0x10, "sync_boost"), (0x20, "sw_thermal"), (0x40, "hw_thermal"), (0x80, "hw_power_brake"),
    (0x100, "display_clocks"),
]

# GPUs whose mean utilisation differs by more than this many points in one window are flagged as
# imbalanced. Under DDP every rank runs the same work and waits for the others at each all-reduce,
# so their utilisation should match; a spread this large means one GPU is slower (throttled,
# shared with another process, on a slower link) and holds the others at every sync. 15 points is
# a judgement, well above the difference of a few points expected between identical ranks: check
# it against the device runs. diagnose.DiagnosisThresholds.imbalance_util_pts carries the same.
IMBALANCE_UTIL_PTS = 15.0


# ------------------------------------------------------------------------------------- backends
class NvmlError(Exception):
    """An NVML call failed. `kind`: "missing" (no library, no driver), "lost" (the GPU fell off the
    bus or NVML must be initialised again), "unsupported" (this GPU has no such counter), "error"."""

    def __init__(self, message: str, kind: str = "error"):
        super().__init__(message)
        self.kind = kind


class PynvmlBackend:
    """The real backend: the pynvml calls the monitor uses, in the units of COLUMNS.

    Every method raises NvmlError (never pynvml.NVMLError). pynvml is imported by `init()`, so
    constructing one costs nothing and works without nvidia-ml-py installed.
    """

    def __init__(self) -> None:
        self._nv: Any = None
        self._mem_v2 = True

    def _call(self, fn: Callable, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._nv.NVMLError as e:
            raise self._translate(e) from None

    def _translate(self, e: Any) -> NvmlError:
        nv, code = self._nv, getattr(e, "value", None)
        missing = {nv.NVML_ERROR_LIBRARY_NOT_FOUND, nv.NVML_ERROR_DRIVER_NOT_LOADED,
                   nv.NVML_ERROR_LIB_RM_VERSION_MISMATCH, nv.NVML_ERROR_NO_PERMISSION}
        # UNINITIALIZED: someone else shut NVML down under us; a fresh init fixes it like a lost GPU.
        lost = {nv.NVML_ERROR_GPU_IS_LOST, nv.NVML_ERROR_RESET_REQUIRED, nv.NVML_ERROR_UNINITIALIZED,
                getattr(nv, "NVML_ERROR_GPU_NOT_FOUND", -1)}
        unsupported = {nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND, nv.NVML_ERROR_NO_DATA}
        kind = "missing" if code in missing else "lost" if code in lost else "unsupported" if code in unsupported else "error"
        return NvmlError(str(e), kind)

    def init(self) -> None:
        try:
            import pynvml
        except ImportError as e:
            raise NvmlError(f"nvidia-ml-py is not installed ({e})", "missing") from None
        self._nv = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            err = self._translate(e)
            err.kind = "missing"  # whatever the code, without init there is no GPU to read
            raise err from None

    def shutdown(self) -> None:
        if self._nv is not None:
            try:
                self._nv.nvmlShutdown()
            except Exception:
                pass  # already down, or the driver went away: nothing left to release

    def device_count(self) -> int:
        return int(self._call(self._nv.nvmlDeviceGetCount))

    def handle(self, index: int) -> Any:
        return self._call(self._nv.nvmlDeviceGetHandleByIndex, index)

    @staticmethod
    def _str(v: Any) -> str:
        return v.decode(errors="replace") if isinstance(v, bytes) else str(v)

    def uuid(self, h: Any) -> str:
        return self._str(self._call(self._nv.nvmlDeviceGetUUID, h))

    def name(self, h: Any) -> str:
        return self._str(self._call(self._nv.nvmlDeviceGetName, h))

    def memory_mib(self, h: Any) -> tuple[float, float]:
        """(used, total) MiB. Memory v2 where the driver has it: its `used` leaves out the memory
        the driver and firmware reserve, so an idle GPU reads near 0, not several hundred MiB."""
        nv = self._nv
        if self._mem_v2 and hasattr(nv, "nvmlMemory_v2"):
            try:
                m = self._call(nv.nvmlDeviceGetMemoryInfo, h, nv.nvmlMemory_v2)
                return m.used / MIB, m.total / MIB
            except NvmlError as e:
                if e.kind == "lost":
                    raise
                self._mem_v2 = False  # old driver: fall back to v1 for good
        m = self._call(nv.nvmlDeviceGetMemoryInfo, h)
        return m.used / MIB, m.total / MIB

    def utilization(self, h: Any) -> tuple[int, int]:
        u = self._call(self._nv.nvmlDeviceGetUtilizationRates, h)
        return int(u.gpu), int(u.memory)

    def power_w(self, h: Any) -> float:
        return self._call(self._nv.nvmlDeviceGetPowerUsage, h) / 1000.0

    def power_limit_w(self, h: Any) -> float:
        return self._call(self._nv.nvmlDeviceGetEnforcedPowerLimit, h) / 1000.0

    def temperature_c(self, h: Any) -> int:
        return int(self._call(self._nv.nvmlDeviceGetTemperature, h, self._nv.NVML_TEMPERATURE_GPU))

    def sm_clock_mhz(self, h: Any) -> int:
        return int(self._call(self._nv.nvmlDeviceGetClockInfo, h, self._nv.NVML_CLOCK_SM))

    def pcie_kbps(self, h: Any) -> tuple[int, int]:
        """(tx, rx) KB/s. NVML measures each counter over a 20 ms window inside the call, so this
        is the slowest query here (about 40 ms per GPU): InProcessSampler leaves it out."""
        nv = self._nv
        tx = self._call(nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_TX_BYTES)
        rx = self._call(nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_RX_BYTES)
        return int(tx), int(rx)

    def throttle_reasons(self, h: Any) -> int:
        nv = self._nv
        fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        return int(self._call(fn, h))

    def compute_processes(self, h: Any) -> list[tuple[int, float | None]]:
        """(pid, used MiB or None) per compute process. Inside a container without the host's PID
        namespace NVML may list none, so callers must not read "no process" as "no memory"."""
        procs = self._call(self._nv.nvmlDeviceGetComputeRunningProcesses, h)
        return [(int(p.pid), p.usedGpuMemory / MIB if p.usedGpuMemory is not None else None) for p in procs]


@dataclass
class FakeGpu:
    """One simulated GPU for FakeNvml. Mutate its fields between samples to script a trace.
    `lost` makes every query raise like a GPU that fell off the bus; `unsupported` names queries
    (FakeNvml method names) that raise "unsupported"."""

    name: str = "NVIDIA H200"
    uuid: str = ""
    total_mib: float = 143771.0  # illustrative, not a measurement
    used_mib: float = 0.0
    util_gpu: int = 0
    util_mem: int = 0
    power_w: float = 75.0
    power_limit_w: float = 700.0
    temp_c: int = 30
    sm_clock_mhz: int = 1980
    pcie_tx_kbps: int = 0
    pcie_rx_kbps: int = 0
    throttle: int = 0
    procs: list[tuple[int, float | None]] = field(default_factory=list)
    lost: bool = False
    unsupported: set[str] = field(default_factory=set)


class FakeNvml:
    """A backend with PynvmlBackend's interface and no GPU: for tests, demos and `--fake N`.

    `missing=True` makes init() fail like a machine without the NVIDIA driver; clear it to let
    a later init succeed. `calls` counts init() attempts; `tick` hook (if set) is called with the
    backend at each device_count(), i.e. once per sample, to script changes over time.
    """

    def __init__(self, gpus: list[FakeGpu] | None = None, missing: bool = False,
                 tick: Callable[[FakeNvml], None] | None = None):
        self.gpus = list(gpus or [])
        for i, g in enumerate(self.gpus):
            g.uuid = g.uuid or f"GPU-fake-{i:04d}"
        self.missing = missing
        self.tick = tick
        self.up = False
        self.inits = 0
        self.samples = 0

    @classmethod
    def h200s(cls, n: int, busy: bool = True) -> FakeNvml:
        """n fake H200s that, when busy, cycle through a training-like pattern (for `--fake`)."""
        def tick(b: FakeNvml) -> None:
            k = b.samples
            for i, g in enumerate(b.gpus):
                g.util_gpu = (25 + (k * 7 + i * 3) % 20) if busy else 0
                g.used_mib = 11264.0 + 128 * i if busy else 0.0
                g.power_w = 180.0 + g.util_gpu * 2.5
                g.temp_c = 35 + g.util_gpu // 5
                g.procs = [(4000 + i, g.used_mib - 512)] if busy else []
        return cls([FakeGpu() for _ in range(n)], tick=tick)

    def _gpu(self, h: int) -> FakeGpu:
        if not self.up:
            raise NvmlError("Uninitialized", "lost")
        g = self.gpus[h]
        if g.lost:
            raise NvmlError("GPU is lost", "lost")
        return g

    def _q(self, h: int, what: str) -> FakeGpu:
        g = self._gpu(h)
        if what in g.unsupported:
            raise NvmlError("Not Supported", "unsupported")
        return g

    def init(self) -> None:
        self.inits += 1
        if self.missing:
            raise NvmlError("NVML Shared Library Not Found", "missing")
        self.up = True

    def shutdown(self) -> None:
        self.up = False

    def device_count(self) -> int:
        if not self.up:
            raise NvmlError("Uninitialized", "lost")
        if self.tick:
            self.tick(self)
        self.samples += 1
        return len(self.gpus)

    def handle(self, index: int) -> int:
        self._gpu(index)
        return index

    def uuid(self, h: int) -> str:
        return self._q(h, "uuid").uuid

    def name(self, h: int) -> str:
        return self._q(h, "name").name

    def memory_mib(self, h: int) -> tuple[float, float]:
        g = self._q(h, "memory_mib")
        return g.used_mib, g.total_mib

    def utilization(self, h: int) -> tuple[int, int]:
        g = self._q(h, "utilization")
        return g.util_gpu, g.util_mem

    def power_w(self, h: int) -> float:
        return self._q(h, "power_w").power_w

    def power_limit_w(self, h: int) -> float:
        return self._q(h, "power_limit_w").power_limit_w

    def temperature_c(self, h: int) -> int:
        return self._q(h, "temperature_c").temp_c

    def sm_clock_mhz(self, h: int) -> int:
        return self._q(h, "sm_clock_mhz").sm_clock_mhz

    def pcie_kbps(self, h: int) -> tuple[int, int]:
        g = self._q(h, "pcie_kbps")
        return g.pcie_tx_kbps, g.pcie_rx_kbps

    def throttle_reasons(self, h: int) -> int:
        return self._q(h, "throttle_reasons").throttle

    def compute_processes(self, h: int) -> list[tuple[int, float | None]]:
        return list(self._q(h, "compute_processes").procs)


# ------------------------------------------------------------------------------------- sampling
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


def throttle_names(mask: int) -> str:
    names = [n for bit, n in THROTTLE_BITS if mask & bit]
    rest = mask & ~sum(bit for bit, _ in THROTTLE_BITS)
    return "+".join(names + ([hex(rest)] if rest else []))


def blank_row(ts: str, host: str, **kw: Any) -> dict:
    row = dict.fromkeys(COLUMNS)
    row.update(timestamp=ts, host=host, status="ok")
    row.update(kw)
    return row


def _sample_gpu(backend: Any, index: int, ts: str, host: str, pcie: bool) -> dict:
    row = blank_row(ts, host, gpu=index)
    # Identity and memory are the row's reason to exist: if these fail the GPU is unavailable.
    try:
        h = backend.handle(index)
        row["uuid"] = backend.uuid(h)
        row["name"] = backend.name(h)
        used, total = backend.memory_mib(h)
        row["mem_used_mib"], row["mem_total_mib"] = round(used, 1), round(total, 1)
    except NvmlError as e:
        row.update(status="unavailable", error=f"GPU {index}: {e}")
        return row
    errors: list[str] = []

    def read(what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except NvmlError as e:
            if e.kind == "lost":
                raise
            if e.kind != "unsupported":  # unsupported counters stay blank without noise
                errors.append(f"{what}: {e}")
            return None

    try:
        u = read("utilization", lambda: backend.utilization(h))
        if u:
            row["util_gpu_pct"], row["util_mem_pct"] = u
        p = read("power", lambda: backend.power_w(h))
        row["power_w"] = round(p, 1) if p is not None else None
        p = read("power limit", lambda: backend.power_limit_w(h))
        row["power_limit_w"] = round(p, 1) if p is not None else None
        row["temp_c"] = read("temperature", lambda: backend.temperature_c(h))
        row["sm_clock_mhz"] = read("sm clock", lambda: backend.sm_clock_mhz(h))
        if pcie:
            x = read("pcie", lambda: backend.pcie_kbps(h))
            if x:
                row["pcie_tx_kbps"], row["pcie_rx_kbps"] = x
        t = read("throttle", lambda: backend.throttle_reasons(h))
        row["throttle"] = throttle_names(t) if t is not None else None
        procs = read("processes", lambda: backend.compute_processes(h))
        if procs is not None:
            row["n_procs"] = len(procs)
            row["procs"] = ";".join(f"{pid}:{'?' if mib is None else round(mib)}" for pid, mib in procs)
    except NvmlError as e:  # lost mid-row
        row.update(status="unavailable", error=f"GPU {index}: {e}")
        return row
    row["error"] = "; ".join(errors) or None
    return row


def sample(backend: Any, host: str, *, pcie: bool = True, now: datetime | None = None) -> list[dict]:
    """One sample of every GPU: a list of rows (dicts keyed by COLUMNS, None = not measured).

    The backend must be initialised. A GPU whose identity or memory cannot be read gets a row with
    status "unavailable"; a counter that fails is left empty and named in `error`. With no GPU,
    one row with gpu None says so. Raises NvmlError only when the device count itself fails.
    """
    ts = iso(now or datetime.now(UTC))
    n = backend.device_count()
    if n == 0:
        return [blank_row(ts, host, status="unavailable", error="no GPU: NVML sees 0 devices")]
    return [_sample_gpu(backend, i, ts, host, pcie) for i in range(n)]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Monitor:
    """Sampling that survives anything: initialises NVML when needed, turns every failure into
    unavailable rows, prints one warning per new failure and one line when sampling recovers.

    After any unavailable row it shuts NVML down and initialises it again at the next poll, since
    handles can go stale after a GPU reset. GPUs seen before and missing now (fell off the bus)
    keep getting unavailable rows under their last index and UUID.
    """

    def __init__(self, backend: Any = None, host: str | None = None, *, pcie: bool = True,
                 warn: Callable[[str], None] | None = None):
        self.backend = backend if backend is not None else PynvmlBackend()
        self.host = host or default_host()
        self.pcie = pcie
        self.warn = warn or (lambda m: _stderr(f"tuneledger monitor: warning: {m}"))
        self.known: dict[str, tuple[int, str]] = {}  # uuid -> (last index, name)
        self._up = False
        self._warned: set[str] = set()

    def _warn_once(self, msg: str) -> None:
        if msg not in self._warned:
            self._warned.add(msg)
            self.warn(msg)

    def _reset(self) -> None:
        if self._up:
            self.backend.shutdown()
        self._up = False

    def _down_rows(self, ts: str, reason: str) -> list[dict]:
        if not self.known:
            return [blank_row(ts, self.host, status="unavailable", error=reason)]
        return [blank_row(ts, self.host, gpu=i, uuid=u, name=n, status="unavailable", error=reason)
                for u, (i, n) in sorted(self.known.items(), key=lambda kv: kv[1][0])]

    def poll(self, now: datetime | None = None) -> list[dict]:
        """One sample; never raises. Each row carries the sample's own wall time in sample_ms."""
        now = now or datetime.now(UTC)
        t0 = time.perf_counter()
        try:
            rows = self._poll(now)
        except Exception as e:  # a bug here must not end the sidecar or the run it watches
            self._reset()
            reason = f"monitor error: {e!r}"
            self._warn_once(reason)
            rows = self._down_rows(iso(now), reason)
        ms = round((time.perf_counter() - t0) * 1e3, 3)
        for r in rows:
            r["sample_ms"] = ms
        return rows

    def _poll(self, now: datetime) -> list[dict]:
        ts = iso(now)
        if not self._up:
            try:
                self.backend.init()
            except NvmlError as e:
                reason = f"no GPU: NVML unavailable ({e})"
                self._warn_once(reason + "; writing unavailable rows and retrying every sample")
                return self._down_rows(ts, reason)
            self._up = True
        try:
            rows = sample(self.backend, self.host, pcie=self.pcie, now=now)
        except NvmlError as e:
            self._reset()
            reason = f"NVML failed: {e}"
            self._warn_once(reason)
            return self._down_rows(ts, reason)
        by_index = {i: (u, n) for u, (i, n) in self.known.items()}
        for r in rows:  # a lost GPU's row has no UUID of its own: name it from the last sample
            if r["status"] != "ok" and not r["uuid"] and r["gpu"] in by_index:
                r["uuid"], r["name"] = by_index[r["gpu"]]
        seen = {r["uuid"] for r in rows if r["uuid"]}
        for u, (i, n) in sorted(self.known.items(), key=lambda kv: kv[1][0]):
            if u not in seen:
                rows.append(blank_row(ts, self.host, gpu=i, uuid=u, name=n, status="unavailable",
                                      error=f"GPU {i} ({u}) no longer visible to NVML (fell off the bus?)"))
        for r in rows:
            if r["status"] == "ok" and r["uuid"]:
                self.known[r["uuid"]] = (r["gpu"], r["name"])
        bad = [r for r in rows if r["status"] != "ok"]
        for r in bad:
            self._warn_once(r["error"])
        if bad:
            self._reset()
        elif self._warned:
            _stderr(f"tuneledger monitor: all {len(rows)} GPU(s) sampled again")
            self._warned.clear()
        return rows

    def close(self) -> None:
        self._reset()


def default_host() -> str:
    """$TUNELEDGER_HOST, else the host name. Set it in a container: its host name is its id."""
    return os.environ.get("TUNELEDGER_HOST") or socket.gethostname()


# ------------------------------------------------------------------------------------- CSV
def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "host"


def _cell(v: Any) -> Any:
    return "" if v is None else v


class CsvLog:
    """Appends sample rows to <out_dir>/<host>-<YYYY-MM-DD>.csv, switching file when the UTC date
    of a sample changes. Writes the header into a new or empty file and flushes every sample. An
    existing file with a different header (an older column set) is left alone: rows go to
    <host>-<date>.1.csv (.2, ...) instead, so one file never mixes two layouts."""

    def __init__(self, out_dir: str | Path, host: str):
        self.out_dir = Path(out_dir)
        self.host = _safe(host)
        self._f: Any = None
        self._date: str | None = None
        self.path: Path | None = None

    def _open(self, date: str) -> None:
        self.close()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        header = ",".join(COLUMNS)
        k = 0
        while True:
            p = self.out_dir / (f"{self.host}-{date}.csv" if k == 0 else f"{self.host}-{date}.{k}.csv")
            if not p.exists() or p.stat().st_size == 0:
                break
            with open(p, encoding="utf-8") as f:
                if f.readline().rstrip("\r\n") == header:
                    break
            k += 1
        new = not p.exists() or p.stat().st_size == 0
        self._f = open(p, "a", newline="", encoding="utf-8")
        self._w = csv.writer(self._f, lineterminator="\n")
        if new:
            self._w.writerow(COLUMNS)
        self._date, self.path = date, p

    def write(self, rows: list[dict]) -> Path | None:
        """Append one sample's rows and flush. Returns the file written."""
        if not rows:
            return self.path
        date = str(rows[0]["timestamp"])[:10]
        if date != self._date:
            self._open(date)
        for r in rows:
            self._w.writerow([_cell(r.get(c)) for c in COLUMNS])
        self._f.flush()
        return self.path

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None


def _typed(raw: dict) -> dict:
    row = dict.fromkeys(COLUMNS)
    for k, v in raw.items():
        if k is None:
            continue
        if v is None or v == "":
            row[k] = None
        elif k in _INT_COLS:
            row[k] = int(float(v))
        elif k in _FLOAT_COLS:
            row[k] = float(v)
        else:
            row[k] = v
    return row


def read_rows(paths: str | Path | Iterable[str | Path]) -> list[dict]:
    """Rows from monitor CSVs (files, or folders whose *.csv are read in name order), typed as
    `sample` returns them. Raises FileNotFoundError for a path that does not exist."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.glob("*.csv"))
        elif p.exists():
            files.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such monitor CSV")
    rows: list[dict] = []
    for f in files:
        with open(f, newline="", encoding="utf-8") as fh:
            rows += [_typed(r) for r in csv.DictReader(fh)]
    return rows


_DATED = re.compile(r"-(\d{4}-\d\d-\d\d)(?:\.\d+)?\.csv$")


def read_window(out_dir: str | Path, start_iso: str | datetime, end_iso: str | datetime,
                host: str | None = None) -> list[dict]:
    """The sidecar's rows between start and end (inclusive), reading only the daily files that can
    hold them (<host>-<date>[.k].csv for the UTC dates of the window; any host unless given).
    Returns [] when the folder or the files do not exist: no sidecar ran."""
    t0, t1 = parse_time(start_iso), parse_time(end_iso)
    folder = Path(out_dir)
    if not folder.is_dir():
        return []
    days = {t0.date().isoformat(), t1.date().isoformat()}
    d = t0.date()
    while d.isoformat() < t1.date().isoformat():  # windows that span more than two days
        days.add(d.isoformat())
        d = d.fromordinal(d.toordinal() + 1)
    prefix = f"{_safe(host)}-" if host else ""
    files = [f for f in sorted(folder.glob("*.csv"))
             if (m := _DATED.search(f.name)) and m[1] in days and f.name.startswith(prefix)
             and (not host or f.name[len(prefix):len(prefix) + 10] == m[1])]
    return [r for r in (read_rows(files) if files else []) if t0 <= parse_time(r["timestamp"]) <= t1]


# ------------------------------------------------------------------------------------- in-process
class InProcessSampler:
    """Samples NVML in a daemon thread while a dry-run or train step loop runs in this process.

        sampler = InProcessSampler(interval=1.0).start()   # on local rank 0 only
        ...                                                 # the measured steps
        rows = sampler.stop()                               # then summarize_window(rows, start, end)

    PCIe counters are left out (each costs ~20 ms of blocking NVML time per GPU). NVML sees every
    GPU of the machine whatever CUDA_VISIBLE_DEVICES says: pass `gpus` to summarize_window to keep
    the ones the job used. `max_rows` bounds memory (a row is ~1-2 KB; the default holds 2.5 h of
    8 GPUs at 1 s); the oldest rows go first. With `out_dir`, rows are also appended to the same
    daily CSV the sidecar writes, so `tuneledger monitor plot` can draw them. Never raises from
    the thread; stop() returns what was collected.
    """

    def __init__(self, interval: float = 1.0, backend: Any = None, host: str | None = None, *,
                 pcie: bool = False, out_dir: str | Path | None = None, max_rows: int = 72_000):
        if interval <= 0:
            raise ValueError(f"interval must be > 0 s, got {interval}")
        self.interval = interval
        self.monitor = Monitor(backend, host, pcie=pcie,
                               warn=lambda m: _stderr(f"tuneledger: GPU sampler: warning: {m}"))
        self.log = CsvLog(out_dir, self.monitor.host) if out_dir is not None else None
        self.max_rows = max_rows
        self._rows: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> InProcessSampler:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tuneledger-gpu-sampler", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            rows = self.monitor.poll()
            with self._lock:
                self._rows.extend(rows)
                if len(self._rows) > self.max_rows:
                    del self._rows[: len(self._rows) - self.max_rows]
            if self.log:
                try:
                    self.log.write(rows)
                except OSError as e:
                    self.monitor._warn_once(f"cannot write {self.log.path}: {e}")
            next_t = max(next_t + self.interval, time.monotonic())  # late: skip, don't burst
            self._stop.wait(next_t - time.monotonic())

    @property
    def rows(self) -> list[dict]:
        with self._lock:
            return list(self._rows)

    def stop(self, timeout: float = 5.0) -> list[dict]:
        """Stop the thread (waiting at most `timeout` s for a sample in flight) and return the rows."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self.monitor.close()  # else an NVML call hangs in the thread: leave NVML to it (a daemon)
        if self.log:
            self.log.close()
        return self.rows

    def __enter__(self) -> InProcessSampler:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# ------------------------------------------------------------------------------------- summaries
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


# ------------------------------------------------------------------------------------- plot
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


# ------------------------------------------------------------------------------------- the verb
def _positive(kind: type) -> Callable[[str], Any]:
    def conv(s: str) -> Any:
        v = kind(s)
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
        return v
    return conv


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "monitor", help="sample every GPU (NVML) into runs/monitor/<host>-<date>.csv; `monitor plot CSV` draws it",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--interval", type=_positive(float), default=5.0, metavar="S", help="seconds between samples (default 5)")
    p.add_argument("--out", default="runs/monitor", metavar="DIR", help="CSV folder (default runs/monitor)")
    p.add_argument("--count", type=_positive(int), default=None, metavar="N", help="stop after N samples (default: run until SIGTERM/SIGINT)")
    p.add_argument("--host", default=None, help="host name for rows and file names (default $TUNELEDGER_HOST or the host name)")
    p.add_argument("--no-pcie", action="store_true", help="skip the PCIe counters (NVML spends ~20 ms per counter per GPU on them)")
    p.add_argument("--fake", type=_positive(int), default=None, metavar="N", help="sample N simulated GPUs instead of NVML (tests, demos)")
    p.set_defaults(func=run)
    acts = p.add_subparsers(dest="action", metavar="ACTION")
    pp = acts.add_parser("plot", help="draw util, memory, power and temperature per GPU from monitor CSVs to a PNG",
                         description=plot.__doc__)
    pp.add_argument("csv", nargs="+", help="monitor CSV files or folders")
    pp.add_argument("--out", dest="png", default=None, metavar="PNG", help="output (default: the first CSV with .png)")
    pp.add_argument("--window", action="append", default=[], metavar="LABEL:START:END",
                    help="shade a window, e.g. 'preset A:2026-11-29T10:00:00Z:2026-11-29T10:02:00Z' (repeatable)")
    pp.add_argument("--ledger", action="append", default=[], metavar="JSON", help="shade the \"windows\" of a ledger JSON (repeatable)")
    pp.add_argument("--title", default=None)
    pp.set_defaults(func=run_plot)


def run_plot(args: argparse.Namespace) -> int:
    try:
        windows = [parse_window(w) for w in args.window]
        for path in args.ledger:
            windows += windows_from_ledger(path)
        rows = read_rows(args.csv)
        first = Path(args.csv[0])
        out = Path(args.png) if args.png else (first.with_suffix(".png") if first.is_file() else first / "monitor.png")
        plot(rows, out, windows, args.title)
    except (ValueError, FileNotFoundError) as e:
        print(f"tuneledger monitor plot: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


def run_loop(monitor: Monitor, log: CsvLog, interval: float, count: int | None,
             stop: threading.Event) -> dict:
    """Sample every `interval` s until `count` samples or `stop` is set. Returns the overhead:
    samples, wall ms per sample (mean, max) and this process's CPU % of one core over the run."""
    walls: list[float] = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    next_t = time.monotonic()
    while not stop.is_set():
        t = time.perf_counter()
        rows = monitor.poll()
        try:
            log.write(rows)
        except OSError as e:  # disk full, folder gone: keep sampling, say it once
            monitor._warn_once(f"cannot write {log.path or log.out_dir}: {e}")
        walls.append((time.perf_counter() - t) * 1e3)
        if count and len(walls) >= count:
            break
        next_t = max(next_t + interval, time.monotonic())  # overran: skip ahead, never burst
        stop.wait(next_t - time.monotonic())
    elapsed = time.perf_counter() - wall0
    return {"samples": len(walls), "wall_ms_mean": statistics.fmean(walls) if walls else 0.0,
            "wall_ms_max": max(walls, default=0.0),
            "cpu_pct": 100 * (time.process_time() - cpu0) / elapsed if elapsed > 0 else 0.0}


def run(args: argparse.Namespace) -> int:
    try:
        os.nice(10)  # lowering one's own priority needs no privilege
    except OSError:
        pass
    backend = FakeNvml.h200s(args.fake) if args.fake else PynvmlBackend()
    monitor = Monitor(backend, args.host, pcie=not args.no_pcie)
    log = CsvLog(args.out, monitor.host)
    try:  # an unwritable --out must fail now, not leave a sidecar that records nothing
        Path(args.out).mkdir(parents=True, exist_ok=True)
        probe = Path(args.out) / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        _stderr(f"tuneledger monitor: cannot write to --out {args.out}: {e.strerror or e}")
        return 1
    stop = threading.Event()
    handler = lambda signum, frame: stop.set()  # noqa: E731
    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    _stderr(f"tuneledger monitor: sampling {'fake ' if args.fake else ''}GPUs every {args.interval:g} s into "
            f"{Path(args.out) / (_safe(monitor.host) + '-<UTC date>.csv')} "
            f"({f'{args.count} samples' if args.count else 'until SIGTERM/SIGINT'})")
    try:
        stats = run_loop(monitor, log, args.interval, args.count, stop)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        monitor.close()
        log.close()
    _stderr(f"tuneledger monitor: stopped after {stats['samples']} samples; per sample {stats['wall_ms_mean']:.2f} ms "
            f"wall (max {stats['wall_ms_max']:.2f}); CPU {stats['cpu_pct']:.2f}% of one core; last file {log.path}")
    return 0
