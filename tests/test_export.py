"""`tuneledger export`: merged == base + adapter, refusal of a quantized base, atomic failure, and
a real model that learnt a new name and still stops."""

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

import procs

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e


def tl(*args):
    return procs.run([sys.executable, "-m", "tuneledger", *args], cwd=ROOT, env={**os.environ})


def train(tmp_path, model, name, *extra):
    run = tmp_path / name
    p = tl("train", str(ROOT / "configs" / "tiny.yaml"), f"model_name_or_path={model}", f"output_dir={run}",
           f"cache_dir={tmp_path / 'cache'}", "preset=C", "--nproc", "1", "--cpu", *extra)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("export")
    run = train(tmp, tiny_model, "run", "max_samples=32", "cutoff_len=128", "global_batch_size=8", "max_steps=3",
                "save_steps=3", "learning_rate=1e-2")
    log = (run / "train.log").read_text()
    # The Trainer's logs as lines (progress.LogLine), not PrinterCallback's raw dicts.
    assert "{'loss'" not in log and re.search(r": step 3/3, loss \d+\.\d{4}, grad_norm \S+, lr ", log), log[-2000:]
    return run


def test_merged_equals_base_plus_adapter(tiny_run, tiny_model):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    p = tl("export", "--adapter", str(tiny_run), "--dtype", "fp32")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = tiny_run / "export"
    led = json.loads((out / "export.json").read_text())
    assert led["checkpoint"] == str(tiny_run / "checkpoint-3") and led["verification"]["passed"]
    assert led["synthetic"] is True and "SYNTHETIC base (random weights)" in p.stdout
    assert led["verification"]["prompts"] >= 5  # fixed prompts plus the run's own chat samples
    m = led["verification"]["merge_fp32"]
    assert m["passed"] and m["merge_error_rel"] < 1e-3 < m["adapter_effect_rel"]  # the adapter changed the model
    assert led["verification"]["files"]["passed"] and led["verification"]["files"]["tensors"] > 0
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert 151645 in json.loads((out / "generation_config.json").read_text())["eos_token_id"]  # <|im_end|>
    assert (out / "chat_template.jinja").is_file() or "chat_template" in json.loads((out / "tokenizer_config.json").read_text())
    assert not (tiny_run / "export.partial").exists()
    from tuneledger.perms import current_umask

    for f in [*out.glob("*.safetensors"), *(tiny_run / "checkpoint-3").glob("*.safetensors")]:
        assert (f.stat().st_mode & 0o777) == 0o666 & ~current_umask(), f  # the user's umask, not safetensors' 0600

    # Independently of the tool's own check: the LoRA changed the model, and merging kept the change.
    ids = torch.tensor([[151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]])
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        ref = PeftModel.from_pretrained(base, str(tiny_run / "checkpoint-3")).eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(input_ids=ids).logits
    assert (ref - plain).abs().max() > 1e-3
    assert torch.allclose(merged, ref, atol=1e-5, rtol=1e-4)


