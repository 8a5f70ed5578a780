"""The A/B environment variables (env_levers.py): a value none of them reads is one sentence and
exit 2 from dryrun, train and tune before any rank or candidate starts; an empty value is unset."""

import subprocess
import sys
from pathlib import Path

import pytest

from tuneledger import env_levers
from tuneledger.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", list(env_levers.CHOICES))
def test_each_variable_takes_its_values_or_empty_and_refuses_the_rest(monkeypatch, name):
    for v in env_levers.CHOICES:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.delenv("TUNELEDGER_PROFILE_STEP", raising=False)
    for ok in ("", "  ", *env_levers.CHOICES[name][0]):
        monkeypatch.setenv(name, ok)
        env_levers.check()
    monkeypatch.setenv(name, "bogus")
    with pytest.raises(ConfigError, match=rf"^{name}='bogus': use .*, or unset it$"):
        env_levers.check()


def test_empty_is_the_default(monkeypatch):
    monkeypatch.setenv("TUNELEDGER_ADDMM", " ")
    assert env_levers.value("TUNELEDGER_ADDMM") == ""
    monkeypatch.setenv("TUNELEDGER_PROFILE_STEP", "abc")  # the profile step is checked with them
    with pytest.raises(ConfigError, match="TUNELEDGER_PROFILE_STEP='abc'"):
        env_levers.check()
    monkeypatch.delenv("TUNELEDGER_PROFILE_STEP")
    monkeypatch.setenv("TUNELEDGER_MEMORY_STEP", "0")  # and the memory step, with what it is for
    with pytest.raises(ConfigError, match="TUNELEDGER_MEMORY_STEP='0': not a step number.*peak memory"):
        env_levers.check()


@pytest.mark.parametrize("verb", [["dryrun"], ["train"], ["tune", "--budget", "1m"]])
def test_every_launcher_refuses_a_bad_value_before_any_rank(tmp_path, verb):
    """Exit 2 with one sentence, no rank traceback (found by a trial: 8 tracebacks and 1 min 14 s
    for TUNELEDGER_ADDMM=bogus on the tiny dry-run; tune exited 1 after every candidate failed)."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"instruction": "hi", "output": "hello"}\n')
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TUNELEDGER_ADDMM": "bogus", "PYTHONPATH": str(ROOT / "src")}
    p = subprocess.run([sys.executable, "-m", "tuneledger", verb[0], str(ROOT / "configs" / "tiny.yaml"), *verb[1:],
                        f"model_name_or_path={model}", f"dataset={data}", f"output_dir={tmp_path / 'run'}", "--cpu"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert "TUNELEDGER_ADDMM='bogus': use inplace or copy" in p.stderr and "Traceback" not in p.stderr


def test_the_container_passes_every_variable_through():
    """`make dryrun` in the image runs through docker compose, which passes only the variables its
    environment lists: each A/B variable and the profile step must be there (a trial found
    TUNELEDGER_ADDMM=copy silently ignored in the container)."""
    import yaml

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    env = compose["x-environment"]
    names = {e.split("=", 1)[0] for e in env}
    for name in [*env_levers.CHOICES, "TUNELEDGER_PROFILE_STEP", "TUNELEDGER_MEMORY_STEP"]:
        assert name in names, f"{name} is not in docker-compose.yml's x-environment"
        assert name in env, f"{name} should pass through as a bare name (only when set in the shell), not a default"


def test_the_sync_debug_step_is_a_step_number(monkeypatch):
    """A trial: TUNELEDGER_SYNC_DEBUG=yes passed every check, then every rank on a GPU would have
    raised int()'s ValueError after the model load."""
    for v in env_levers.CHOICES:
        monkeypatch.delenv(v, raising=False)
    for ok in ("", "3", " 12 "):
        monkeypatch.setenv("TUNELEDGER_SYNC_DEBUG", ok)
        env_levers.check()
    for bad in ("yes", "0", "-1", "2.5", "\u00b2"):  # "²": str.isdigit says yes, int() says no
        monkeypatch.setenv("TUNELEDGER_SYNC_DEBUG", bad)
        with pytest.raises(ConfigError, match=rf"^TUNELEDGER_SYNC_DEBUG='{bad}': not a step number"):
            env_levers.check()


