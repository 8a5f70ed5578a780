"""Jobs across nodes: torchrun's c10d rendezvous, the world size, and the check that all nodes match.

One `tuneledger train` (or `dryrun`) per node, each starting its node's ranks through torchrun's
elastic launcher with the c10d rendezvous (PyTorch's own; nothing here schedules or places work):

    tuneledger train CONFIG --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29400   # on node0
    tuneledger train CONFIG --nnodes 2 --node-rank 1 --rdzv-endpoint node0:29400   # on node1

- world size = nodes x processes per node; the global batch stays fixed, so gradient
  accumulation = global batch / (micro-batch x world size) (config.resolve).
- The node with --node-rank 0 hosts the rendezvous store and writes the ledgers; the others only
  start their ranks. runs/ must be one shared folder (NFS, a PVC): rank 0 writes checkpoints and
  results there, wherever c10d put it (ranks go to nodes in the order of their host names).
- --max-restarts N: torchrun restarts every node's ranks up to N times after a failure; each
  restart resumes from the last complete checkpoint (resume_from_checkpoint: auto).
- Before any weights load, every rank reports its host, GPU model, image (TUNELEDGER_IMAGE),
  tuneledger's code hash and installed packages over the process group; a mismatch stops the job
  naming what differs.

torchrun's documentation: https://pytorch.org/docs/stable/elastic/run.html
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from tuneledger.config import ConfigError
from tuneledger.words import count_at_least

# c10d rendezvous settings (torch.distributed.elastic.rendezvous). join_timeout: how long the first
# node waits for the last; nodes started by Slurm or Kubernetes can be minutes apart (an image pull
# of several GB), so 30 min instead of 10. read_timeout: one store call, 60 s by default, which a
# loaded node's agent missed (2 CPU "nodes" sharing 2 cores with other jobs, load average 60:
# "DistStoreError: wait timeout after 60000ms"), killing a healthy job.
RDZV_CONF = "join_timeout=1800,read_timeout=300"

# Restarts when a multi-node job does not say: a lost node or a preempted pod costs a restart from
# the last checkpoint, not the job. One node alone keeps torchrun's default, 0: a failure there is
# a bug or an OOM that a restart would only repeat.
DEFAULT_MAX_RESTARTS = 3


@dataclass(frozen=True)
class Nodes:
    """Where this launcher sits in the job. nnodes 1 is the ordinary single-machine run."""

    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # host:port of the c10d store, on the node with node_rank 0
    max_restarts: int = 0

    @property
    def multi(self) -> bool:
        return self.nnodes > 1

    @property
    def first(self) -> bool:
        """This launcher writes the ledgers (and clears folders): node 0, or the only node."""
        return self.node_rank == 0

    def world_size(self, nproc_per_node: int) -> int:
        return self.nnodes * nproc_per_node

    def suffix(self) -> str:
        """For the files (log, job) another node's launcher writes beside node 0's in the shared run
        folder: node 0 keeps the usual names (train.log), node 1 writes train-node1.log."""
        return "" if self.first else f"-node{self.node_rank}"

    def torchrun_args(self, nproc_per_node: int, rdzv_id: str) -> list[str]:
        """torchrun's options for a multi-node c10d rendezvous. Node 0 hosts the store (is_host);
        the others connect to it, waiting for it up to the rendezvous timeout."""
        return [f"--nproc-per-node={nproc_per_node}", f"--nnodes={self.nnodes}", f"--node-rank={self.node_rank}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={self.rdzv_endpoint}", f"--rdzv-id={rdzv_id}",
                f"--rdzv-conf=is_host={'true' if self.first else 'false'},{RDZV_CONF}", f"--max-restarts={self.max_restarts}"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--nnodes, --node-rank, --rdzv-endpoint, --max-restarts for train and dryrun."""
    p.add_argument("--nnodes", type=count_at_least(1), default=1, metavar="N", help="nodes in the job (default 1)")
    p.add_argument("--node-rank", type=count_at_least(0), default=None, metavar="R", help="this node's index, 0..N-1 (0 hosts the rendezvous)")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="node 0's address and a free port, the same on every node")
    p.add_argument("--max-restarts", type=count_at_least(0), default=None, metavar="K",
                   help=f"torchrun restarts after a failure, each resuming from the last checkpoint (default {DEFAULT_MAX_RESTARTS} "
                        "with several nodes, else 0)")


