"""Where samples come from: PynvmlBackend (NVML through nvidia-ml-py) and FakeNvml (no GPU: tests,
demos, `tuneledger monitor --fake N`). Both have the same methods, in the units of rows.COLUMNS, and
raise only NvmlError."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

MIB = 2**20


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
