"""Preset F (FSDP2 over the base, sharding.py) against DDP, on CPU over gloo.

The 2-rank runs need torch >= 2.6 (accelerate's FSDP2 plugin): they run in .venv-quant (torch
2.13, `make test-quant`; CI runs it). In the trainer's venv (torch 2.5.1, the pinned image's) they
skip, and F is refused before any weights load, which the fast tier checks.

Tolerance. Both runs are fp32 on the CPU with the same seed, data order and batch shape (micro-
batch 2 x 2 ranks, accumulation 1); F reduces the gradients by reduce-scatter where DDP all-reduces,
so the sums may run in another order: about 1e-7 relative per step. 20 steps of Adam at lr 1e-4 on
losses near 12 stay within LOSS_ATOL = 1e-4 of each other (measured: identical to the last bit on
2 gloo ranks, torch 2.13). A resumed run must match the uninterrupted one within the same bound:
the adapter, the Adam state, the scheduler and each rank's RNG come back in either direction.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import procs

ROOT = Path(__file__).resolve().parents[1]
LOSS_ATOL = 1e-4
HAVE_FSDP2 = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 6)
needs_fsdp2 = pytest.mark.skipif(not HAVE_FSDP2, reason=f"FSDP2 through accelerate needs torch >= 2.6 (this venv has "
                                 f"{torch.__version__}): `make test-quant` runs these in .venv-quant (torch 2.13)")
TRAINER_PY = Path(os.environ.get("TUNELEDGER_TRAINER_PYTHON", ROOT / ".venv" / "bin" / "python"))


def tl(*args, env=None, python=sys.executable):
    return procs.run([str(python), "-m", "tuneledger", *args], env={**os.environ, **(env or {})}, cwd=ROOT)


def job(tmp_path, model, name, *extra):
    # 80 records = 20 steps of global batch 4 (micro-batch 2 x 2 ranks); no dropout: the masks would
    # be drawn in another order by another wrapper, and the comparison is of the arithmetic.
    return [str(ROOT / "configs" / "tiny.yaml"), f"model_name_or_path={model}", f"output_dir={tmp_path / name}",
            f"cache_dir={tmp_path / 'cache'}", "max_samples=80", "cutoff_len=128", "global_batch_size=4",
            "lora_dropout=0", "logging_steps=1", "save_steps=5", "report_to=none", "plot_loss=false", *extra]


def losses(run: Path) -> dict[int, float]:
    last = max(run.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    history = json.loads((last / "trainer_state.json").read_text())["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h}


def train(tmp_path, model, name, preset, *extra, env=None):
    p = tl("train", *job(tmp_path, model, name, f"preset={preset}", *extra), "--nproc", "2", "--cpu", env=env)
    return p


def test_f_is_refused_before_any_weights_load_on_an_old_torch(tmp_path, tiny_model, monkeypatch):
    from tuneledger import sharding
    from tuneledger.config_load import load_config
    from tuneledger.model_location import PreflightError
    from tuneledger.preflight_checks import check_sharding

    with pytest.raises(ValueError, match=r"preset F \(fsdp\) needs torch >= 2\.6 .*torch 2\.5\.1\+cu121 .*presets A-D"):
        sharding.check_torch("2.5.1+cu121")
    sharding.check_torch("2.6.0")
    cfg = load_config(ROOT / "configs" / "tiny.yaml", {"model_name_or_path": str(tiny_model), "preset": "F"})
    monkeypatch.setattr(torch, "__version__", "2.5.1+cu124")
    with pytest.raises(PreflightError, match="needs torch >= 2.6"):
        check_sharding(cfg)
    if not HAVE_FSDP2:  # the real command, in the pinned torch: one line, before torchrun starts
        p = tl("train", *job(tmp_path, tiny_model, "old", "preset=F"), "--nproc", "2", "--cpu")
        assert p.returncode == 1 and "needs torch >= 2.6" in p.stderr and "launch:" not in p.stdout, p.stderr[-2000:]


def test_f_settings_and_refusals():
    from tuneledger import sharding
    from tuneledger.config import ConfigError, JobConfig
    from tuneledger.config_load import load_config
    from tuneledger.llamafactory import classify

    cfg = load_config(ROOT / "configs" / "tiny.yaml", {"preset": "F"})
    assert cfg.sharded and cfg.fsdp == "full_shard auto_wrap" and cfg.per_device_train_batch_size == 2
    args = sharding.fsdp_arguments(cfg, ["Qwen2DecoderLayer"])
    assert args["fsdp"] is True and args["fsdp_config"] == {
        "version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"],
        "reshard_after_forward": True, "activation_checkpointing": True, "state_dict_type": "FULL_STATE_DICT"}
    # LLaMA-Factory's and transformers' forms: the fsdp_ prefix, shard_grad_op, offload
    lf = load_config(ROOT / "configs" / "tiny.yaml", {"fsdp": "shard_grad_op auto_wrap offload",
                                                      "fsdp_config": {"fsdp_transformer_layer_cls_to_wrap": ["X"]}})
    conf = sharding.fsdp_arguments(lf, ["Qwen2DecoderLayer"])["fsdp_config"]
    assert conf["reshard_after_forward"] is False and conf["cpu_offload"] is True and conf["transformer_layer_cls_to_wrap"] == ["X"]
    assert sharding.fsdp_arguments(load_config(ROOT / "configs" / "tiny.yaml", {"preset": "B"}), []) == {}
    assert not JobConfig(model_name_or_path="m", dataset=["d"], fsdp="false").sharded
    for bad, msg in (({"fsdp": "hybrid_shard"}, "unknown option"), ({"fsdp": "full_shard", "fsdp_config": {"version": 1}},
                                                                      "FSDP2 only"),
                     ({"fsdp": "full_shard", "fsdp_config": {"sync_everything": True}}, "unknown key")):
        with pytest.raises(ConfigError, match=msg):
            load_config(ROOT / "configs" / "tiny.yaml", bad)
    with pytest.raises(ValueError, match="enable_liger_kernel: true is not supported with fsdp"):
        sharding.lever_settings(load_config(ROOT / "configs" / "tiny.yaml", {"preset": "F", "enable_liger_kernel": True}))
    v = classify("deepspeed", "examples/deepspeed/ds_z3_config.json")
    assert v.status == "refused" and "ZeRO and 4-bit (QLoRA) weights do not mix" in v.text and "preset F" in v.text


def test_the_fit_formula():
    from tuneledger.sharding import predicted_peak_gib

    # one rank: everything as measured; 4 ranks: a quarter of the state, plus the gathered layers
    assert predicted_peak_gib(20.0, 1.0, 3.0, 0.5, 1) == pytest.approx(24.0)
    assert predicted_peak_gib(20.0, 1.0, 3.0, 0.5, 4) == pytest.approx(21 / 4 + 3 + 2 * 0.5 * 3 / 4)
    with pytest.raises(ValueError):
        predicted_peak_gib(1, 1, 1, 1, 0)


@needs_fsdp2
@pytest.mark.e2e
def test_f_matches_ddp_and_resumes_ddp_f_ddp(tmp_path, tiny_model):
    ddp = train(tmp_path, tiny_model, "ddp", "B")
    assert ddp.returncode == 0, ddp.stdout[-3000:] + ddp.stderr[-3000:]
    f = train(tmp_path, tiny_model, "f", "F")
    assert f.returncode == 0, f.stdout[-3000:] + f.stderr[-3000:]
    assert "FSDP2: the base sharded over 2 ranks" in f.stdout
    led = json.loads((tmp_path / "f" / "train.json").read_text())
    assert led["model"]["levers"]["sharding"].startswith("FSDP2 (accelerate's plugin): units Qwen2DecoderLayer")
    want, got = losses(tmp_path / "ddp"), losses(tmp_path / "f")
    assert sorted(want) == sorted(got) == list(range(1, 21))
    worst = max(abs(want[s] - got[s]) for s in want)
    assert worst <= LOSS_ATOL, (worst, want, got)

    # The checkpoints are the same files: the adapter only, gathered on rank 0, same keys and shapes,
    # optimizer state in DDP's layout (no FSDP files).
    from safetensors.torch import load_file

    a, b = (load_file(str(tmp_path / r / "checkpoint-20" / "adapter_model.safetensors")) for r in ("ddp", "f"))
    assert a.keys() == b.keys() and len(a) == 28 and all(a[k].shape == b[k].shape for k in a)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
    files = {p.name for p in (tmp_path / "f" / "checkpoint-20").iterdir()}
    assert {"optimizer.pt", "scheduler.pt", "adapter_model.safetensors"} <= files
    assert not any("fsdp" in n for n in files) and "optimizer.bin" not in files

    # Resume DDP -> F -> DDP at the same global batch: killed after step 5 (DDP) and step 10 (F).
    crashed = train(tmp_path, tiny_model, "chain", "B", env={"TUNELEDGER_CRASH_AFTER_STEP": "5"})
    assert crashed.returncode != 0 and (tmp_path / "chain" / "checkpoint-5").is_dir()
    as_f = train(tmp_path, tiny_model, "chain", "F", env={"TUNELEDGER_CRASH_AFTER_STEP": "10"})
    assert as_f.returncode != 0 and (tmp_path / "chain" / "checkpoint-10").is_dir(), as_f.stderr[-3000:]
    assert "checkpoint-5" in as_f.stdout + as_f.stderr
    back = train(tmp_path, tiny_model, "chain", "B")
    assert back.returncode == 0, back.stdout[-3000:] + back.stderr[-3000:]
    assert "checkpoint-10" in back.stdout + back.stderr
    chain = losses(tmp_path / "chain")
    assert sorted(chain) == list(range(1, 21))
    worst = max(abs(want[s] - chain[s]) for s in want)
    assert worst <= LOSS_ATOL, (worst, want, chain)

    # export reads F's checkpoint unchanged, in the trainer's own venv (as `make export` runs it).
    if TRAINER_PY.is_file():
        p = tl("export", str(tmp_path / "f"), "--out", str(tmp_path / "export"), python=TRAINER_PY)
        assert p.returncode == 0, p.stderr[-3000:]
        assert (tmp_path / "export" / "config.json").is_file()


def test_the_ledger_puts_ddp_beside_f_per_gpu():
    from tuneledger.sharding import peak_by_world

    # A 7B-like DDP row: 5.5 GiB of 4-bit weights, 40M LoRA parameters, 9 GiB peak on one GPU.
    row = {"memory_mib": [{"peak_allocated": 9 * 1024}], "world_size": 1, "config": {"fsdp": None},
           "model": {"weights_mib": 5.5 * 1024, "layer_mib": 0.18 * 1024, "trainable_params": 40_000_000}}
    f = peak_by_world(row)
    lora = 40e6 * 16 / 2**30
    assert f["ddp_gib"] == pytest.approx(9.0, abs=0.01) and f["activations_gib"] == pytest.approx(9 - 5.5 - lora, abs=0.01)
    assert f["f_gib"][1] == pytest.approx(9.0, abs=0.01)
    assert f["f_gib"][2] == pytest.approx((5.5 + lora) / 2 + (9 - 5.5 - lora) + 2 * 0.18 / 2, abs=0.01)
    assert f["f_gib"][8] < f["f_gib"][4] < f["f_gib"][2] < f["ddp_gib"] and "16 bytes" in f["formula"]
    # measured under F on 2 GPUs: its own sharding is taken back out, so DDP's figure is the same
    f2 = peak_by_world({**row, "world_size": 2, "config": {"fsdp": "full_shard auto_wrap"},
                        "memory_mib": [{"peak_allocated": f["f_gib"][2] * 1024}]})
    assert f2["ddp_gib"] == pytest.approx(9.0, abs=0.02)
    assert peak_by_world({**row, "memory_mib": [{"peak_allocated": None}]}) is None  # a CPU run: no GPU memory


@needs_fsdp2
@pytest.mark.e2e
def test_under_f_the_guards_work_as_under_ddp(tmp_path, tiny_model):
    """The NaN guard, SIGTERM's save, the run lock and a resume after it, as test_faults_e2e runs
    them under DDP, with preset F (micro-batch 1: 8 records, global batch 2 on 2 ranks)."""
    from test_faults_e2e import args, logged, sigterm_mid_run
    from test_faults_e2e import tl as tl_faults

    data = tmp_path / "d.jsonl"
    data.write_text("".join((ROOT / "src/tuneledger/data/demo.jsonl").read_text().splitlines(keepends=True)[:8]))
    f = ("preset=F", "per_device_train_batch_size=1", "report_to=none", "plot_loss=false")

    nan = tmp_path / "nan"
    p = tl_faults(*args(tiny_model, data, nan, *f, "learning_rate=1e30", "max_steps=8", "logging_steps=5"))
    assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-3000:]
    assert "at step 4 (finite until step 2)" in p.stderr and "that step not saved" in p.stderr
    assert sorted(c.name for c in nan.glob("checkpoint-*")) == ["checkpoint-2"]

    run = tmp_path / "run"
    ckpt = sigterm_mid_run(tmp_path, tiny_model, data, run, *f)
    ckpts = [ckpt]
    step = int(ckpts[0].name.split("-")[1])
    # resumed under DDP (preset B at the same global batch): the settings that matter are the same
    resumed = tl_faults(*args(tiny_model, data, run, "preset=B", "per_device_train_batch_size=1", "report_to=none",
                              "plot_loss=false", f"max_steps={step + 1}", "save_steps=100"))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resuming from {ckpts[0]}" in resumed.stdout
    assert [h["step"] for h in logged(run / f"checkpoint-{step + 1}")] == list(range(1, step + 2))
    # a resume that changes what the checkpoint was trained with is refused, under F as under DDP
    changed = tl_faults(*args(tiny_model, data, run, *f, "lora_rank=8", f"max_steps={step + 2}"))
    assert changed.returncode != 0 and "lora_rank" in changed.stderr, changed.stderr[-2000:]
