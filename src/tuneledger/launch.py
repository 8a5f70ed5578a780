"""Start the per-rank workers with torchrun, one process per GPU (gloo processes on a CPU).

The rendezvous port is picked free by the OS each time: the field notes hit 'Address already in
use' on torchrun's default 29500 when a second job shared the machine. Nothing listens beyond
loopback: the rendezvous store is bound to 127.0.0.1 (tuneledger.torchrun) and the ranks' gloo
and NCCL sockets to `lo` (docs/security.md).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from tuneledger.config import ConfigError
from tuneledger.nodes import Nodes, nccl_env

# The last line of a Python traceback, with or without torchrun's "[rankN]: " prefix.
ROOT_CAUSE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_][\w.]*)?(?:Error|Exception)\b:.*)$")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def processes(cpu: bool, nproc: int | None) -> tuple[bool, int]:
    """(CPU run?, number of ranks): every visible GPU; with none (or `cpu`), 2 gloo processes, so
    the DDP path still runs. An explicit `nproc` wins."""
    gpus = 0 if cpu else visible_gpus()
    if nproc is not None and nproc < 1:
        raise ConfigError(f"--nproc / NPROC must be at least 1, got {nproc}")
    if gpus and nproc and nproc > gpus:
        # Two ranks on one GPU would each hold a whole model copy and fight for its memory.
        raise ConfigError(f"NPROC={nproc} processes asked for, but {gpus} GPU(s) are visible"
                          f"{' (CUDA_VISIBLE_DEVICES=' + os.environ['CUDA_VISIBLE_DEVICES'] + ')' if os.environ.get('CUDA_VISIBLE_DEVICES') else ''}: "
                          f"DDP runs one process per GPU. Set NPROC to {gpus} or fewer, or leave it unset for every visible GPU.")
    return gpus == 0, nproc or gpus or 2


def last_checkpoint(out_dir: Path, require: tuple[str, ...] = ()) -> str | None:
    """The newest complete checkpoint-N in out_dir (one with trainer_state.json and `require`)."""
    done = [p for p in Path(out_dir).glob("checkpoint-*") if p.name.split("-")[-1].isdigit()
            and all((p / f).is_file() for f in ("trainer_state.json", *require))]
    return str(max(done, key=lambda p: int(p.name.split("-")[-1]))) if done else None


class Terminated(Exception):
    """SIGTERM reached the launcher (`kill`, `docker stop`, a CI job's timeout)."""


def _raise_terminated(signum, frame):
    raise Terminated()


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
                rdzv_id: str = "tuneledger") -> int:
    """Write `job` to `job_path` and run `nproc` ranks of tuneledger.trainer on it; return the exit code.

    Output streams to the terminal and, when `log_path` is given, to that file as well. With
    `nodes` of several nodes, this node's ranks join the others through torchrun's c10d
    rendezvous `rdzv_id` (tuneledger.nodes), and NCCL logs its transports under the job's out_dir.
    Ctrl-C or SIGTERM stops torchrun, which stops the ranks (SIGTERM, SIGKILL 30 s later), before
    this process ends: each rank runs in a session of its own, so nothing else would reach it.
    SIGTERM exits 143.
    """
    job_path.parent.mkdir(parents=True, exist_ok=True)
    job_path.write_text(json.dumps(job, indent=1, ensure_ascii=False))
    target = ["-m", "tuneledger.trainer", str(job_path)]
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
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // max(1, nproc))))
    env["PYTHONUNBUFFERED"] = "1"
    if job.get("cpu"):
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif nodes and nodes.multi:
        env.update(nccl_env(Path(job["out_dir"]) / "nccl"))
        if "NCCL_DEBUG_FILE" in env:
            rendezvous += f"; NCCL's log in {Path(env['NCCL_DEBUG_FILE']).parent}"
    print(f"launch: {nproc} process(es), {rendezvous}", flush=True)
    log = open(log_path, "a", encoding="utf-8") if log_path else None
    causes: dict[str, None] = {}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    main = threading.current_thread() is threading.main_thread()  # signal handlers live in the main thread only
    old_handler = signal.signal(signal.SIGTERM, _raise_terminated) if main else None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            if log:
                log.write(line)
            cause = ROOT_CAUSE.match(line)
            if cause and "ChildFailedError" not in line:
                causes[cause.group(1).strip()] = None
        rc = proc.wait()
    except (KeyboardInterrupt, Terminated) as stop:
        if main:  # a second SIGTERM must not cut the wait for the ranks short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        proc.terminate()
        proc.wait()
        print(f"\n{'interrupted' if isinstance(stop, KeyboardInterrupt) else 'terminated (SIGTERM)'}: the ranks "
              "were stopped; the same command again resumes from the last checkpoint", file=sys.stderr, flush=True)
        if isinstance(stop, Terminated):
            raise SystemExit(128 + signal.SIGTERM) from None
        raise
    finally:
        if main:
            signal.signal(signal.SIGTERM, old_handler)
        if log:
            log.close()
    if rc != 0 and causes:
        # A failed rank buries its error in every rank's traceback and torchrun's own: say it once.
        print("\nworker error: " + "\n              ".join(list(causes)[-3:]), file=sys.stderr, flush=True)
    return rc
