"""Start the per-rank workers with torchrun, one process per GPU (gloo processes on a CPU).

The rendezvous port is picked free by the OS each time: the field notes hit 'Address already in
use' on torchrun's default 29500 when a second job shared the machine. Nothing listens beyond
loopback: the rendezvous store is bound to 127.0.0.1 (tuneledger.torchrun) and the ranks' gloo
and NCCL sockets to `lo` (docs/security.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

from tuneledger import allocator
from tuneledger.config import ConfigError
from tuneledger.nodes import Nodes, nccl_env
from tuneledger.rank_output import FailureReader, FailureTable, StopTraceback
from tuneledger.words import plural

def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def used_gpus(nproc: int) -> list[str]:
    """The GPUs the ranks ran on: local rank r uses the r-th visible GPU."""
    from tuneledger.monitor.summary import visible_gpus

    return (visible_gpus() or [str(i) for i in range(nproc)])[:nproc]


def processes(cpu: bool, nproc: int | None) -> tuple[bool, int]:
    """(CPU run?, number of ranks): every visible GPU; with none (or `cpu`), 2 gloo processes, so
    the DDP path still runs. An explicit `nproc` wins."""
    gpus = 0 if cpu else visible_gpus()
    if nproc is not None and nproc < 1:
        raise ConfigError(f"--nproc / NPROC must be at least 1, got {nproc}")
    if gpus and nproc and nproc > gpus:
        # Two ranks on one GPU would each hold a whole model copy and fight for its memory.
        raise ConfigError(f"NPROC={nproc} processes asked for, but {plural(gpus, 'GPU')} {'is' if gpus == 1 else 'are'} visible"
                          f"{' (CUDA_VISIBLE_DEVICES=' + os.environ['CUDA_VISIBLE_DEVICES'] + ')' if os.environ.get('CUDA_VISIBLE_DEVICES') else ''}: "
                          f"DDP runs one process per GPU. Set NPROC to {gpus} or fewer, or leave it unset for every visible GPU.")
    return gpus == 0, nproc or gpus or 2


def _child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (torchrun's ranks), from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send `sig` to this process when its parent dies (Linux PR_SET_PDEATHSIG),
    so a rank, torchrun or a tune candidate never runs on as an orphan after a kill -9 of what
    started it. If the parent is already gone (adopted by init), `sig` comes at once. Elsewhere than
    Linux it does nothing."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux
    if os.getppid() == 1:  # the parent died before the call
        os.kill(os.getpid(), sig)


def die_with_parent() -> None:
    """In the child before exec (Popen's preexec_fn): set_parent_death_signal, so a kill -9 of
    `tuneledger train` does not leave torchrun and its ranks training as orphans. The stop signals
    the launcher blocks while it starts torchrun (run_workers) are unblocked here: a blocked mask
    would pass through exec to torchrun and its ranks."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    set_parent_death_signal()


# The signals a training stops at: a scheduler's SIGTERM, a terminal's Ctrl-C, a closed terminal's SIGHUP.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StoppedBeforeStart(BaseException):
    """A stop signal reached the launcher before any rank started (BeforeRanks). A BaseException, as
    KeyboardInterrupt is, so no `except Exception` on the way (a data reader's) takes it for an error."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.name = signal.Signals(signum).name


class BeforeRanks:
    """While a launcher prepares (checks, data, checkpoints), before torchrun starts the ranks: SIGTERM,
    SIGINT and SIGHUP raise StoppedBeforeStart, so the command says it stopped before training began
    instead of dying silently (SIGTERM's default) or in a traceback. run_workers replaces these
    handlers with the ranks' own stop (_Stopper) while torchrun runs and puts them back after it;
    `restore()` then gives the signals their earlier handlers for the rest of the command. Only the
    process that entered acts: a worker forked while data is prepared gets the default behaviour."""

    def __init__(self) -> None:
        self.saved: dict = {}
        self.pid = os.getpid()

    def _raise(self, signum, frame):
        if os.getpid() != self.pid:  # a forked data worker: as before, the signal's default
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise StoppedBeforeStart(signum)

    def __enter__(self) -> "BeforeRanks":
        if threading.current_thread() is threading.main_thread():
            self.saved = {s: signal.signal(s, self._raise) for s in STOP_SIGNALS}
        return self

    def restore(self) -> None:
        for sig, h in self.saved.items():
            signal.signal(sig, h)
        self.saved = {}

    def __exit__(self, *exc) -> None:
        self.restore()


class _Stopper:
    """The launcher's SIGTERM/SIGINT/SIGHUP handler: pass SIGTERM straight to the ranks (not to
    torchrun, whose own handler SIGKILLs them after 30 s), and SIGKILL everything after the grace
    period or at a second Ctrl-C.

    A signal that comes while torchrun is still starting (no rank yet, `before_ranks`) is not lost:
    each rank gets SIGTERM as it appears, until torchrun exits or the grace period ends."""

    def __init__(self, proc: subprocess.Popen, grace_s: float):
        self.proc, self.grace_s = proc, grace_s
        self.signal: str | None = None
        self.killed: str | None = None  # why the ranks were killed: the grace period, or a second Ctrl-C
        self.timer: threading.Timer | None = None
        self.t_signal = 0.0
        self.before_ranks = False  # signalled before torchrun had started any rank

    def handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signal is not None:
            if signum == signal.SIGINT:
                self.kill(f"a second Ctrl-C {time.monotonic() - self.t_signal:.1f} s after the first {self.signal}")
            return
        self.signal, self.t_signal = name, time.monotonic()
        ranks = _child_pids(self.proc.pid)
        again = '; Ctrl-C again to kill them now' if signum == signal.SIGINT else ''
        if not ranks:
            self.before_ranks = True
            print(f"\n{name}: torchrun has not started the ranks yet; each gets SIGTERM as it starts (up to "
                  f"{self.grace_s:g} s, stop_grace_period_s){again}", file=sys.stderr, flush=True)
            threading.Thread(target=self._signal_new_ranks, daemon=True).start()
        else:
            print(f"\n{name}: asking the {len(ranks)} rank{'' if len(ranks) == 1 else 's'} to finish their step and save (up to "
                  f"{self.grace_s:g} s, stop_grace_period_s){again}", file=sys.stderr, flush=True)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        self.timer = threading.Timer(self.grace_s, self.kill,
                                     args=(f"not stopped within stop_grace_period_s={self.grace_s:g} s of {name}",))
        self.timer.daemon = True
        self.timer.start()

    def _signal_new_ranks(self, every_s: float = 0.05):
        """SIGTERM to each rank torchrun starts after the signal came, until it exits or is killed."""
        told: set[int] = set()
        while self.proc.poll() is None and self.killed is None:
            for pid in _child_pids(self.proc.pid):
                if pid not in told:
                    told.add(pid)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)
            time.sleep(every_s)

    def kill(self, why: str = "killed"):
        if self.proc.poll() is not None:
            return
        self.killed = why
        for pid in _child_pids(self.proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # torchrun starts each rank in its own session
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()


class Terminated(Exception):
    """SIGTERM reached the launcher (`kill`, `docker stop`, a CI job's timeout)."""


def _raise_terminated(signum, frame):
    raise Terminated()


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises Terminated inside the block (main thread only; elsewhere a no-op): a dry-run
    between two presets keeps what it measured, as it does inside run_workers (SystemExit 143)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    prev = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, prev)


class SignalHold:
    """From start() to the end of its `with` block, SIGINT and SIGTERM are recorded in `held`
    instead of raised (main thread only); the handlers before it come back at the block's end. A
    dry-run whose presets are measured writes its ledger first: a Ctrl-C while it built the ledger
    lost every preset, with no word."""

    def __init__(self):
        self.held: list[int] = []
        self._prev: dict | None = None

    def __enter__(self) -> "SignalHold":
        return self

    def start(self) -> None:
        if self._prev is None and threading.current_thread() is threading.main_thread():
            self._prev = {s: signal.signal(s, lambda signum, frame: self.held.append(signum))
                          for s in (signal.SIGINT, signal.SIGTERM)}

    def __exit__(self, *exc) -> None:
        for s, handler in (self._prev or {}).items():
            signal.signal(s, handler)
        self._prev = None


def torchrun_command(nproc: int, port: int, target: list[str], extra: list[str] = ()) -> list[str]:
    """torchrun for one node, its rendezvous store listening on 127.0.0.1 only (tuneledger.torchrun)."""
    return [sys.executable, "-m", "tuneledger.torchrun", f"--nproc-per-node={nproc}", "--nnodes=1",
            "--master-addr=127.0.0.1", f"--master-port={port}", *extra, *target]


def loopback_env(env: dict) -> dict:
    """Pin the ranks' gloo and NCCL sockets to the loopback interface: a single-node job needs no
    other, and otherwise they listen on the host's address. Values already set are kept."""
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    return env


def run_workers(job: dict, job_path: Path, nproc: int, log_path: Path | None = None, nodes: Nodes | None = None,
                rdzv_id: str = "tuneledger", outcome: dict | None = None) -> int:
    """Write `job` to `job_path` and run `nproc` ranks of tuneledger.worker on it; return the exit code.

    Output streams to the terminal and, when `log_path` is given, to that file as well. With
    `nodes` of several nodes, this node's ranks join the others through torchrun's c10d
    rendezvous `rdzv_id` (tuneledger.nodes), and NCCL logs its transports under the job's out_dir.
    In a training (job mode "train"), SIGTERM, SIGINT and SIGHUP go to the ranks, which finish
    their step and save (`_Stopper`; killed after stop_grace_period_s). In a dry-run, Ctrl-C or
    SIGTERM stops torchrun, which stops the ranks, and SIGTERM exits 143. torchrun runs in a
    session of its own and dies with this process (PR_SET_PDEATHSIG), so no rank is left orphaned.
    `outcome`, if given, gets what the caller's last line must tell: "signal" (the one this
    launcher got and passed on, or None), "killed" (why the ranks were killed, or None), "causes"
    (the failed rank's error lines) and "before_training" (None, or when the signal came if no rank
    had trained a step: while torchrun started them, or while they started).
    """
    job_path.parent.mkdir(parents=True, exist_ok=True)
    job_path.write_text(json.dumps(job, indent=1, ensure_ascii=False))
    target = ["-m", "tuneledger.worker", str(job_path)]
    if nodes and nodes.multi:
        # Several nodes: the store and the ranks must listen where the other nodes can reach them.
        cmd = [sys.executable, "-m", "torch.distributed.run", *nodes.torchrun_args(nproc, rdzv_id), *target]
        rendezvous = f"node {nodes.node_rank} of {nodes.nnodes}, c10d rendezvous {nodes.rdzv_endpoint} ({rdzv_id})"
        env = dict(os.environ)
    else:
        port = free_port()
        restarts = [f"--max-restarts={nodes.max_restarts}"] if nodes and nodes.max_restarts else []
        cmd = torchrun_command(nproc, port, target, restarts)
        rendezvous = f"rendezvous 127.0.0.1:{port}"
        env = loopback_env(dict(os.environ))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("NCCL_DEBUG", "WARN")
    env.setdefault("TORCH_WARM_POOL", "0")  # no compile-worker pool per rank (see cli.main)
    if note := allocator.apply(env):  # one value under both names: every torch reads the same (allocator.py)
        print(note, flush=True)
    cache_dir = job.get("config", {}).get("cache_dir")
    if cache_dir:
        # Compiled layers' kernels beside the tokenized data, not in /tmp: a train after its dry-run
        # (or a container after the last one) loads them instead of compiling again (preset D on an
        # H200: 14 s instead of 27 s; bench/results/h200-2026-12-01-session3).
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(cache_dir).resolve() / "torchinductor"))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // max(1, nproc))))
    env["PYTHONUNBUFFERED"] = "1"
    # The ranks import Unsloth before transformers (unsloth_backend.import_first), and only then: a
    # value left in the shell must not patch a run that did not ask for it.
    env.pop("TUNELEDGER_USE_UNSLOTH", None)
    if job.get("config", {}).get("use_unsloth"):
        env["TUNELEDGER_USE_UNSLOTH"] = "1"
    if job.get("cpu"):
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif nodes and nodes.multi:
        env.update(nccl_env(Path(job["out_dir"]) / "nccl"))
        if "NCCL_DEBUG_FILE" in env:
            rendezvous += f"; NCCL's log in {Path(env['NCCL_DEBUG_FILE']).parent}"
    print(f"launch: {nproc} process{'' if nproc == 1 else 'es'}, {rendezvous}", flush=True)
    # Line-buffered: after a kill -9 or a full disk the log holds every line up to then.
    log = open(log_path, "a", encoding="utf-8", buffering=1) if log_path else None
    failure = FailureReader()
    # A training stops cleanly (its ranks save); a dry-run is interrupted (KeyboardInterrupt) or
    # terminated (Terminated, exit 143).
    graceful = job.get("mode") == "train"
    main = threading.current_thread() is threading.main_thread()  # signal handlers live in the main thread only
    # From just before torchrun starts until the handlers below are in place, the stop signals wait
    # (blocked, delivered at the unblock): one that comes in between is neither lost nor fatal.
    if main:
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        # Its own session: a terminal's Ctrl-C reaches this process only, which decides what the ranks get.
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                start_new_session=True, preexec_fn=die_with_parent)
    except BaseException:
        if main:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        raise
    stopper = _Stopper(proc, float(job.get("config", {}).get("stop_grace_period_s", 120)))
    saved = {}
    if main:
        saved = {s: signal.signal(s, stopper.handle) for s in STOP_SIGNALS} if graceful \
            else {signal.SIGTERM: signal.signal(signal.SIGTERM, _raise_terminated)}
    try:
        if main:  # a signal that came meanwhile is handled now, inside this try
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        assert proc.stdout is not None
        quiet, table = StopTraceback(log_path), FailureTable(log_path)
        for line in proc.stdout:
            sys.stdout.write(table.shown(quiet.shown(line, stopper.signal)))
            sys.stdout.flush()
            if log:
                try:
                    log.write(line)
                except OSError as e:  # a full disk must not kill the launcher that reports it
                    print(f"launch: cannot write {log_path} ({e}); the log goes on here only", file=sys.stderr)
                    log = None
            failure.feed(line)
        sys.stdout.write(quiet.shown("", None) + table.shown(""))  # cut short by torchrun's exit
        rc = proc.wait()
    except (KeyboardInterrupt, Terminated) as stop:
        if main:  # a second SIGTERM must not cut the wait for the ranks short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        proc.terminate()  # torchrun passes SIGTERM on to the ranks
        proc.wait()
        print(f"\n{'interrupted' if isinstance(stop, KeyboardInterrupt) else 'terminated (SIGTERM)'}: the ranks "
              "were stopped", file=sys.stderr, flush=True)
        if isinstance(stop, Terminated):
            raise SystemExit(128 + signal.SIGTERM) from None
        raise
    finally:
        for sig, h in saved.items():
            signal.signal(sig, h)
        if stopper.timer:
            stopper.timer.cancel()
        if log:
            with contextlib.suppress(OSError):
                log.close()
    if outcome is not None:
        outcome.update(signal=stopper.signal, killed=stopper.killed, causes=failure.causes())
    if stopper.killed:
        print(f"the ranks were killed: {stopper.killed}", file=sys.stderr, flush=True)
        return 124
    # Signalled before any rank trained: the ranks got SIGTERM while torchrun started them, or died of
    # it while they started (a rank that got to its stop handler, guards.StopOnSignal, finishes a step
    # and saves instead; the ranks step together, so none had trained).
    before = None
    if stopper.signal and not stopper.killed and rc != 0 and (
            stopper.before_ranks or (failure.signals == {"SIGTERM"} and not failure.errors)):
        before = "while torchrun was starting the ranks" if stopper.before_ranks else \
            "while the ranks were starting, before their first step"
    if outcome is not None:
        outcome["before_training"] = before
    if rc != 0 and failure.causes() and not before:  # (before: the ranks died of the SIGTERM passed on)
        # A failed rank buries its error in every rank's traceback and torchrun's own: say it once.
        print("\nworker error: " + "\n              ".join(failure.causes()), file=sys.stderr, flush=True)
    return rc