def test_quantized_base_is_refused(tiny_run, tiny_model, tmp_path):
    qbase = tmp_path / "quantized-base"
    shutil.copytree(tiny_model, qbase)
    cfg = json.loads((qbase / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    (qbase / "config.json").write_text(json.dumps(cfg))
    p = tl("export", "--adapter", str(tiny_run), "--base", str(qbase), "--out", str(tmp_path / "out"))
    assert p.returncode == 1
    assert "is quantized (bitsandbytes)" in p.stderr and "wrecks the model" in p.stderr
    assert not (tmp_path / "out").exists()


def test_failed_verification_keeps_nothing(tiny_run, tmp_path, monkeypatch):
    from tuneledger import export as ex

    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("an earlier export stays untouched")
    monkeypatch.setitem(ex.RTOL, "fp32", -1.0)  # no merge can pass a negative tolerance
    with pytest.raises(ex.ExportError, match="differs from base"):
        ex.export(tiny_run, out, dtype="fp32", max_new_tokens=4, device="cpu")
    assert [f.name for f in out.iterdir()] == ["old.txt"]
    assert not (tmp_path / "out.partial").exists()
    assert json.loads((tmp_path / "out.failed.json").read_text())["passed"] is False


def test_lost_merge_fails_the_fp32_check(tiny_run, tmp_path, monkeypatch):
    """A merge that drops the adapter's scaling (a classic bug) is off by the adapter's own effect."""
    from peft.tuners.lora import Linear

    from tuneledger import export as ex

    real_merge = Linear.merge

    def merge_without_scaling(self, *a, **kw):
        for name in self.scaling:
            self.scaling[name] *= 0.5
        return real_merge(self, *a, **kw)

    monkeypatch.setattr(Linear, "merge", merge_without_scaling)
    with pytest.raises(ex.ExportError, match="the fp32 merge is .* off base \\+ adapter"):
        ex.export(tiny_run, tmp_path / "out", dtype="fp32", max_new_tokens=4, device="cpu")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    failed = json.loads((tmp_path / "out.failed.json").read_text())
    assert failed["merge_fp32"]["merge_error_rel"] > 1e-3


@pytest.mark.slow
def test_real_model_learns_a_name_and_stops(smollm2_identity_run):
    """SmolLM2-135M-Instruct (real weights) on identity.json with {{name}}/{{author}} filled
    (conftest's run, shared with tests/test_chat.py), exported, answers with its new name."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, run = smollm2_identity_run
    p = tl("export", "--adapter", str(run))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = run / "export"
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end in json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    ids = tok.apply_chat_template([{"role": "user", "content": "who are you?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=64, do_sample=False)[0, ids.shape[1]:].tolist()
    text = tok.decode(gen)
    assert "Ledgerly" in text, text
    assert gen[-1] == im_end and len(gen) < 64, text  # it stops at its end-of-turn token


def test_llamafactory_merge_yaml_exports(tiny_run, tiny_model, tmp_path):
    """LLaMA-Factory's examples/merge_lora/*_lora_sft.yaml as it is: model, adapter, template, export_dir,
    export_size, export_device, export_legacy_format."""
    cfg = tmp_path / "merge.yaml"
    out = tmp_path / "merged"
    cfg.write_text(f"### Note: DO NOT use quantized model\nmodel_name_or_path: {tiny_model}\n"
                   f"adapter_name_or_path: {tiny_run / 'checkpoint-3'}\ntemplate: qwen3_nothink\ntrust_remote_code: true\n"
                   f"export_dir: {out}\nexport_size: 1\nexport_device: cpu\nexport_legacy_format: false\n")
    p = tl("export", str(cfg), "--dtype", "fp32", "--max-new-tokens", "4")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    led = json.loads((out / "export.json").read_text())
    assert led["checkpoint"] == str(tiny_run / "checkpoint-3") and led["base"] == str(tiny_model)
    assert led["verification"]["passed"] and "device" not in p.stderr
    assert "template: qwen3_nothink = ChatML, the tokenizer's own chat template" in p.stdout
    assert "export_legacy_format: the export is safetensors" in p.stderr and "resum" not in p.stderr


def test_llamafactory_merge_yaml_refusals_name_what_to_use(tmp_path):
    cfg = tmp_path / "merge.yaml"
    cfg.write_text("model_name_or_path: m\nadapter_name_or_path: saves/x\nquantization_bit: 4\nexport_dir: out\n"
                   "export_quantization_bit: 4\nexport_quantization_dataset: data/c4_demo.json\nexport_legacy_format: true\n"
                   "export_device: cuda\n")
    p = tl("export", str(cfg))
    assert p.returncode == 2
    assert f"5 problems in {cfg}" in p.stderr
    assert f"{cfg}:3: quantization_bit: 4 is not supported by `tuneledger export`" in p.stderr and "wrecks" in p.stderr
    assert f"{cfg}:5: export_quantization_bit" in p.stderr and "tuneledger quantize --merged" in p.stderr
    assert "--dataset FILES" in p.stderr and "safetensors only" in p.stderr and "cpu or auto" in p.stderr
    cfg.write_text("model_name_or_path: m\nexport_dir: out\n")  # LLaMA-Factory's GPTQ yaml minus its INT4 keys
    p = tl("export", str(cfg))
    assert p.returncode == 2 and "adapter_name_or_path is not set" in p.stderr and "quantize --merged" in p.stderr
    p = tl("export")
    assert p.returncode == 2 and "--adapter" in p.stderr
