"""Security (issue 13): checkpoint files cannot run code, the rendezvous listens on loopback only,
trust_remote_code is refused."""

import json
import os
import pickle
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import procs
from tuneledger.safeload import UnsafeCheckpointError, checkpoint_loading, safe_torch_load

HERE = Path(__file__).resolve().parent


class MakesADirectory:
    """Unpickling this calls os.mkdir(path): the crafted payload. Were it ever unpickled, the
    directory would exist."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def crafted(tmp_path, how):
    marker = tmp_path / f"pwned-{how}"
    payload = {"state": {}, "param_groups": [], "x": MakesADirectory(marker)}
    path = tmp_path / f"optimizer-{how}.pt"
    if how == "zip":
        torch.save(payload, path)
    elif how == "legacy":
        torch.save(payload, path, _use_new_zipfile_serialization=False)
    elif how == "pickle":
        path.write_bytes(pickle.dumps(payload))
    return path, marker


@pytest.mark.parametrize("how,says", [("zip", "not on the allow-list"), ("legacy", "not torch's zip format"),
                                      ("pickle", "not torch's zip format")])
def test_crafted_pickle_never_runs(tmp_path, how, says):
    path, marker = crafted(tmp_path, how)
    with pytest.raises(UnsafeCheckpointError, match=says) as e:
        safe_torch_load(str(path), map_location="cpu")
    assert str(path) in str(e.value)
    assert not marker.exists()


def test_torchscript_archive_is_refused_before_torch_reads_it(tmp_path, monkeypatch):
    # torch < 2.6 hands any TorchScript zip to torch.jit.load, weights_only or not (CVE-2025-32434).
    path = tmp_path / "rng_state_0.pth"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(path))
    monkeypatch.setattr(torch.jit, "load", lambda *a, **k: pytest.fail("torch.jit.load was reached"))
    with pytest.raises(UnsafeCheckpointError, match="TorchScript archive"):
        safe_torch_load(str(path))


def test_real_optimizer_scheduler_and_rng_state_load(tmp_path):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    torch.save(sched.state_dict(), tmp_path / "scheduler.pt")
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    torch.save(rng, tmp_path / "rng_state_0.pth")
    got = safe_torch_load(str(tmp_path / "optimizer.pt"), map_location=torch.device("cpu", 1))  # "cpu:N" as CPU ranks ask
    assert torch.equal(got["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert safe_torch_load(str(tmp_path / "scheduler.pt"))["base_lrs"] == [1e-3]
    back = safe_torch_load(str(tmp_path / "rng_state_0.pth"))
    assert back["python"] == rng["python"] and np.array_equal(back["numpy"][1], rng["numpy"][1])


def test_trainer_resume_goes_through_the_safe_load(tmp_path):
    import transformers.trainer as hf_trainer

    path, marker = crafted(tmp_path, "zip")
    original = torch.load
    with checkpoint_loading():
        hf_trainer.check_torch_load_is_safe()  # lifted: our checks replace it
        with pytest.raises(UnsafeCheckpointError):
            hf_trainer.torch.load(str(path), map_location="cpu", weights_only=True)  # as Trainer calls it
    assert torch.load is original and not marker.exists()


# ----------------------------------------------------------------------------- rendezvous
def test_single_node_rendezvous_and_ranks_listen_on_loopback_only(tmp_path):
    from tuneledger.launch import free_port, loopback_env, torchrun_command

    out = tmp_path / "listening.json"
    port = free_port()
    env = loopback_env({k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")})
    env["CUDA_VISIBLE_DEVICES"] = ""
    p = procs.run(torchrun_command(2, port, [str(HERE / "listen_probe.py"), str(out)]), env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["master_port"] == port
    ports = {row["port"] for row in got["listening"]}
    assert port in ports  # the probe does see the store's socket
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 as /proc/net shows them
    assert all(row["addr"] in loopback for row in got["listening"]), got["listening"]


# ---------------------------------------------------------------------------- remote code
def test_trust_remote_code_is_accepted_but_model_code_never_runs(tmp_path):
    """LLaMA-Factory configs carry trust_remote_code: true; it is accepted and said to have no
    effect, and a model that ships its own code (auto_map) is refused, whatever the flag."""
    from tuneledger.config_load import load_config
    from tuneledger.model import PreflightError, check_remote_code

    base = {"model_name_or_path": "m", "dataset": ["x.json"]}
    assert load_config(None, {**base, "trust_remote_code": True}).trust_remote_code is True
    builtin = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    assert "has no effect" in check_remote_code(builtin, "m", True)
    assert "none" in check_remote_code(builtin, "m", False)
    custom = {**builtin, "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}
    for trust in (True, False):
        with pytest.raises(PreflightError, match=r"ships its own Python code .*AutoModelForCausalLM"):
            check_remote_code(custom, "m", trust)

