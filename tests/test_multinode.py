"""Several nodes: the Make variables and options, torchrun's c10d arguments, the node check, the
NCCL transport parser, and real runs of 2 "nodes" x 1 gloo process on 127.0.0.1 (two `tuneledger
train` launchers, each its own torchrun, meeting at one c10d rendezvous) against 1 node x 2."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from procs import TIMEOUT_S, kill_tree
from procs import run as run_tree
from tuneledger.config import ConfigError, JobConfig, resolve
from tuneledger.launch import free_port
from tuneledger.nodes import DEFAULT_MAX_RESTARTS, Nodes, differences, fingerprint, from_args, nccl_transport, summary

ROOT = Path(__file__).resolve().parents[1]


def ns(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"nnodes": 1, "node_rank": None, "rdzv_endpoint": None, "max_restarts": None, **kw})


def test_options_make_the_rendezvous():
    n = from_args(ns(nnodes=2, node_rank=1, rdzv_endpoint="node0:29400"))
    assert n.multi and not n.first and n.max_restarts == DEFAULT_MAX_RESTARTS and n.world_size(4) == 8
    args = n.torchrun_args(4, "run-x")
    assert args == ["--nproc-per-node=4", "--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d",
                    "--rdzv-endpoint=node0:29400", "--rdzv-id=run-x",
                    "--rdzv-conf=is_host=false,join_timeout=1800,read_timeout=300", "--max-restarts=3"]
    assert "--rdzv-conf=is_host=true,join_timeout=1800,read_timeout=300" in from_args(ns(nnodes=2, node_rank=0, rdzv_endpoint="10.0.0.1:1")).torchrun_args(1, "r")
    assert from_args(ns(nnodes=2, node_rank=0, rdzv_endpoint="[fe80::1]:29400", max_restarts=0)).max_restarts == 0
    assert from_args(ns()) == Nodes() and not Nodes().multi and Nodes().suffix() == ""
    assert Nodes(2, 0, "h:1").suffix() == "" and n.suffix() == "-node1"


@pytest.mark.parametrize("kw, says", [
    ({"nnodes": 2, "rdzv_endpoint": "h:1"}, "needs --node-rank (NODE_RANK) in 0..1, got None"),
    ({"nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"}, "in 0..1, got 2"),
    ({"nnodes": 2, "node_rank": 0}, "needs --rdzv-endpoint (RDZV_ENDPOINT) as HOST:PORT"),
    ({"nnodes": 2, "node_rank": 0, "rdzv_endpoint": "node0"}, "got 'node0'"),
    ({"nnodes": 2, "node_rank": 0, "rdzv_endpoint": "node0:99999"}, "got 'node0:99999'"),
    ({"node_rank": 1}, "need --nnodes (NNODES) > 1"),
    ({"nnodes": 0}, "must be >= 1, got 0"),
    ({"max_restarts": -1}, "--max-restarts (MAX_RESTARTS) must be >= 0"),
])
def test_bad_options_are_refused_naming_the_variable(kw, says):
    with pytest.raises(ConfigError, match=None) as e:
        from_args(ns(**kw))
    assert says in str(e.value)


def test_global_batch_is_fixed_across_nodes():
    """accumulation = global / (micro-batch x nodes x processes per node)."""
    cfg = JobConfig(model_name_or_path="m", dataset=["d.json"], global_batch_size=32, per_device_train_batch_size=2)
    one = resolve(cfg, Nodes().world_size(2))
    two = resolve(cfg, from_args(ns(nnodes=2, node_rank=0, rdzv_endpoint="h:1")).world_size(2))
    assert (one.gradient_accumulation_steps, two.gradient_accumulation_steps) == (8, 4)
    with pytest.raises(ConfigError, match="world size 12"):
        resolve(cfg, Nodes(3, 0, "h:1").world_size(4))


def test_make_passes_the_node_variables():
    out = subprocess.run(["make", "-n", "train", "dryrun", "LOCAL=1", "VENV=/nonexistent", "NNODES=2", "NODE_RANK=1",
                          "RDZV_ENDPOINT=node0:29400", "MAX_RESTARTS=5", "MODEL=models/m"],
                         cwd=ROOT, capture_output=True, text=True).stdout
    lines = [line for line in out.splitlines() if " train " in line or " dryrun " in line]
    assert len(lines) == 2, out
    for line in lines:
        assert "--nnodes 2 --node-rank 1 --rdzv-endpoint node0:29400 --max-restarts 5" in line


def fp(host, gpu="NVIDIA H200", image=None, **pk):
    packages = {"torch": "2.5.1", "transformers": "5.17.0", **pk}
    h = "|".join(f"{k}={v}" for k, v in sorted(packages.items()))
    return {"host": host, "gpu": gpu, "image": image, "code_hash": "c0de", "lock_hash": h, "packages": packages}


def test_differences_name_the_hosts_and_values():
    assert differences([fp("a"), fp("a"), fp("b"), fp("b")]) == []
    d = differences([fp("a"), fp("a"), fp("b", gpu="NVIDIA A100-SXM4-80GB"), fp("b", gpu="NVIDIA A100-SXM4-80GB")])
    assert d == ["GPU model: a NVIDIA H200, b NVIDIA A100-SXM4-80GB"]
    d = differences([fp("a", image="sha256:1"), fp("b", image="sha256:2", torch="2.4.0", extra="1")])
    assert d[0] == "image: a sha256:1, b sha256:2"
    assert "torch 2.5.1 on a, 2.4.0 on b" in d[1] and "extra (absent) on a, 1 on b" in d[1]
    assert d[1].startswith("packages (lock hash ")
    assert differences([fp("a"), {**fp("b"), "code_hash": "beef"}]) == ["tuneledger code (hash): a c0de, b beef"]


def test_fingerprint_of_this_environment():
    f = fingerprint("cpu")
    assert f["gpu"] == "cpu" and len(f["lock_hash"]) == 16 and len(f["code_hash"]) == 16 and "torch" in f["packages"]
    assert differences([f, {**f, "host": "other"}]) == []


NCCL_LOG = """\
node0:13571:13571 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>
node0:13571:13571 [0] NCCL INFO Using network Socket
node0:13571:13571 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0
node0:13572:13572 [1] NCCL INFO Channel 00 : 2[1] -> 0[0] via SHM/direct/direct
node0:13571:13571 [0] NCCL INFO Channel 01/0 : 1[0] -> 0[0] [receive] via NET/Socket/0
gpu:919:1150 [0] NCCL INFO Channel 01/0 : 8[0] -> 15[7] via P2P/IPC/read
"""


def test_nccl_transport_from_its_info_lines(tmp_path):
    assert nccl_transport([NCCL_LOG]) == {"network": "Socket", "inter_node": ["NET/Socket/0"],
                                          "intra_node": ["P2P/IPC/read", "SHM/direct/direct"]}
    assert nccl_transport(["gloo says nothing"]) is None
    (tmp_path / "nccl-node0-1.log").write_text(NCCL_LOG)
    s = summary(Nodes(2, 0, "node0:1"), 2, {"ranks": [{"host": "a"}, {"host": "a"}, {"host": "b"}, {"host": "b"}],
                                           "allreduce": {"busbw_gbs": 11.5}}, tmp_path)
    assert s["hosts"] == ["a", "b"] and s["world_size"] == 4 and s["gpus_per_node"] == 2
    assert s["nccl"]["network"] == "Socket" and s["allreduce_busbw_gbs"] == 11.5


# ------------------------------------------------------------------------------- real runs
def tl_args(tmp_path, tiny_model, name):
    return [sys.executable, "-m", "tuneledger", "train", str(ROOT / "configs" / "tiny.yaml"),
            f"model_name_or_path={tiny_model}", f"output_dir={tmp_path / name}", f"cache_dir={tmp_path / 'cache'}",
            "max_samples=48", "cutoff_len=128", "global_batch_size=8", "preset=C", "max_steps=3", "save_steps=3",
            "logging_steps=1", "report_to=none", "--cpu"]


def run_nodes(tmp_path, tiny_model, name, envs, base=None):
    """Two launchers on 127.0.0.1, node 0 and node 1, one process each; returns (exit code, output)
    of each. base: the command without the node options (default: train `name`)."""
    port = free_port()
    started = []
    try:
        for rank, extra in enumerate(envs):
            cmd = (base or tl_args(tmp_path, tiny_model, name)) + [
                "--nproc", "1", "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--max-restarts", "0"]
            log = tmp_path / f"{name}-node{rank}.out"  # a file, not a pipe: a full pipe would stall a node
            with open(log, "w") as out:
                started.append((subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **extra}, stdout=out,
                                                 stderr=subprocess.STDOUT, text=True, start_new_session=True), log))
        return [(p.wait(timeout=TIMEOUT_S), log.read_text()) for p, log in started]
    finally:
        for p, _ in started:
            if p.poll() is None:  # timed out or failed: the node's whole tree, its ranks included
                kill_tree(p.pid)


def losses(run: Path) -> list[float]:
    state = json.loads((run / "checkpoint-3" / "trainer_state.json").read_text())
    return [h["loss"] for h in state["log_history"] if "loss" in h]


@pytest.mark.e2e
@pytest.mark.slow  # three 2-rank trainings: the slow tier (`make test-all`, CI)
def test_two_nodes_of_one_process_train_as_one_node_of_two(tmp_path, tiny_model):
    # The two launchers start on an empty data cache, as a first multi-node run does: both
    # tokenize into the one shared cache at once.
    one_thread = {"OMP_NUM_THREADS": "1"}  # the launcher's default is cores / processes per node: 2 here, 1 below
    outs = run_nodes(tmp_path, tiny_model, "two", [{"TUNELEDGER_HOST": "node-a", **one_thread},
                                                   {"TUNELEDGER_HOST": "node-b", **one_thread}])
    for rc, out in outs:
        assert rc == 0, out[-4000:]
    cached = [p.name for p in (tmp_path / "cache").iterdir()]
    assert len(cached) == 1 and ".tmp" not in cached[0], cached  # one copy, no half-written one left
    one = run_tree(tl_args(tmp_path, tiny_model, "one") + ["--nproc", "2"], cwd=ROOT, env={**os.environ, **one_thread})
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert "node 0 of 2, c10d rendezvous 127.0.0.1:" in outs[0][1]
    assert "node 1: this node's ranks are done" in outs[1][1]
    assert "micro-batch 2 x world size 2 x gradient accumulation 2 = global batch 8" in outs[0][1]
    result = json.loads((tmp_path / "two" / "train.json").read_text())
    assert result["world_size"] == 2 and result["global_step"] == 3
    nodes = result["nodes"]
    assert (nodes["nnodes"], nodes["gpus_per_node"], nodes["world_size"]) == (2, 1, 2)
    assert sorted(nodes["hosts"]) == ["node-a", "node-b"] and nodes["nccl"] is None  # gloo: no NCCL
    assert (tmp_path / "two" / "train.log").is_file() and (tmp_path / "two" / "train-node1.log").is_file()

    # Same world size, data order, seed and threads per rank: the same losses, step by step. The
    # first step's forward is the same arithmetic; later steps may differ by float rounding in the
    # CPU kernels (1.8e-5 relative at step 3 was seen with 2 threads per rank against 1).
    ref, got = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(ref) == len(got) == 3 and got[0] == pytest.approx(ref[0], rel=1e-6)
    assert got == pytest.approx(ref, rel=1e-4)
    one_loss = json.loads((tmp_path / "one" / "train.json").read_text())["train_loss"]
    assert result["train_loss"] == pytest.approx(one_loss, rel=1e-4)


@pytest.mark.e2e
@pytest.mark.slow  # a 2-process run of minutes on 2 cores: make test stays under 10 min
def test_nodes_from_different_images_are_refused_naming_the_difference(tmp_path, tiny_model):
    outs = run_nodes(tmp_path, tiny_model, "mixed", [{"TUNELEDGER_HOST": "node-a", "TUNELEDGER_IMAGE": "sha256:aaa"},
                                                     {"TUNELEDGER_HOST": "node-b", "TUNELEDGER_IMAGE": "sha256:bbb"}])
    for rc, out in outs:
        assert rc != 0
        assert "NodeMismatchError: the nodes of this job differ" in out, out[-4000:]
        assert "image: node-a sha256:aaa, node-b sha256:bbb" in out
    assert not list((tmp_path / "mixed").glob("checkpoint-*"))  # refused before a step ran


@pytest.mark.e2e
@pytest.mark.slow  # a 2-process run of minutes on 2 cores: make test stays under 10 min
def test_dryrun_on_two_nodes_writes_one_ledger_with_the_nodes(tmp_path, tiny_model):
    base = [sys.executable, "-m", "tuneledger", "dryrun", str(ROOT / "configs" / "tiny.yaml"),
            f"model_name_or_path={tiny_model}", f"output_dir={tmp_path / 'dry'}", f"cache_dir={tmp_path / 'cache'}",
            "max_samples=48", "cutoff_len=128", "global_batch_size=8", "dryrun_steps=3", "dryrun_warmup_steps=1",
            "report_to=none", "--preset", "C", "--cpu"]
    outs = run_nodes(tmp_path, tiny_model, "dry", [{"TUNELEDGER_HOST": "node-0"}, {"TUNELEDGER_HOST": "node-1"}], base)
    for rc, out in outs:
        assert rc == 0, out[-4000:]
    assert "node 1: 1 preset ran; node 0 writes the ledger" in outs[1][1]
    led = json.loads((tmp_path / "dry" / "dryrun.json").read_text())
    assert led["world_size"] == 2 and led["nodes"]["nnodes"] == 2 and sorted(led["nodes"]["hosts"]) == ["node-0", "node-1"]
    row = led["presets"][0]
    assert row["micro_batch"] * row["gradient_accumulation_steps"] * 2 == 8 and row["tokens_per_s"] > 0
    assert led["nodes"]["allreduce_busbw_gbs"] == row["allreduce"]["busbw_gbs"] > 0
    assert "- nodes: 2 x 1 (" in (tmp_path / "dry" / "dryrun.md").read_text()
    assert (tmp_path / "dry" / "dryrun-node1.log").is_file()
