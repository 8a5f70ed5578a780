"""Preflight: each failure answers in seconds, before any weights load, naming the fix."""

import json
import shutil
import sys
import time

import pytest

from tuneledger.config_load import load_config
from tuneledger.model import PreflightError
from tuneledger.preflight_checks import run_checks


def cfg_for(model, tmp_path, **kw):
    return load_config(None, {"model_name_or_path": str(model), "dataset": ["x.json"], "quantization_bit": None,
                              "output_dir": str(tmp_path / "run"), **kw})


def model_dir(tmp_path, tiny_model, **config):
    d = tmp_path / "model"
    shutil.copytree(tiny_model, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(config)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_all_checks_pass_on_the_tiny_model(tiny_model, tmp_path):
    lines = run_checks(cfg_for(tiny_model, tmp_path), cuda=False)
    assert any("SYNTHETIC" in line for line in lines) and any("tensorboard" in line for line in lines)


def test_vision_language_variant_is_refused_before_any_weight(tmp_path):
    d = tmp_path / "qwen-vl"
    d.mkdir()  # config.json only: no weights at all, as before a 15 GB download
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
                                               "vision_config": {"depth": 32}}))
    t0 = time.perf_counter()
    with pytest.raises(PreflightError, match="vision-language model .*Qwen/Qwen2.5-7B-Instruct rather than Qwen/Qwen2.5-VL-7B-Instruct"):
        run_checks(cfg_for(d, tmp_path), cuda=False)
    assert time.perf_counter() - t0 < 5


def test_not_a_causal_lm_is_refused(tmp_path, tiny_model):
    d = model_dir(tmp_path, tiny_model, architectures=["BertForMaskedLM"], model_type="bert")
    with pytest.raises(PreflightError, match="no \\*ForCausalLM"):
        run_checks(cfg_for(d, tmp_path), cuda=False)


def test_a_lora_target_that_is_not_a_layer_is_refused_before_any_rank(tiny_model, tmp_path):
    """A misspelt lora_target failed inside every rank of every preset, after the weights loaded;
    now preflight names it with the model's layer names. Names that are there (short or full) pass."""
    with pytest.raises(PreflightError, match="lora_target: nosuch_proj: no such layer in .*q_proj.*or lora_target: all"):
        run_checks(cfg_for(tiny_model, tmp_path, lora_target="q_proj,nosuch_proj"), cuda=False)
    lines = run_checks(cfg_for(tiny_model, tmp_path, lora_target="q_proj, model.layers.0.mlp.down_proj"), cuda=False)
    layers = json.loads((tiny_model / "config.json").read_text())["num_hidden_layers"]
    assert f"lora_target: q_proj, model.layers.0.mlp.down_proj ({layers + 1} layers)" in lines