def from_args(args: argparse.Namespace) -> Nodes:
    """Nodes from the parsed options. Raises ConfigError naming the option that is wrong."""
    nnodes = getattr(args, "nnodes", None)
    nnodes = 1 if nnodes is None else nnodes
    rank, endpoint, restarts = getattr(args, "node_rank", None), getattr(args, "rdzv_endpoint", None), getattr(args, "max_restarts", None)
    if nnodes < 1:
        raise ConfigError(f"--nnodes (NNODES) must be >= 1, got {nnodes}")
    if restarts is not None and restarts < 0:
        raise ConfigError(f"--max-restarts (MAX_RESTARTS) must be >= 0, got {restarts}")
    if nnodes == 1:
        if rank not in (None, 0) or endpoint:
            raise ConfigError("--node-rank (NODE_RANK) and --rdzv-endpoint (RDZV_ENDPOINT) need --nnodes (NNODES) > 1")
        return Nodes(max_restarts=restarts or 0)
    if rank is None or not 0 <= rank < nnodes:
        raise ConfigError(f"--nnodes {nnodes} needs --node-rank (NODE_RANK) in 0..{nnodes - 1}, got {rank}")
    m = re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[^\s:/]+):(\d+)", endpoint or "")
    if not m or not 0 < int(m[2]) < 65536:
        raise ConfigError(f"--nnodes {nnodes} needs --rdzv-endpoint (RDZV_ENDPOINT) as HOST:PORT of node 0, e.g. "
                          f"node0:29400; got {endpoint!r}")
    return Nodes(nnodes, rank, endpoint, DEFAULT_MAX_RESTARTS if restarts is None else restarts)


# ------------------------------------------------------------------------------- the NCCL link
# NCCL names the transport of every channel it connects ("... via NET/Socket/0", "via P2P/IPC/read",
# "via SHM/direct/direct") and the network plugin it picked ("Using network IB"); both are INFO
# lines of the INIT subsystem. NET/* is between nodes; the rest is inside one.
_VIA = re.compile(r"NCCL INFO Channel .* via (\S+)")
_NETWORK = re.compile(r"NCCL INFO Using network (\S+)")


def nccl_env(log_dir: Path) -> dict[str, str]:
    """Environment that makes NCCL write its INFO lines (transport choices) and its warnings to
    log_dir/nccl-<host>-<pid>.log instead of the terminal. Empty when the user already asked for
    INFO or TRACE, or for a file of their own: theirs wins."""
    if os.environ.get("NCCL_DEBUG_FILE") or os.environ.get("NCCL_DEBUG", "").upper() in ("INFO", "TRACE"):
        return {}
    log_dir.mkdir(parents=True, exist_ok=True)
    return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": str(log_dir / "nccl-%h-%p.log")}


def nccl_transport(texts: list[str]) -> dict | None:
    """{network, inter_node, intra_node} from NCCL INFO logs: the plugin ("IB", "Socket") and the
    distinct channel transports; None when the logs name none (gloo, or NCCL_DEBUG set elsewhere)."""
    via: set[str] = set()
    network: set[str] = set()
    for text in texts:
        via.update(_VIA.findall(text))
        network.update(_NETWORK.findall(text))
    if not via and not network:
        return None
    return {"network": ", ".join(sorted(network)) or None,
            "inter_node": sorted(v for v in via if v.startswith("NET/")),
            "intra_node": sorted(v for v in via if not v.startswith("NET/"))}


def summary(nodes: Nodes, nproc_per_node: int, result: dict | None, nccl_dir: Path | None = None) -> dict:
    """The ledger's "nodes" entry: nodes, GPUs (processes) per node, each rank's host and the
    distinct hosts in rank order, NCCL's transport (from nccl_dir's logs) and, where the run
    measured it, the all-reduce bus bandwidth over the whole group."""
    ranks = (result or {}).get("ranks") or []
    rank_hosts = [r.get("host") for r in ranks]
    texts = [p.read_text(errors="replace") for p in sorted(nccl_dir.glob("nccl-*.log"))] if nccl_dir and nccl_dir.is_dir() else []
    busbw = ((result or {}).get("allreduce") or {}).get("busbw_gbs")
    return {"nnodes": nodes.nnodes, "gpus_per_node": nproc_per_node, "world_size": nodes.world_size(nproc_per_node),
            "hosts": list(dict.fromkeys(h for h in rank_hosts if h)), "rank_hosts": rank_hosts,
            "rendezvous": nodes.rdzv_endpoint, "max_restarts": nodes.max_restarts,
            "nccl": nccl_transport(texts), "allreduce_busbw_gbs": busbw}


