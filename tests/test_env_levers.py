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
    for name in [*env_levers.CHOICES, "TUNELEDGER_PROFILE_STEP"]:
        assert name in names, f"{name} is not in docker-compose.yml's x-environment"
        assert name in env, f"{name} should pass through as a bare name (only when set in the shell), not a default"
