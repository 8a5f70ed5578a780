"""Sampling: `sample` reads every GPU once into rows (rows.COLUMNS); `Monitor` wraps it so that
it never raises (missing NVML, failing counters, lost GPUs become "unavailable" rows); and
`InProcessSampler` runs a Monitor in a daemon thread beside a dry-run or train step loop."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from tuneledger.monitor.backends import NvmlError, PynvmlBackend
from tuneledger.monitor.csvlog import CsvLog
from tuneledger.monitor.rows import UTC, blank_row, iso
from tuneledger.words import plural

# NVML clock event ("throttle") reason bits; the values are NVML's, stable across versions.
THROTTLE_BITS = [
    (0x1, "gpu_idle"), (0x2, "app_clocks"), (0x4, "sw_power_cap"), (0x8, "hw_slowdown"),
    (0x10, "sync_boost"), (0x20, "sw_thermal"), (0x40, "hw_thermal"), (0x80, "hw_power_brake"),
    (0x100, "display_clocks"),
]



def throttle_names(mask: int) -> str:
    names = [n for bit, n in THROTTLE_BITS if mask & bit]
    rest = mask & ~sum(bit for bit, _ in THROTTLE_BITS)
    return "+".join(names + ([hex(rest)] if rest else []))



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


def print_err(msg: str) -> None:
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
        self.warn = warn or (lambda m: print_err(f"tuneledger monitor: warning: {m}"))
        self.known: dict[str, tuple[int, str]] = {}  # uuid -> (last index, name)
        self._up = False
        self._warned: set[str] = set()

    def warn_once(self, msg: str) -> None:
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
            self.warn_once(reason)
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
                self.warn_once(reason + "; writing unavailable rows and retrying every sample")
                return self._down_rows(ts, reason)
            self._up = True
        try:
            rows = sample(self.backend, self.host, pcie=self.pcie, now=now)
        except NvmlError as e:
            self._reset()
            reason = f"NVML failed: {e}"
            self.warn_once(reason)
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
            self.warn_once(r["error"])
        if bad:
            self._reset()
        elif self._warned:
            print_err(f"tuneledger monitor: all {plural(len(rows), 'GPU')} sampled again")
            self._warned.clear()
        return rows

    def close(self) -> None:
        self._reset()


def default_host() -> str:
    """$TUNELEDGER_HOST, else the host name. Set it in a container: its host name is its id."""
    return os.environ.get("TUNELEDGER_HOST") or socket.gethostname()


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
                               warn=lambda m: print_err(f"tuneledger: GPU sampler: warning: {m}"))
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
                    self.monitor.warn_once(f"cannot write {self.log.path}: {e}")
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