# ------------------------------------------------------------------------------- same nodes
def host_name() -> str:
    """$TUNELEDGER_HOST, else the host name (a container's host name is its id: set it there)."""
    return os.environ.get("TUNELEDGER_HOST") or socket.gethostname()


def packages() -> dict[str, str]:
    """Installed distributions, name -> version (names normalised as pip does)."""
    from importlib.metadata import distributions

    out = {}
    for d in distributions():
        name = d.metadata["Name"]
        if name:
            out[re.sub(r"[-_.]+", "-", name).lower()] = d.version
    return dict(sorted(out.items()))


def code_hash() -> str:
    """sha256 (16 hex digits) of tuneledger's own source files: its version number stays 0.1.0
    while the code changes, so two checkouts of different commits must not pass as one."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.suffix in (".py", ".jinja", ".jsonl"):
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def fingerprint(gpu_name: str) -> dict:
    """What must match across nodes: GPU model, image (TUNELEDGER_IMAGE, e.g. `docker inspect
    --format {{.Id}}` of it, where the launcher sets it), tuneledger's code, and the installed
    packages with their hash (the environment's lock hash)."""
    pk = packages()
    return {"host": host_name(), "gpu": gpu_name, "image": os.environ.get("TUNELEDGER_IMAGE") or None,
            "code_hash": code_hash(),
            "lock_hash": hashlib.sha256("\n".join(f"{k}=={v}" for k, v in pk.items()).encode()).hexdigest()[:16],
            "packages": pk}


def differences(prints: list[dict]) -> list[str]:
    """One line per way the ranks' fingerprints differ from rank 0's, naming the hosts and values;
    [] when they all match. prints: one fingerprint per rank, in rank order."""
    if not prints:
        return []
    ref = prints[0]
    out = []
    for key, what in (("gpu", "GPU model"), ("image", "image"), ("code_hash", "tuneledger code (hash)")):
        seen = sorted(set((p["host"], p.get(key) or "") for p in prints))
        if len({v for _, v in seen}) > 1:
            out.append(f"{what}: " + ", ".join(f"{h} {v or '(not set)'}" for h, v in seen))
    for p in prints[1:]:
        if p["lock_hash"] == ref["lock_hash"]:
            continue
        names = sorted(set(ref["packages"]) | set(p["packages"]))
        diff = [f"{n} {ref['packages'].get(n, '(absent)')} on {ref['host']}, {p['packages'].get(n, '(absent)')} on {p['host']}"
                for n in names if ref["packages"].get(n) != p["packages"].get(n)]
        line = f"packages (lock hash {ref['lock_hash']} on {ref['host']}, {p['lock_hash']} on {p['host']}): " + "; ".join(diff[:8])
        out.append(line + (f"; and {len(diff) - 8} more" if len(diff) > 8 else ""))
    return list(dict.fromkeys(out))


class NodeMismatchError(RuntimeError):
    """The ranks of one job run on nodes that differ (GPU model, image or packages)."""


def check_same_nodes(gpu_name: str, backend: str, timeout_s: float) -> dict | None:
    """Gather every rank's fingerprint over the process group (initialising it, with the run's
    timeout, when torchrun started more than one rank) and raise NodeMismatchError naming each
    difference. Returns this rank's fingerprint, or None for a single process."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    mine = fingerprint(gpu_name)
    prints: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(prints, mine)
    diff = differences(prints)
    if diff:
        # One line: the launcher repeats a worker's last error line as the run's root cause.
        raise NodeMismatchError("the nodes of this job differ (run every node from the same image and lock, on one "
                                "GPU model): " + " | ".join(diff))
    return mine