def test_a_misspelt_variable_is_warned_of_with_the_name_it_is_closest_to(monkeypatch, capsys):
    for n in [n for n in list(__import__("os").environ) if n.startswith("TUNELEDGER_")]:
        monkeypatch.delenv(n)
    monkeypatch.setenv("TUNELEDGER_TRAINWALK", "every")
    monkeypatch.setenv("TUNELEDGER_ZZZ", "1")
    monkeypatch.setenv("TUNELEGDER_CUDAGRAPHS", "1")  # a misspelt prefix
    monkeypatch.setenv("TUNE_X", "1")  # not ours
    env_levers.check()
    err = capsys.readouterr().err
    assert "warning: TUNELEGDER_CUDAGRAPHS is not a variable tuneledger reads, so it changes nothing " \
           "(did you mean TUNELEDGER_CUDAGRAPHS?)" in err and "TUNE_X" not in err
    monkeypatch.delenv("TUNELEGDER_CUDAGRAPHS")
    assert "warning: TUNELEDGER_TRAINWALK is not a variable tuneledger reads, so it changes nothing " \
           "(did you mean TUNELEDGER_TRAIN_WALK?)" in err
    assert "TUNELEDGER_ZZZ is not a variable tuneledger reads" in err and "the A/B variables: TUNELEDGER_ADDMM" in err
    monkeypatch.delenv("TUNELEDGER_TRAINWALK")
    monkeypatch.delenv("TUNELEDGER_ZZZ")
    monkeypatch.setenv("TUNELEDGER_TRAIN_WALK", "every")
    monkeypatch.setenv("TUNELEDGER_ADDMM", "copy")
    env_levers.check()
    assert capsys.readouterr().err == ""
    assert env_levers.active() == "TUNELEDGER_ADDMM=copy, TUNELEDGER_TRAIN_WALK=every"
    monkeypatch.setenv("TUNELEDGER_ZZZ", "1")  # said even when a refusal follows
    monkeypatch.setenv("TUNELEDGER_SYNC_DEBUG", "x")
    with pytest.raises(ConfigError, match="TUNELEDGER_SYNC_DEBUG='x'"):
        env_levers.check()
    assert "TUNELEDGER_ZZZ is not a variable" in capsys.readouterr().err


def test_every_tuneledger_variable_the_project_names_is_known():
    """A variable read somewhere but missing from CHOICES/OTHERS would be warned of as misspelt."""
    import re

    names = set()
    for path in [*ROOT.glob("src/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("docker/*"), ROOT / "Makefile",
                 ROOT / "docker-compose.yml", *ROOT.glob(".ci/*"), *ROOT.glob("bench/*.sh"), *ROOT.glob("deploy/**/*")]:
        if path.is_file():
            names |= set(re.findall(r"TUNELEDGER_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="replace")))
    made_up = {"TUNELEDGER_TRAINWALK", "TUNELEDGER_ZZZ"}  # this file's misspellings
    assert names - made_up - set(env_levers.CHOICES) - set(env_levers.OTHERS) == set()


def test_the_ledger_records_the_a_b_variables_a_run_had(tiny_model, monkeypatch):
    """A trial: TUNELEDGER_TRAIN_WALK=every left train.json and the levers line as without it."""
    from tuneledger import compiled
    from tuneledger.config_load import load_config
    from tuneledger.model import load_model

    for n in env_levers.CHOICES:
        monkeypatch.delenv(n, raising=False)
    monkeypatch.setattr("tuneledger.compiled._GRAPHS", [False])
    cfg = load_config(None, {"model_name_or_path": str(tiny_model), "dataset": ["x.json"], "lora_rank": 4})
    assert "env" not in load_model(cfg, "cpu")[1]["levers"]
    monkeypatch.setenv("TUNELEDGER_TRAIN_WALK", "every")
    monkeypatch.setenv("TUNELEDGER_CUDAGRAPHS", "1")
    levers = load_model(cfg, "cpu")[1]["levers"]
    assert levers["env"] == ("TUNELEDGER_TRAIN_WALK=every, TUNELEDGER_CUDAGRAPHS=1 (TUNELEDGER_CUDAGRAPHS: no effect, "
                             "no layers compiled on a CUDA GPU)"), levers
    assert not compiled.cudagraphs_on()
    monkeypatch.delenv("TUNELEDGER_CUDAGRAPHS")
    monkeypatch.setenv("TUNELEDGER_GUARDS", "dict-tags")  # guards of compiled layers: none compiled on a CPU
    levers = load_model(cfg, "cpu")[1]["levers"]
    assert levers["env"] == ("TUNELEDGER_TRAIN_WALK=every, TUNELEDGER_GUARDS=dict-tags (TUNELEDGER_GUARDS: no effect, "
                             "no layers compiled)"), levers
