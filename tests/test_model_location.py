"""A model that is not there is said so at once, by every verb, and a failed start leaves nothing behind."""

import json
import socket

import pytest

from tuneledger import cli
from tuneledger.model import PreflightError, hub_offline, locate_model, looks_like_path

VERBS = ["stats", "preflight", "dryrun", "train"]


@pytest.fixture
def no_hub(monkeypatch):
    """Any attempt to reach a hub fails the test: the answer must come from the local check."""
    import huggingface_hub
    import transformers

    def refuse(*a, **kw):
        raise AssertionError(f"the hub was asked for {a[:1]}")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "data.jsonl").write_text(json.dumps({"instruction": "hi", "output": "hello"}) + "\n")
    (tmp_path / "job.yaml").write_text("model_name_or_path: Qwen/Qwen2.5-7B-Instruct\ndataset: data.jsonl\n"
                                       "quantization_bit: null\nrun_name: r\n")
    return tmp_path


@pytest.mark.parametrize("name", ["./m", "/nonexistent/m", "~/no-such-model-here", "models/Qwen2.5-7B-Instruct", "a/b/c"])
def test_path_like_names(name, workdir):
    assert looks_like_path(name)


@pytest.mark.parametrize("name", ["Qwen/Qwen2.5-7B-Instruct", "gpt2"])
def test_hub_ids_are_not_paths(name, workdir):
    assert not looks_like_path(name)


@pytest.mark.parametrize("verb", VERBS)
def test_missing_local_model_is_named_by_every_verb(verb, workdir, no_hub, capsys):
    rc = cli.main([verb, "job.yaml", "model_name_or_path=models/Qwen2.5-7B-Instruct", *(["--cpu"] if verb != "stats" else [])])
    out = capsys.readouterr()
    text = out.out + out.err
    assert rc == 2  # bad input, as a dataset file that is not there (issue 21 (7): one code for bad input)
    assert "models/Qwen2.5-7B-Instruct: no such directory" in text and "make fetch MODEL=" in text
    assert "Traceback" not in text
    assert not (workdir / "runs" / "r").exists()  # a failed start leaves no empty run directory


@pytest.mark.parametrize("verb", VERBS)
def test_hub_id_offline_is_named_by_every_verb(verb, workdir, no_hub, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc = cli.main([verb, "job.yaml", *(["--cpu"] if verb != "stats" else [])])
    text = "".join(capsys.readouterr())
    assert rc == 2
    assert "the hub is offline (HF_HUB_OFFLINE=1)" in text
    assert "make fetch MODEL=Qwen/Qwen2.5-7B-Instruct" in text and "models/Qwen2.5-7B-Instruct" in text


def test_export_names_a_missing_base(workdir, no_hub, capsys):
    ckpt = workdir / "runs" / "r" / "checkpoint-2"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    (ckpt / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "models/gone"}))
    assert cli.main(["export", "--adapter", str(ckpt)]) == 2
    assert "models/gone: no such directory" in capsys.readouterr().err


def test_unreachable_endpoint_counts_as_offline(monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    assert "unreachable" in hub_offline()
    with pytest.raises(PreflightError, match="no such directory, and the hub is offline"):
        locate_model("some-org/some-model")


def test_a_file_is_not_a_model(tmp_path):
    (tmp_path / "model.safetensors").write_text("")
    with pytest.raises(PreflightError, match="is a file, not a model directory"):
        locate_model(str(tmp_path / "model.safetensors"))


def test_home_is_expanded_in_the_config():
    from pathlib import Path

    from tuneledger.config_load import load_config

    cfg = load_config(None, {"model_name_or_path": "~/models/x", "dataset": ["d.json"]})
    assert cfg.model_name_or_path == str(Path.home() / "models" / "x")


def test_nproc_beyond_the_visible_gpus_is_refused_naming_both(workdir, monkeypatch, capsys):
    import tuneledger.launch as launch
    from tuneledger.config import ConfigError

    monkeypatch.setattr(launch, "visible_gpus", lambda: 2)
    with pytest.raises(ConfigError, match="NPROC=8 processes asked for, but 2 GPU"):
        launch.processes(False, 8)
    assert launch.processes(False, 2) == (False, 2) and launch.processes(True, 8) == (True, 8)
    for verb in ("dryrun", "train"):
        assert cli.main([verb, "job.yaml", "model_name_or_path=models", "--nproc", "8"]) == 2
        assert "NPROC=8 processes asked for, but 2 GPUs are visible" in capsys.readouterr().err
    assert not (workdir / "runs").exists()


def test_a_synthetic_model_is_known_by_its_config_alone(tiny_model, tmp_path):
    """The dry-run's ledger marks SYNTHETIC weights from a preset's row, and, when no preset finished
    (stopped early), from the model's config.json (found by a trial: such a ledger said nothing)."""
    from tuneledger.model_location import synthetic_model

    assert synthetic_model(str(tiny_model)) is True
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text('{"model_type": "qwen2"}')
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert synthetic_model(str(plain)) is synthetic_model(str(broken)) is synthetic_model("Qwen/Qwen2.5-7B-Instruct") is False
