"""The monitor against FakeNvml (and a stub pynvml module): sampling, CSV format and rotation,
missing NVML, lost GPUs, SIGTERM, the in-process sampler, window summaries and the plot.

tests/fixtures/monitor_2xh200_synthetic.csv is a SYNTHETIC trace written by FakeNvml
(tests/fixtures/make_monitor_trace.py), not a GPU recording: idle 10:00:00-10:00:25, a preset A
window 10:00:30-10:02:25 (util ~25%), a preset D window 10:02:30-10:04:25 (util ~92%).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from tuneledger.monitor.backends import FakeGpu, FakeNvml, NvmlError, PynvmlBackend
from tuneledger.monitor.cli import run_loop
from tuneledger.monitor.csvlog import CsvLog, read_rows, read_window
from tuneledger.monitor.plot import parse_window, plot, windows_from_ledger
from tuneledger.monitor.rows import COLUMNS, parse_time
from tuneledger.monitor.sampler import InProcessSampler, Monitor, sample
from tuneledger.monitor.summary import summarize_window, visible_gpus

FIX = Path(__file__).parent / "fixtures"
TRACE = FIX / "monitor_2xh200_synthetic.csv"
T0 = datetime(2026, 11, 29, 10, 0, 0, tzinfo=timezone.utc)


def two_gpus(**kw) -> FakeNvml:
    a = FakeGpu(used_mib=13700.0, util_gpu=95, util_mem=40, power_w=301.25, power_limit_w=450.0, temp_c=61,
                sm_clock_mhz=2520, pcie_tx_kbps=1500, pcie_rx_kbps=2100, throttle=0x4 | 0x20, procs=[(4242, 13200.0)])
    b = FakeGpu(name="NVIDIA GeForce RTX 4090", total_mib=24564.0, procs=[(77, None), (78, 100.0)])
    return FakeNvml([a, b], **kw)


def collect_warnings():
    seen: list[str] = []
    return seen, seen.append


# ------------------------------------------------------------------------------------ sampling
def test_sample_one_row_per_gpu_with_units_and_decoded_fields():
    b = two_gpus()
    b.init()
    rows = sample(b, "node1", now=T0)
    assert [r["gpu"] for r in rows] == [0, 1]
    r = rows[0]
    assert set(r) == set(COLUMNS)
    assert r["timestamp"] == "2026-11-29T10:00:00.000Z" == rows[1]["timestamp"]
    assert (r["host"], r["uuid"], r["name"], r["status"]) == ("node1", "GPU-fake-0000", "NVIDIA H200", "ok")
    assert (r["util_gpu_pct"], r["util_mem_pct"]) == (95, 40)
    assert (r["mem_used_mib"], r["mem_total_mib"]) == (13700.0, 143771.0)
    assert (r["power_w"], r["power_limit_w"], r["temp_c"], r["sm_clock_mhz"]) == (301.2, 450.0, 61, 2520)
    assert (r["pcie_tx_kbps"], r["pcie_rx_kbps"]) == (1500, 2100)
    assert r["throttle"] == "sw_power_cap+sw_thermal"
    assert (r["n_procs"], r["procs"]) == (1, "4242:13200")
    assert r["error"] is None
    # NVML may not give a process's memory: '?' keeps the pid
    assert (rows[1]["n_procs"], rows[1]["procs"], rows[1]["throttle"]) == (2, "77:?;78:100", "")


def test_pcie_can_be_left_out():
    b = two_gpus()
    b.init()
    r = sample(b, "h", pcie=False)[0]
    assert r["pcie_tx_kbps"] is None and r["pcie_rx_kbps"] is None


def test_unsupported_counter_is_blank_and_silent_other_errors_are_named():
    b = two_gpus()
    b.gpus[0].unsupported = {"pcie_kbps", "power_limit_w"}
    b.init()
    r = sample(b, "h")[0]
    assert r["status"] == "ok" and r["pcie_tx_kbps"] is None and r["power_limit_w"] is None and r["error"] is None

    def broken(h):
        raise NvmlError("Timeout", "error")
    b.temperature_c = broken
    r = sample(b, "h")[0]
    assert r["status"] == "ok" and r["temp_c"] is None and r["error"] == "temperature: Timeout"


def test_no_gpu_row_when_nvml_sees_zero_devices():
    b = FakeNvml([])
    b.init()
    [r] = sample(b, "h")
    assert r["status"] == "unavailable" and r["gpu"] is None and r["error"].startswith("no GPU")


# ------------------------------------------------------------------------------------ CSV
def test_csv_header_rows_and_round_trip(tmp_path):
    mon = Monitor(two_gpus(), "node1")
    log = CsvLog(tmp_path, "node1")
    first = mon.poll(now=T0)
    path = log.write(first)
    # flushed after every sample: readable while the writer is still open
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    assert path.name == "node1-2026-11-29.csv"
    assert lines[0] == COLUMNS
    assert len(lines) == 3
    log.write(mon.poll(now=T0 + timedelta(seconds=5)))
    log.close()
    back = read_rows(path)
    assert len(back) == 4
    assert back[0] == first[0]  # typed the same way sample() types them
    assert back[2]["timestamp"] == "2026-11-29T10:00:05.000Z"


def test_csv_appends_to_an_existing_file_without_a_second_header(tmp_path):
    for k in range(2):
        log = CsvLog(tmp_path, "h")
        log.write(Monitor(two_gpus(), "h").poll(now=T0 + timedelta(seconds=k)))
        log.close()
    lines = (tmp_path / "h-2026-11-29.csv").read_text().splitlines()
    assert len(lines) == 5 and lines.count(",".join(COLUMNS)) == 1


def test_csv_rotates_at_utc_midnight(tmp_path):
    mon, log = Monitor(two_gpus(), "h"), CsvLog(tmp_path, "h")
    late = datetime(2026, 11, 29, 23, 59, 58, tzinfo=timezone.utc)
    p1 = log.write(mon.poll(now=late))
    p2 = log.write(mon.poll(now=late + timedelta(seconds=5)))
    # a local-time offset does not change the day: the date is UTC's
    p3 = log.write(mon.poll(now=datetime(2026, 11, 30, 1, 0, tzinfo=timezone(timedelta(hours=2)))))
    log.close()
    assert (p1.name, p2.name, p3.name) == ("h-2026-11-29.csv", "h-2026-11-30.csv", "h-2026-11-29.csv")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h-2026-11-29.csv", "h-2026-11-30.csv"]
    for p in tmp_path.iterdir():
        assert p.read_text().splitlines()[0] == ",".join(COLUMNS)
    assert len(read_rows(tmp_path)) == 6


def test_csv_never_mixes_two_layouts(tmp_path):
    old = tmp_path / "h-2026-11-29.csv"
    old.write_text("timestamp,host,gpu,util\n2026-11-29T00:00:00Z,h,0,5\n")
    log = CsvLog(tmp_path, "h")
    p = log.write(Monitor(two_gpus(), "h").poll(now=T0))
    log.close()
    assert p.name == "h-2026-11-29.1.csv"
    assert old.read_text().count("\n") == 2


def test_host_name_is_made_safe_for_a_file_name(tmp_path):
    log = CsvLog(tmp_path, "pod/abc 1")
    p = log.write(Monitor(two_gpus(), "pod/abc 1").poll(now=T0))
    log.close()
    assert p.parent == tmp_path and p.name == "pod_abc_1-2026-11-29.csv"


# ------------------------------------------------------------------------------------ failures
def test_missing_nvml_one_warning_unavailable_rows_and_retry_each_sample():
    warnings, warn = collect_warnings()
    b = FakeNvml([FakeGpu()], missing=True)
    mon = Monitor(b, "h", warn=warn)
    for k in range(3):
        [r] = mon.poll(now=T0 + timedelta(seconds=k))
        assert r["status"] == "unavailable" and r["gpu"] is None
        assert r["error"] == "no GPU: NVML unavailable (NVML Shared Library Not Found)"
        assert r["sample_ms"] is not None
    assert b.inits == 3  # retried at every sample
    assert len(warnings) == 1 and "no GPU" in warnings[0]
    b.missing = False  # the driver appears (a container given a GPU, a driver reload)
    [r] = mon.poll()
    assert r["status"] == "ok" and r["gpu"] == 0


def test_missing_pynvml_module_reads_as_no_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    warnings, warn = collect_warnings()
    [r] = Monitor(PynvmlBackend(), "h", warn=warn).poll()
    assert r["status"] == "unavailable" and "nvidia-ml-py is not installed" in r["error"]
    assert len(warnings) == 1


def test_gpu_lost_one_warning_its_row_unavailable_others_sampled_and_reinit():
    warnings, warn = collect_warnings()
    b = two_gpus()
    mon = Monitor(b, "h", warn=warn)
    assert all(r["status"] == "ok" for r in mon.poll())
    b.gpus[1].lost = True
    for _ in range(3):
        r0, r1 = mon.poll()
        assert r0["status"] == "ok"
        assert r1["status"] == "unavailable" and "GPU is lost" in r1["error"]
        assert (r1["gpu"], r1["uuid"]) == (1, "GPU-fake-0001")  # named from the last good sample
    assert len(warnings) == 1
    assert b.inits == 3  # the first init, then again after each of the first two bad samples
    b.gpus[1].lost = False
    assert [r["status"] for r in mon.poll()] == ["ok", "ok"]
    b.gpus[1].lost = True
    mon.poll()
    assert len(warnings) == 2  # a new incident after recovery warns again


def test_gpu_gone_from_the_bus_keeps_an_unavailable_row():
    warnings, warn = collect_warnings()
    b = two_gpus()
    mon = Monitor(b, "h", warn=warn)
    mon.poll()
    gone = b.gpus.pop(1)  # NVML no longer enumerates it
    rows = mon.poll()
    assert [r["status"] for r in rows] == ["ok", "unavailable"]
    assert rows[1]["uuid"] == gone.uuid and "no longer visible" in rows[1]["error"]
    assert len(warnings) == 1


def test_device_count_failure_and_bugs_never_raise():
    warnings, warn = collect_warnings()
    b = two_gpus()
    mon = Monitor(b, "h", warn=warn)
    mon.poll()

    def count_fails():
        raise NvmlError("Unknown Error", "error")
    b.device_count = count_fails
    rows = mon.poll()
    assert [r["status"] for r in rows] == ["unavailable", "unavailable"]  # the two known GPUs
    assert all("NVML failed: Unknown Error" == r["error"] for r in rows)

    def bug():
        raise ZeroDivisionError("oops")
    b.device_count = bug
    rows = mon.poll()
    assert rows and all(r["status"] == "unavailable" and "ZeroDivisionError" in r["error"] for r in rows)
    assert len(warnings) == 2


def test_pynvml_backend_converts_units_and_translates_errors(monkeypatch):
    import pynvml as real

    calls = []
    stub = types.ModuleType("pynvml")
    for k in dir(real):
        if k.startswith("NVML_") or k == "nvmlMemory_v2":
            setattr(stub, k, getattr(real, k))

    class NVMLError(Exception):
        def __init__(self, value):
            self.value = value

        def __str__(self):
            return {real.NVML_ERROR_GPU_IS_LOST: "GPU is lost", real.NVML_ERROR_LIBRARY_NOT_FOUND:
                    "NVML Shared Library Not Found"}.get(self.value, f"code {self.value}")
    stub.NVMLError = NVMLError
    ns = types.SimpleNamespace
    stub.nvmlInit = lambda: calls.append("init")
    stub.nvmlShutdown = lambda: calls.append("shutdown")
    stub.nvmlDeviceGetCount = lambda: 1
    stub.nvmlDeviceGetHandleByIndex = lambda i: f"h{i}"
    stub.nvmlDeviceGetUUID = lambda h: "GPU-1234"
    stub.nvmlDeviceGetName = lambda h: b"NVIDIA H200"  # older pynvml returns bytes

    def meminfo(h, version=None):
        if version:
            raise NVMLError(real.NVML_ERROR_FUNCTION_NOT_FOUND)  # an old driver: no v2
        return ns(used=21.7 * 2**30, total=24564 * 2**20)
    stub.nvmlDeviceGetMemoryInfo = meminfo
    stub.nvmlDeviceGetUtilizationRates = lambda h: ns(gpu=0, memory=0)
    stub.nvmlDeviceGetPowerUsage = lambda h: 61_500
    stub.nvmlDeviceGetEnforcedPowerLimit = lambda h: 450_000
    stub.nvmlDeviceGetTemperature = lambda h, s: 41
    stub.nvmlDeviceGetClockInfo = lambda h, c: 210
    stub.nvmlDeviceGetPcieThroughput = lambda h, c: 7 if c == real.NVML_PCIE_UTIL_TX_BYTES else 9

    def reasons(h):
        raise NVMLError(real.NVML_ERROR_NOT_SUPPORTED)
    stub.nvmlDeviceGetCurrentClocksThrottleReasons = reasons  # no ClocksEventReasons: the fallback
    stub.nvmlDeviceGetComputeRunningProcesses = lambda h: [ns(pid=4242, usedGpuMemory=int(21.7 * 2**30))]
    monkeypatch.setitem(sys.modules, "pynvml", stub)

    warnings, warn = collect_warnings()
    mon = Monitor(PynvmlBackend(), "h", warn=warn)
    [r] = mon.poll()
    assert r["status"] == "ok", r
    assert (r["name"], r["uuid"], r["mem_used_mib"], r["mem_total_mib"]) == ("NVIDIA H200", "GPU-1234", 22220.8, 24564.0)
    assert (r["power_w"], r["power_limit_w"], r["temp_c"], r["sm_clock_mhz"]) == (61.5, 450.0, 41, 210)
    assert (r["pcie_tx_kbps"], r["pcie_rx_kbps"], r["throttle"], r["procs"]) == (7, 9, None, "4242:22221")
    assert r["error"] is None and warnings == []

    def lost(h, version=None):
        raise NVMLError(real.NVML_ERROR_GPU_IS_LOST)
    stub.nvmlDeviceGetMemoryInfo = lost
    [r] = mon.poll()
    assert r["status"] == "unavailable" and r["error"] == "GPU 0: GPU is lost"
    assert calls == ["init", "shutdown"]

    def no_lib():
        raise NVMLError(real.NVML_ERROR_LIBRARY_NOT_FOUND)
    stub.nvmlInit = no_lib
    [r] = mon.poll()
    assert r["status"] == "unavailable" and "NVML Shared Library Not Found" in r["error"]


# ------------------------------------------------------------------------------------ the verb
def test_cli_writes_unavailable_rows_without_nvml_and_exits_0(tmp_path, monkeypatch, capsys):
    from tuneledger.cli import main

    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert main(["monitor", "--interval", "0.01", "--count", "3", "--out", str(tmp_path), "--host", "box"]) == 0
    rows = read_rows(tmp_path)
    assert len(rows) == 3 and all(r["status"] == "unavailable" and r["host"] == "box" for r in rows)
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "stopped after 3 samples" in err and "CPU" in err


def test_cli_fake_gpus(tmp_path, capsys):
    from tuneledger.cli import main

    assert main(["monitor", "--fake", "2", "--interval", "0.01", "--count", "2", "--out", str(tmp_path), "--host", "box"]) == 0
    rows = read_rows(tmp_path)
    assert [(r["gpu"], r["status"]) for r in rows] == [(0, "ok"), (1, "ok")] * 2


def test_run_loop_stops_on_event_and_reports_overhead(tmp_path):
    stop = threading.Event()
    b = two_gpus(tick=lambda b: stop.set())  # "SIGTERM" arrives during the first sample
    stats = run_loop(Monitor(b, "h"), CsvLog(tmp_path, "h"), 60.0, None, stop)
    assert stats["samples"] == 1  # the sample in flight completes and is written; no 60 s wait
    assert len(read_rows(tmp_path)) == 2
    assert set(stats) == {"samples", "wall_ms_mean", "wall_ms_max", "cpu_pct"}


def test_sigterm_ends_the_sidecar_cleanly(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1] / "src"))
    proc = subprocess.Popen([sys.executable, "-m", "tuneledger", "monitor", "--fake", "1", "--interval", "0.05",
                             "--out", str(tmp_path), "--host", "box"], env=env, stderr=subprocess.PIPE, text=True)
    csv_path = None
    for _ in range(400):  # wait until it has written rows; a slow machine just waits longer
        found = list(tmp_path.glob("box-*.csv"))
        if found and found[0].read_text().count("\n") >= 3:
            csv_path = found[0]
            break
        time.sleep(0.05)
    assert csv_path, "the monitor wrote no rows"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "stopped after" in err and "Traceback" not in err
    text = csv_path.read_text()
    assert text.endswith("\n")  # the last row is whole
    assert all(r["status"] == "ok" for r in read_rows(csv_path))


# ------------------------------------------------------------------------------------ in-process
def test_in_process_sampler_collects_rows_and_stops():
    s = InProcessSampler(interval=0.01, backend=two_gpus(), host="h").start()
    for _ in range(500):
        if len(s.rows) >= 6:
            break
        time.sleep(0.01)
    rows = s.stop()
    assert len(rows) >= 6 and {r["gpu"] for r in rows} == {0, 1}
    assert rows[0]["pcie_tx_kbps"] is None  # left out in-process
    assert not s._thread.is_alive()
    assert len(s.rows) == len(rows)  # nothing added after stop


def test_in_process_sampler_without_nvml_and_csv_and_bound(tmp_path):
    with InProcessSampler(interval=0.01, backend=FakeNvml(missing=True), host="h", out_dir=tmp_path, max_rows=3) as s:
        for _ in range(500):
            if s.monitor.backend.inits >= 5:
                break
            time.sleep(0.01)
    rows = s.rows
    assert len(rows) == 3 and all(r["status"] == "unavailable" for r in rows)
    assert len(read_rows(tmp_path)) >= 5


def test_in_process_sampler_rejects_a_bad_interval():
    with pytest.raises(ValueError):
        InProcessSampler(interval=0)


# ------------------------------------------------------------------------------------ summaries
def test_summarize_window_on_the_synthetic_trace():
    rows = read_rows(TRACE)
    a = summarize_window(rows, "2026-11-29T10:00:30Z", "2026-11-29T10:02:25Z")
    assert a["samples"] == 24 and len(a["gpus"]) == 2
    g0 = a["gpus"][0]
    assert (g0["samples"], g0["util_min_pct"], g0["util_max_pct"]) == (24, 22, 28)
    assert g0["util_mean_pct"] == pytest.approx(24.83, abs=0.01)
    assert (g0["mem_used_mean_mib"], g0["mem_used_max_mib"], g0["mem_total_mib"]) == (13056.0, 13056.0, 143771.0)
    assert g0["power_mean_w"] == pytest.approx(75 + 5.5 * g0["util_mean_pct"])
    assert a["util_mean_pct"] == pytest.approx(24.83, abs=0.01) and not a["imbalance"]
    assert a["mem_peak_frac"] == pytest.approx(13120 / 143771)
    assert a["note"] is None

    d = summarize_window(rows, "2026-11-29T10:02:30Z", "2026-11-29T10:04:25Z")
    # GPU 0 cycles 93,91,94,90,92,95 (mean 92.5); GPU 1 lags 3 points
    assert [g["util_mean_pct"] for g in d["gpus"]] == [pytest.approx(92.5), pytest.approx(89.5)]
    assert d["util_mean_pct"] == pytest.approx(91.0)
    assert d["util_spread_pts"] == pytest.approx(3.0) and not d["imbalance"]
    assert d["mem_used_max_mib"] == 125696.0
    assert d["power_total_mean_w"] == pytest.approx(2 * 75 + 5.5 * (92.5 + 89.5))
    # only GPU 1, by index or by UUID prefix
    assert [g["gpu"] for g in summarize_window(rows, "2026-11-29T10:02:30Z", "2026-11-29T10:04:25Z", gpus=[1])["gpus"]] == [1]
    assert [g["gpu"] for g in summarize_window(rows, "2026-11-29T10:02:30Z", "2026-11-29T10:04:25Z", gpus=["GPU-fake-0000"])["gpus"]] == [0]


def test_imbalance_flag_is_util_spread_over_the_threshold():
    rows = read_rows(TRACE)
    start, end = "2026-11-29T10:02:30Z", "2026-11-29T10:04:25Z"
    for r in rows:  # make GPU 1 slow in the D window
        if r["gpu"] == 1 and parse_time(start) <= parse_time(r["timestamp"]) <= parse_time(end):
            r["util_gpu_pct"] -= 20
    s = summarize_window(rows, start, end)
    assert s["util_spread_pts"] == pytest.approx(23.0) and s["imbalance"]
    assert not summarize_window(rows, start, end, imbalance_util_pts=25)["imbalance"]


def test_summarize_window_without_gpu_samples_says_why():
    mon = Monitor(FakeNvml(missing=True), "h", warn=lambda _: None)
    rows = [r for k in range(3) for r in mon.poll(now=T0 + timedelta(seconds=k))]
    s = summarize_window(rows, T0, T0 + timedelta(seconds=10))
    assert s["util_mean_pct"] is None and s["mem_peak_frac"] is None and s["gpus"] == []
    assert s["note"].startswith("no GPU sample in this window: no GPU: NVML unavailable")
    empty = summarize_window(rows, T0 + timedelta(hours=1), T0 + timedelta(hours=2))
    assert empty["samples"] == 0 and empty["note"] == "no monitor samples in this window"
    with pytest.raises(ValueError):
        summarize_window(rows, T0 + timedelta(seconds=5), T0)


def test_summarize_window_counts_unavailable_samples():
    b = two_gpus()
    mon = Monitor(b, "h", warn=lambda _: None)
    rows = mon.poll(now=T0)
    b.gpus[1].lost = True
    rows += mon.poll(now=T0 + timedelta(seconds=5))
    s = summarize_window(rows, T0, T0 + timedelta(seconds=5))
    g1 = s["gpus"][1]
    assert (g1["samples"], g1["unavailable_samples"], g1["util_mean_pct"]) == (1, 1, 0)


def test_read_window_reads_only_the_days_and_host_asked(tmp_path):
    for host in ("a", "b"):
        mon, log = Monitor(two_gpus(), host), CsvLog(tmp_path, host)
        for day in (28, 29, 30):
            log.write(mon.poll(now=datetime(2026, 11, day, 23, 59, 0, tzinfo=timezone.utc)))
        log.close()
    (tmp_path / "notes.csv").write_text("not,a,monitor,file\n")  # ignored: no date in the name
    rows = read_window(tmp_path, "2026-11-29T00:00:00Z", "2026-11-30T00:00:00Z", host="a")
    assert {(r["host"], r["timestamp"]) for r in rows} == {("a", "2026-11-29T23:59:00.000Z")}
    assert len(read_window(tmp_path, "2026-11-28T00:00:00Z", "2026-11-30T23:59:59Z")) == 12
    assert read_window(tmp_path / "none", "2026-11-29T00:00:00Z", "2026-11-30T00:00:00Z") == []


def test_visible_gpus():
    assert visible_gpus({}) is None
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]


def test_parse_time_forms():
    want = datetime(2026, 11, 29, 10, 0, 5, 120000, tzinfo=timezone.utc)
    for s in ("2026-11-29T10:00:05.12Z", "2026-11-29T10:00:05.120000+00:00", "2026-11-29 12:00:05.12+02:00",
              "2026-11-29T10:00:05.12"):
        assert parse_time(s) == want
    with pytest.raises(ValueError):
        parse_time("yesterday")


# ------------------------------------------------------------------------------------ windows, plot
def test_parse_window_label_may_hold_colons():
    label, s, e = parse_window("preset A: GC on:2026-11-29T10:00:00Z:2026-11-29T10:02:00Z")
    assert label == "preset A: GC on" and (e - s) == timedelta(minutes=2)
    for bad in ("preset A", "x:2026-11-29T10:02:00Z:2026-11-29T10:00:00Z", "x:10:00:10:02"):
        with pytest.raises(ValueError):
            parse_window(bad)


def test_windows_from_ledger(tmp_path):
    p = tmp_path / "ledger.json"
    p.write_text(json.dumps({"windows": [{"label": "A", "start": "2026-11-29T10:00:30Z", "end": "2026-11-29T10:02:25Z"}]}))
    [(label, s, e)] = windows_from_ledger(p)
    assert label == "A" and s == T0 + timedelta(seconds=30)
    p.write_text(json.dumps({"windows": [{"label": "A"}]}))
    with pytest.raises(ValueError, match=r"windows\[0\]"):
        windows_from_ledger(p)
    p.write_text("{}")
    with pytest.raises(ValueError, match="windows"):
        windows_from_ledger(p)


def test_plot_writes_a_png(tmp_path):
    rows = read_rows(TRACE)
    rows[5].update(status="unavailable", error="GPU 1: GPU is lost")
    out = plot(rows, tmp_path / "sub" / "trace.png",
               [parse_window("preset A:2026-11-29T10:00:30Z:2026-11-29T10:02:25Z"),
                parse_window("preset D:2026-11-29T10:02:30Z:2026-11-29T10:04:25Z")])
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_plot_refuses_a_trace_without_gpu_samples(tmp_path):
    mon = Monitor(FakeNvml(missing=True), "h", warn=lambda _: None)
    with pytest.raises(ValueError, match="no GPU sample to plot .*no GPU"):
        plot(mon.poll(), tmp_path / "x.png")


def test_cli_plot_with_windows_and_ledger(tmp_path, capsys):
    from tuneledger.cli import main

    ledger = tmp_path / "dryrun.json"
    ledger.write_text(json.dumps({"windows": [{"label": "D", "start": "2026-11-29T10:02:30Z", "end": "2026-11-29T10:04:25Z"}]}))
    out = tmp_path / "p.png"
    rc = main(["monitor", "plot", str(TRACE), "--out", str(out), "--window",
               "preset A:2026-11-29T10:00:30Z:2026-11-29T10:02:25Z", "--ledger", str(ledger)])
    assert rc == 0 and out.exists() and capsys.readouterr().out.strip() == str(out)
    assert main(["monitor", "plot", str(TRACE), "--out", str(out), "--window", "nonsense"]) == 1
    assert "is not LABEL:START:END" in capsys.readouterr().err
    assert main(["monitor", "plot", str(tmp_path / "missing.csv")]) == 1