def test_missing_tensorboard_fails_with_the_fix(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # even if an earlier test imported it
    with pytest.raises(PreflightError, match="pip install tensorboard .* or set report_to=none"):
        run_checks(cfg_for(tiny_model, tmp_path), cuda=False)
    assert any("logging: none" in line for line in run_checks(cfg_for(tiny_model, tmp_path, report_to="none"), cuda=False))


def test_missing_tensorboard_never_crashes_a_run_after_load(monkeypatch, capsys):
    from tuneledger.worker import resolve_report_to

    monkeypatch.setitem(sys.modules, "tensorboard", None)
    cfg = load_config(None, {"model_name_or_path": "m", "dataset": ["x.json"]})
    assert resolve_report_to(cfg, rank=0) == "none"
    assert "training continues without TensorBoard" in capsys.readouterr().err


def test_quantization_without_cuda_is_refused(tiny_model, tmp_path):
    with pytest.raises(PreflightError, match="needs a CUDA GPU"):
        run_checks(cfg_for(tiny_model, tmp_path, quantization_bit=4), cuda=False)


def test_disk_too_small_for_the_checkpoints(tiny_model, tmp_path, monkeypatch):
    import tuneledger.preflight_checks as pf

    monkeypatch.setattr(pf.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    with pytest.raises(PreflightError, match="bytes free; 4 more checkpoints of"):
        run_checks(cfg_for(tiny_model, tmp_path), cuda=False)


def test_7b_checkpoint_estimate_matches_the_field_report():
    from tuneledger.preflight_checks import checkpoint_bytes
    from tuneledger.synth import ARCHS

    # The field report's LoRA: r=64 on every projection (the defaults are LLaMA-Factory's r=8).
    cfg = load_config(None, {"model_name_or_path": "m", "dataset": ["x.json"], "lora_rank": 64, "lora_alpha": 128})
    assert checkpoint_bytes(cfg, ARCHS["qwen2.5-7b"]) == 161_480_704 * 12  # ~1.94 GB: the report's "~1.9 GB"


def test_hub_id_offline_says_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PreflightError, match="Qwen/Qwen2.5-7B-Instruct: no such directory, and the hub is offline.*make fetch.*HF_ENDPOINT"):
        run_checks(cfg_for("Qwen/Qwen2.5-7B-Instruct", tmp_path), cuda=False)


def test_use_unsloth_gc_pinned_host_memory_is_checked_against_what_the_host_has(monkeypatch, tmp_path):
    """Qwen2.5-7B's (28 + 1) blocks of micro-batch 2 x cutoff_len 2048 x hidden 3584 x 2 bytes
    (29.4 MB, a 33.6 MB power-of-two block) = 1.0 GB pinned a rank; 8 ranks: 7.8 GB. Counted for
    the ranks this host starts (nproc), not its GPUs. Refused above 80% of MemAvailable, said
    otherwise, and nothing to check without the lever, without checkpointing or on a CPU."""
    import torch

    from tuneledger import preflight_checks
    from tuneledger.config_load import load_config
    from tuneledger.model import PreflightError

    qwen = {"num_hidden_layers": 28, "hidden_size": 3584}
    cfg = load_config(None, {"model_name_or_path": "m", "dataset": ["x.json"], "use_unsloth_gc": True,
                             "per_device_train_batch_size": 2, "cutoff_len": 2048})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(preflight_checks, "mem_available", lambda: 64 * 10**9)
    line = preflight_checks.check_host_memory(cfg, qwen, cuda=True)
    # 2 x 2048 x 3584 x 2 bytes = 29.4 MB, a 33.6 MB block; x 29 = 0.97 GB a rank
    assert line == ("host memory: use_unsloth_gc pins about 1.0 GB a rank ((layers + 1) x micro-batch x cutoff_len x "
                    "hidden, bf16, in power-of-two blocks), 7.8 GB for 8 ranks on this host (up to twice that over rows of many "
                    "lengths: torch's pinned cache keeps blocks of each power of two it was asked for) of 64.0 GB available"), line
    monkeypatch.setattr(preflight_checks, "mem_available", lambda: 8 * 10**9)
    with pytest.raises(PreflightError, match=r"7.8 GB for 8 ranks on this host \(up to twice .*\), over 80% of the 8.0 GB the host has available: "
                                             r"set use_unsloth_gc=false"):
        preflight_checks.check_host_memory(cfg, qwen, cuda=True)
    # nproc=2 on the 8-GPU host: two ranks pin 1.9 GB, under 80% of 8 GB
    assert preflight_checks.check_host_memory(cfg, qwen, cuda=True, ranks_here=2).endswith(
        "1.9 GB for 2 ranks on this host (up to twice that over rows of many lengths: torch's pinned cache keeps blocks "
        "of each power of two it was asked for) of 8.0 GB available")
    monkeypatch.setattr(preflight_checks, "mem_available", lambda: 64 * 10**9)
    assert "1.9 GB a rank" in preflight_checks.check_host_memory(cfg.model_copy(update={"bf16": False}), qwen, cuda=True)
    assert "not estimated (config.json gives no num_hidden_layers and hidden_size)" in \
        preflight_checks.check_host_memory(cfg, {"n_layer": 12, "n_embd": 768}, cuda=True)
    assert "moves nothing here (each layer input, 0.03 MiB, is under 1 MiB)" in preflight_checks.check_host_memory(
        cfg.model_copy(update={"cutoff_len": 128}), {"num_hidden_layers": 2, "hidden_size": 64}, cuda=True)
    assert preflight_checks.check_host_memory(cfg, qwen, cuda=False) is None
    assert preflight_checks.check_host_memory(cfg.model_copy(update={"use_unsloth_gc": False}), qwen, cuda=True) is None
    assert preflight_checks.check_host_memory(cfg.model_copy(update={"gradient_checkpointing": False}), qwen, cuda=True) is None
    # a dry-run of several presets names the one refused, and says the others can still be dry-run
    monkeypatch.setattr(preflight_checks, "mem_available", lambda: 8 * 10**9)
    b = load_config(None, {"model_name_or_path": "m", "dataset": ["x.json"], "use_unsloth_gc": True, "preset": "B",
                           "cutoff_len": 2048})
    with pytest.raises(PreflightError, match=r"^host memory \(preset B\): use_unsloth_gc pins .*7.8 GB for 8 ranks.*"
                                             r"or dry-run the other presets \(--preset\)$"):
        preflight_checks.check_host_memory(b, qwen, cuda=True, named=True)
    monkeypatch.undo()
    assert 0 < preflight_checks.mem_available() < 2**50  # bytes, as psutil reads them here


def test_host_memory_is_checked_for_each_preset_that_will_run(tiny_model, tmp_path, monkeypatch):
    """A dry-run passes its resolved presets (jobs): each is checked with its own micro-batch, not
    the config as written (micro-batch 1 where B runs 2); tune passes none (each candidate's dry-run
    checks itself); train, the config alone."""
    from tuneledger import preflight_checks

    seen = []
    monkeypatch.setattr(preflight_checks, "check_host_memory",
                        lambda job, config, cuda, ranks, named=False: seen.append((job.preset, job.per_device_train_batch_size, named)))
    cfg = cfg_for(tiny_model, tmp_path)
    jobs = [cfg_for(tiny_model, tmp_path, preset=p) for p in ("A", "B")]
    run_checks(cfg, cuda=False, jobs=jobs)
    assert seen == [("A", 1, True), ("B", 2, True)]
    seen.clear()
    run_checks(cfg, cuda=False, jobs=[])
    assert seen == []
    run_checks(cfg, cuda=False)
    assert seen == [(None, 1, False)]


def test_the_preflight_verb_takes_the_ranks_this_host_will_start(monkeypatch, capsys):
    """`tuneledger preflight --nproc N` counts use_unsloth_gc's host memory for N ranks, as dryrun and
    train do with theirs; without it, one per visible GPU (None)."""
    import argparse

    from tuneledger import preflight

    seen = []
    monkeypatch.setattr(preflight, "run_checks", lambda cfg, cuda, ranks_here=None: seen.append((cuda, ranks_here)) or ["x"])
    parser = argparse.ArgumentParser()
    preflight.add_parser(parser.add_subparsers())
    for argv, want in ((["preflight", "--nproc", "2", "model_name_or_path=m", "dataset=x.json"], (None, 2)),
                       (["preflight", "--cpu", "model_name_or_path=m", "dataset=x.json"], (False, None))):
        args = parser.parse_args(argv)
        assert args.func(args) == 0 and seen.pop() == want
    assert "ok  x" in capsys.readouterr().out
