"""deploy/: the Kubernetes manifests against their vendored CRD schemas (as `make lint` checks them),
what a multi-node pod needs, and the Slurm script's commands under a stand-in srun."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft7Validator

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
MANIFESTS = {"pytorchjob.yaml": "pytorchjob-kubeflow.org-v1.json", "jobset.yaml": "jobset-jobset.x-k8s.io-v1alpha2.json"}


def load(name: str) -> tuple[dict, Draft7Validator]:
    schema = json.loads((K8S / "schemas" / MANIFESTS[name]).read_text())
    return yaml.safe_load((K8S / name).read_text()), Draft7Validator(schema)


def pod_specs(doc: dict) -> list[dict]:
    if doc["kind"] == "PyTorchJob":
        return [r["template"]["spec"] for r in doc["spec"]["pytorchReplicaSpecs"].values()]
    return [j["template"]["spec"]["template"]["spec"] for j in doc["spec"]["replicatedJobs"]]


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_manifest_matches_its_schema_and_the_schema_is_strict(name):
    doc, v = load(name)
    assert [e.message for e in v.iter_errors(doc)] == []
    pod_specs(doc)[0]["terminationGracePeriodSecond"] = 180  # a typo Kubernetes would reject
    assert any("terminationGracePeriodSecond" in e.message for e in v.iter_errors(doc))
    doc, _ = load(name)
    pod_specs(doc)[0]["containers"][0]["resources"]["limits"]["memory"] = {"Gi": 512}
    assert list(v.iter_errors(doc))


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_manifest_has_what_a_multi_node_run_needs(name):
    doc, _ = load(name)
    graces = set()
    for pod in pod_specs(doc):
        trainer = pod["containers"][0]
        res = trainer["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] >= 1
        mounts = {m["mountPath"]: m for m in trainer["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
        for path in ("/workspace/runs", "/workspace/models", "/workspace/.cache"):
            assert "persistentVolumeClaim" in volumes[mounts[path]["name"]], path
        sidecar = pod["initContainers"][0]
        assert sidecar["restartPolicy"] == "Always" and sidecar["command"][:2] == ["tuneledger", "monitor"]
        assert any(m["mountPath"] == "/workspace/runs" for m in sidecar["volumeMounts"])
        cmd = " ".join(trainer["args"])
        for flag in ("tuneledger train", "--nnodes", "--node-rank", "--rdzv-endpoint", "--max-restarts"):
            assert flag in cmd
        graces.add(pod["terminationGracePeriodSeconds"])
    # Enough for a step and a checkpoint save (dry-run ledgers: up to ~10 s + ~2.5 s on an H200).
    assert len(graces) == 1 and graces.pop() >= 120


def fake_slurm(tmp_path: Path, nodes: int) -> dict:
    """srun runs its command once per node with SLURM_NODEID set (srun's own options dropped);
    scontrol lists the nodes; make, apptainer and the container's tuneledger-entrypoint print
    their arguments."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do echo "srun-option $1"; shift; done\n'
                               f'for i in $(seq 0 {nodes - 1}); do SLURM_NODEID=$i "$@" || exit; done\n')
    (bin_ / "scontrol").write_text(f'#!/bin/bash\nfor i in $(seq 1 {nodes}); do echo gpu-node$i; done\n')
    for tool in ("make", "apptainer", "tuneledger-entrypoint"):
        (bin_ / tool).write_text(f'#!/bin/bash\necho "{tool} $* host=$TUNELEDGER_HOST"\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": f"gpu-node[1-{nodes}]",
            "SLURM_JOB_NUM_NODES": str(nodes)}


def sbatch(tmp_path: Path, env: dict) -> str:
    p = subprocess.run(["bash", str(ROOT / "deploy" / "slurm" / "train.sbatch")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_sbatch_runs_make_train_once_per_node_with_its_rank(tmp_path):
    out = sbatch(tmp_path, {**fake_slurm(tmp_path, 3), "RDZV_PORT": "29500"})
    lines = [line for line in out.splitlines() if line.startswith("make ")]
    assert len(lines) == 3
    for rank, line in enumerate(lines):
        assert f"make train LOCAL=1 NNODES=3 NODE_RANK={rank} RDZV_ENDPOINT=gpu-node1:29500" in line
    assert "rendezvous gpu-node1:29500" in out


def test_sbatch_in_containers_passes_the_make_settings_as_arguments(tmp_path):
    env = {**fake_slurm(tmp_path, 2), "CONTAINER": "pyxis", "IMAGE": "registry/tuneledger:1", "PRESET": "C",
           "MODEL": "models/q", "RUN": "big", "ARGS": "lora_rank=8 seed=1", "MAX_RESTARTS": "2"}
    out = sbatch(tmp_path, env)
    assert "srun-option --container-image=registry/tuneledger:1" in out
    lines = [line for line in out.splitlines() if line.startswith("tuneledger-entrypoint ")]
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        assert line.startswith("tuneledger-entrypoint tuneledger train configs/qwen2.5-7b-qlora.yaml preset=C "
                               "model_name_or_path=models/q run_name=big --max-restarts 2 lora_rank=8 seed=1 "
                               f"--nnodes 2 --node-rank {rank} --rdzv-endpoint gpu-node1:29400")
    out = sbatch(tmp_path, {**env, "CONTAINER": "apptainer", "IMAGE": "t.sif"})
    assert out.count("apptainer exec --nv --pwd /workspace --bind ") == 2 and " t.sif tuneledger-entrypoint " in out
