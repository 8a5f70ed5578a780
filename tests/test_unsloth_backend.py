"""use_unsloth (unsloth_backend.py): refused with the reason where it cannot run, Unsloth imported
before transformers in a rank, and the model loaded through FastLanguageModel with the config's
LoRA settings. Unsloth itself needs a CUDA GPU, so these run on a stand-in
(tests/fixtures/fake_unsloth); `make bench`'s `Cunsl` row runs the real one on the device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tuneledger import unsloth_backend
from tuneledger.config_load import load_config

FAKE = Path(__file__).parent / "fixtures" / "fake_unsloth"
SRC = Path(__file__).resolve().parents[1] / "src"


def _cfg(**over):
    return load_config(None, {"model_name_or_path": "m", "dataset": ["x.json"], "use_unsloth": True, **over})


@pytest.fixture
def fake_unsloth(monkeypatch):
    monkeypatch.syspath_prepend(str(FAKE))
    yield
    sys.modules.pop("unsloth", None)


def test_not_installed_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(unsloth_backend.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="use_unsloth: true, but unsloth is not installed.*pip install unsloth"):
        unsloth_backend.check(_cfg(), "cuda")
    unsloth_backend.check(_cfg(use_unsloth=False), "cuda")  # off: nothing to check
    # no GPU and no Unsloth: both said at once, so that fixing one does not lead to the other
    with pytest.raises(ValueError, match="needs a CUDA GPU.*and unsloth is not installed here.*set use_unsloth=false"):
        unsloth_backend.check(_cfg(), "cpu")


@pytest.mark.parametrize("over, device, says", [
    ({}, "cpu", "needs a CUDA GPU"),
    ({"preset": "F"}, "cuda", "preset F"),
    ({"packing": True}, "cuda", "set packing=false"),
    ({"fused_lora": True}, "cuda", "fused_lora is set to true"),
    ({"quantization_bit": 4, "quantization_type": "fp4"}, "cuda", "NF4 with double quantization only"),
    ({"quantization_bit": 4, "double_quantization": False}, "cuda", "NF4 with double quantization only"),
    ({"flash_attn": "sdpa"}, "cuda", "picks its own attention"),
    ({"grouped_lora": True, "torch_compile": True, "lora_dropout": 0}, "cuda", "grouped_lora, torch_compile are set"),
])
def test_what_cannot_run_beside_it_is_refused(fake_unsloth, over, device, says):
    with pytest.raises(ValueError, match=says):
        unsloth_backend.check(_cfg(**over), device)


def test_each_resolved_preset_is_checked(fake_unsloth):
    """The base config passes; preset D packs and F shards, which only the resolved preset shows."""
    from tuneledger.dryrun import plan

    rows = dict(plan(["model_name_or_path=m", "dataset=x.json", "use_unsloth=true"], ["C", "D", "F"], 1, "cuda"))
    assert rows["C"].use_unsloth
    assert "preset D: use_unsloth: true runs padded" in str(rows["D"])
    assert "preset F: use_unsloth: true cannot run as preset F" in str(rows["F"])


def test_llamafactory_key_is_taken_not_refused(tmp_path):
    y = tmp_path / "lf.yaml"
    y.write_text("model_name_or_path: m\ndataset: x.json\nstage: sft\nfinetuning_type: lora\nuse_unsloth: true\n")
    assert load_config(y, {}).use_unsloth is True


def _import_order(env_value: str | None) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE), str(SRC)])}
    env.pop(unsloth_backend.ENV, None)
    if env_value:
        env[unsloth_backend.ENV] = env_value
    code = ("import sys, tuneledger.worker; m = sys.modules.get('unsloth'); "
            "print('absent' if m is None else m.IMPORTED_BEFORE_TRANSFORMERS)")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                          timeout=300).stdout.strip().splitlines()[-1]


def test_rank_imports_unsloth_first_only_when_asked():
    assert _import_order("1") == "True"
    assert _import_order(None) == "absent"


def test_load_model_goes_through_fastlanguagemodel(fake_unsloth, tiny_model):
    import torch

    from tuneledger.model import load_model

    cfg = load_config(None, {"model_name_or_path": str(tiny_model), "dataset": ["x.json"], "use_unsloth": True,
                             "quantization_bit": None, "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.0,
                             "gradient_checkpointing": True, "seed": 5, "bf16": False})
    model, info = load_model(cfg, "cpu")
    import unsloth

    assert unsloth.CALLS["from_pretrained"]["model_name"] == str(tiny_model)
    assert unsloth.CALLS["from_pretrained"]["load_in_4bit"] is False
    assert unsloth.CALLS["from_pretrained"]["use_exact_model_name"] is True  # never a pre-quantized stand-in
    assert unsloth.CALLS["for_training"] == "unsloth"
    assert unsloth.CALLS["get_peft_model"] == dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=unsloth_backend.TARGETS,
                                                   use_gradient_checkpointing="unsloth", random_state=5)
    assert info["levers"]["unsloth"].startswith("on (Unsloth 0.0-fake") and "its own gradient checkpointing" in info["levers"]["unsloth"]
    assert info["levers"]["fused_lora"] == "off (use_unsloth)"
    assert info["trainable_params"] > 0 and info["layer_classes"]
    x = torch.randint(0, 100, (1, 16))
    model(input_ids=x, labels=x).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)
    # use_unsloth_gc beside it (a LLaMA-Factory config sets both): Unsloth's checkpointing does it, said
    assert "use_unsloth_gc" not in info["levers"]
    info = load_model(cfg.model_copy(update={"use_unsloth_gc": True}), "cpu")[1]
    assert info["levers"]["use_unsloth_gc"].startswith("on (Unsloth's own checkpointing")
