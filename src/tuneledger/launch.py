"""Start the per-rank workers with torchrun, one process per GPU (gloo processes on a CPU).

The rendezvous port is picked free by the OS each time: the field notes hit 'Address already in
use' on torchrun's default 29500 when a second job shared the machine.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path


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
    return gpus == 0, nproc or gpus or 2


def last_checkpoint(out_dir: Path, require: tuple[str, ...] = ()) -> str | None:
    """The newest complete checkpoint-N in out_dir (one with trainer_state.json and `require`)."""
    done = [p for p in Path(out_dir).glob("checkpoint-*") if p.name.split("-")[-1].isdigit()
            and all((p / f).is_file() for f in ("trainer_state.json", *require))]
    return str(max(done, key=lambda p: int(p.name.split("-")[-1]))) if done else None


def run_workers(job: dict, job_path: Path, nproc: int, log_path: Path | None = None) -> int:
    """Write `job` to `job_path` and run `nproc` ranks of tuneledger.trainer on it; return the exit code.

    Output streams to the terminal and, when `log_path` is given, to that file as well.
    """
    job_path.parent.mkdir(parents=True, exist_ok=True)
    job_path.write_text(json.dumps(job, indent=1, ensure_ascii=False))
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
           "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "tuneledger.trainer", str(job_path)]
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("NCCL_DEBUG", "WARN")
    env.setdefault("TORCH_WARM_POOL", "0")  # no compile-worker pool per rank (see cli.main)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // max(1, nproc))))
    env["PYTHONUNBUFFERED"] = "1"
    if job.get("cpu"):
        env["CUDA_VISIBLE_DEVICES"] = ""
    print(f"launch: {nproc} process(es), rendezvous 127.0.0.1:{port}", flush=True)
    log = open(log_path, "a", encoding="utf-8") if log_path else None
    causes: dict[str, None] = {}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
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
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
        print("\ninterrupted: the ranks were stopped; the same command again resumes from the last checkpoint",
              file=sys.stderr, flush=True)
        raise
    finally:
        if log:
            log.close()
    if rc != 0 and causes:
        # A failed rank buries its error in every rank's traceback and torchrun's own: say it once.
        print("\nworker error: " + "\n              ".join(list(causes)[-3:]), file=sys.stderr, flush=True)
    return rc
