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

Library use (the dry-run and train ledgers): `sampler.InProcessSampler` samples in a daemon
thread, `csvlog.read_window` reads the sidecar's rows for a time window (`csvlog.read_rows`: whole
CSVs), and `summary.summarize_window` reduces rows to per-GPU figures for a window (the package's
__init__ lists the modules).

Exit codes: 0 stopped by --count, SIGTERM or SIGINT (or plot written); 1 plot: no GPU rows, a bad
--window or --ledger.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from tuneledger.monitor.backends import FakeNvml, PynvmlBackend
from tuneledger.monitor.csvlog import CsvLog, read_rows, safe_name
from tuneledger.monitor.plot import parse_window, plot, windows_from_ledger
from tuneledger.monitor.sampler import Monitor, print_err


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
            monitor.warn_once(f"cannot write {log.path or log.out_dir}: {e}")
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
        print_err(f"tuneledger monitor: cannot write to --out {args.out}: {e.strerror or e}")
        return 1
    stop = threading.Event()
    handler = lambda signum, frame: stop.set()  # noqa: E731
    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    print_err(f"tuneledger monitor: sampling {'fake ' if args.fake else ''}GPUs every {args.interval:g} s into "
            f"{Path(args.out) / (safe_name(monitor.host) + '-<UTC date>.csv')} "
            f"({f'{args.count} samples' if args.count else 'until SIGTERM/SIGINT'})")
    try:
        stats = run_loop(monitor, log, args.interval, args.count, stop)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        monitor.close()
        log.close()
    print_err(f"tuneledger monitor: stopped after {stats['samples']} samples; per sample {stats['wall_ms_mean']:.2f} ms "
            f"wall (max {stats['wall_ms_max']:.2f}); CPU {stats['cpu_pct']:.2f}% of one core; last file {log.path}")
    return 0
