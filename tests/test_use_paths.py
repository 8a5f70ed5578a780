"""Where export, chat and eval look for the run they are given: a name under runs/ or a path."""

from __future__ import annotations

import pytest

from tuneledger.checkpoints import LoadError
from tuneledger.cli import build_parser
from tuneledger.config import ConfigError
from tuneledger.loading import run_dir
from tuneledger.usecfg import resolve_use


def test_a_run_name_is_a_folder_under_runs_and_a_path_is_itself(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "t1").mkdir(parents=True)
    assert run_dir("t1") == tmp_path.joinpath("runs", "t1").relative_to(tmp_path)
    with pytest.raises(LoadError, match=r"no run 'nope': neither nope nor runs/nope exists"):
        run_dir("nope")
    with pytest.raises(LoadError, match=r"^no run at runs/nope: it does not exist$"):  # never runs/runs/nope
        run_dir("runs/nope")


def test_export_takes_a_run_name_as_chat_and_eval_do(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "t1").mkdir(parents=True)
    args = build_parser().parse_args(["export", "t1"])
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert "runs/t1" in err and "t1 does not exist" not in err  # found the run; it has no checkpoint yet


def test_a_wrong_adapter_path_in_a_merge_yaml_names_the_file_line_and_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "merge.yaml"
    cfg.write_text("model_name_or_path: models/base\nadapter_name_or_path: saves/nope\ntemplate: qwen\n")
    for verb in ("export", "chat", "eval"):
        with pytest.raises(ConfigError, match=r"merge.yaml:2: adapter_name_or_path: saves/nope does not exist; point adapter_name_or_path at a run folder"):
            resolve_use(verb, [str(cfg)])


def test_a_training_config_whose_run_is_not_trained_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "sft.yaml"
    cfg.write_text("model_name_or_path: models/base\ndataset: data.json\noutput_dir: saves/qwen-sft\n")
    with pytest.raises(ConfigError, match=r"sft.yaml:3: output_dir: saves/qwen-sft does not exist; this config's run has not been trained"):
        resolve_use("chat", [str(cfg)])


@pytest.mark.parametrize("verb", ["export", "chat", "eval"])
def test_a_run_that_is_not_there_is_bad_input_in_either_spelling(verb, tmp_path, monkeypatch, capsys):
    """A fresh tester: `export nosuchrun` exited 1 while the same adapter named in a merge yaml
    exited 2. A thing named that is not there is bad input (2) however it is named."""
    from tuneledger import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "merge.yaml").write_text("model_name_or_path: models/base\nadapter_name_or_path: saves/nope\n")
    (tmp_path / "d.jsonl").write_text('{"instruction": "q", "output": "a"}\n')
    what = ["--dataset", "d.jsonl"] if verb == "eval" else []  # eval asks what to score first
    assert cli.main([verb, "nosuchrun", *what]) == 2
    assert "no run 'nosuchrun': neither nosuchrun nor runs/nosuchrun exists" in capsys.readouterr().err
    assert cli.main([verb, "merge.yaml", *what]) == 2
    assert "merge.yaml:2: adapter_name_or_path: saves/nope does not exist" in capsys.readouterr().err
