"""The environment run_workers gives the ranks: what the levers and the ETA rely on."""

from __future__ import annotations

import json
import sys

from tuneledger import launch

PROBE = "import json, os; print('ENV ' + json.dumps({k: os.environ.get(k) for k in ('TORCHINDUCTOR_CACHE_DIR', 'PYTORCH_CUDA_ALLOC_CONF', 'PYTORCH_ALLOC_CONF', 'TUNELEDGER_USE_UNSLOTH')}))"


def _rank_env(tmp_path, monkeypatch, job: dict, **env) -> dict:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    # One real process in place of torchrun's ranks, printing the variables it got.
    monkeypatch.setattr(launch, "torchrun_command", lambda nproc, port, target, extra=(): [sys.executable, "-c", PROBE])
    log = tmp_path / "launch.log"
    assert launch.run_workers({"mode": "dryrun", "cpu": True, "out_dir": str(tmp_path), **job}, tmp_path / "job.json", 1,
                              log_path=log) == 0
    line = next(ln for ln in log.read_text().splitlines() if ln.startswith("ENV "))
    return json.loads(line[4:])


def test_compiled_kernels_are_cached_beside_the_data(tmp_path, monkeypatch):
    """A train after its dry-run must find the dry-run's compiled kernels (not /tmp, which a
    container loses): inductor's cache lives under the job's cache_dir."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    env = _rank_env(tmp_path, monkeypatch, {"config": {"cache_dir": str(tmp_path / "cache")}})
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "cache" / "torchinductor").resolve())
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_a_users_inductor_cache_is_kept(tmp_path, monkeypatch):
    env = _rank_env(tmp_path, monkeypatch, {"config": {"cache_dir": str(tmp_path / "cache")}},
                    TORCHINDUCTOR_CACHE_DIR="/somewhere/else")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/else"


def test_ranks_import_unsloth_only_when_the_config_asks(tmp_path, monkeypatch):
    """use_unsloth: the ranks get the variable that makes them import Unsloth first; a value left
    in the shell never reaches a run that did not ask (Unsloth patches transformers as it imports)."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()  # a log each: launch.log is appended to
    assert _rank_env(tmp_path / "a", monkeypatch, {"config": {"use_unsloth": True}})["TUNELEDGER_USE_UNSLOTH"] == "1"
    assert _rank_env(tmp_path / "b", monkeypatch, {"config": {}}, TUNELEDGER_USE_UNSLOTH="1")["TUNELEDGER_USE_UNSLOTH"] is None


def test_the_new_allocator_variable_reaches_torch_2_5(tmp_path, monkeypatch):
    """torch 2.5.1 (the pinned image) reads only PYTORCH_CUDA_ALLOC_CONF, torch >= 2.8 the new name
    first: the ranks get one value under both names, and profile_step reads the same one."""
    from tuneledger import allocator

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    env = _rank_env(tmp_path, monkeypatch, {"config": {}}, PYTORCH_ALLOC_CONF="backend:cudaMallocAsync")
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == env["PYTORCH_ALLOC_CONF"] == "backend:cudaMallocAsync"
    both = {"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    (tmp_path / "b").mkdir()
    kept = _rank_env(tmp_path / "b", monkeypatch, {"config": {}}, **both)
    assert kept["PYTORCH_CUDA_ALLOC_CONF"] == kept["PYTORCH_ALLOC_CONF"] == "expandable_segments:False"
    assert allocator.keeps_history(both)  # what the ranks use: the native allocator, which records
    assert not allocator.keeps_history({"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"})
    for empty in ({"PYTORCH_CUDA_ALLOC_CONF": ""}, {"PYTORCH_ALLOC_CONF": " "}, {}):  # empty is unset
        assert allocator.rank_conf(empty) == (allocator.DEFAULT, None)
    value, note = allocator.rank_conf(both)
    assert value == "expandable_segments:False" and "differ" in note and "under both names" in note
    assert allocator.rank_conf({"PYTORCH_ALLOC_CONF": "a: b", "PYTORCH_CUDA_ALLOC_CONF": "a:b"})[1] is None  # spaces
    monkeypatch.setattr(allocator, "_said", set())
    assert allocator.apply(dict(both)) == note and allocator.apply(dict(both)) is None  # once per command
