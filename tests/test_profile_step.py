"""TUNELEDGER_PROFILE_STEP as the launcher reads it (profile_step.py): a bad value is one sentence
and exit 2 before any rank starts; a step the run never reaches, and a profiled step among a
dry-run's measured steps, are said."""

import subprocess
import sys
from pathlib import Path

import pytest

from tuneledger import profile_step
from tuneledger.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("raw", ["three", "0", "-2", "1.5", "2e3x"])
def test_a_bad_value_is_refused_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv(profile_step.ENV, raw)
    with pytest.raises(ConfigError, match=rf"TUNELEDGER_PROFILE_STEP='{raw}': not a step number"):
        profile_step.requested()


def test_unset_or_a_number(monkeypatch):
    monkeypatch.delenv(profile_step.ENV, raising=False)
    assert profile_step.requested() is None
    monkeypatch.setenv(profile_step.ENV, " 7 ")
    assert profile_step.requested() == 7


def test_notes_say_a_step_past_the_end_and_a_measured_step():
    assert profile_step.notes(None, 10, 2) == []
    assert profile_step.notes(2, 10, 2) == []  # a warm-up step: the measured steps stay clean
    assert "this run makes 3 steps, so no step is profiled (set it to 1-3)" in profile_step.notes(99, 3, 1)[0]
    assert "is one of the measured steps" in profile_step.notes(3, 4, 2)[0]
    assert profile_step.notes(5, 40) == []  # train: no measured steps to spoil


def test_the_memory_step_gets_the_same_notes_and_ledger_key(monkeypatch):
    """TUNELEDGER_MEMORY_STEP: a step past the end and a measured step are said like the profiler's,
    with its own name and cost; on a CPU or with cudaMallocAsync (no allocator history) it slows
    nothing, and why nothing is recorded is said once."""
    env = profile_step.MEMORY_ENV
    assert "TUNELEDGER_MEMORY_STEP=9: this run makes 4 steps, so no step is recorded" in profile_step.notes(9, 4, 1, env)[0]
    measured = profile_step.notes(3, 4, 2, env)[0]
    assert "recording every allocation with its Python stack slows it" in measured and "memory_step" in measured
    monkeypatch.setenv(profile_step.ENV, "2")
    monkeypatch.setenv(env, "3")
    assert profile_step.measured_steps(1, 4) == {"profiled_step": 2, "memory_step": 3}
    assert profile_step.measured_steps(2, 4) == {"memory_step": 3}  # step 2 is a warm-up step there
    assert profile_step.measured_steps(1, 4, cuda=False) == {"profiled_step": 2}
    both = profile_step.all_notes(4, 1)
    assert [n.split("=")[0] for n in both] == ["note: TUNELEDGER_PROFILE_STEP", "note: TUNELEDGER_MEMORY_STEP"]
    on_cpu = profile_step.all_notes(4, 1, cuda=False)  # nothing slowed, and said once here (not per preset)
    assert len(on_cpu) == 2 and on_cpu[1] == "note: TUNELEDGER_MEMORY_STEP=3: no CUDA GPU here, so no allocator history to split"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")  # keeps no history: nothing slowed
    asynchronous = profile_step.all_notes(4, 1)
    assert profile_step.measured_steps(1, 4) == {"profiled_step": 2} and len(asynchronous) == 2
    assert "cudaMallocAsync, which keeps none" in asynchronous[1]
    monkeypatch.setenv(env, "9")  # a step past the end is said too
    assert "cudaMallocAsync" in profile_step.all_notes(4, 1)[-1]
    monkeypatch.setenv(env, "3")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    no_warmup = profile_step.notes(1, 4, 0, env)[0]
    assert "Set dryrun_warmup_steps >= 1 and name step 1" in no_warmup and "<= 0" not in no_warmup
    monkeypatch.setenv(env, "x")
    with pytest.raises(ConfigError, match="TUNELEDGER_MEMORY_STEP='x'"):
        profile_step.all_notes(4, 1)


def test_the_dryrun_refuses_a_bad_value_before_any_rank(tmp_path):
    """Exit 2 with one sentence, no rank traceback (the CLI, a missing model would come later)."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"instruction": "hi", "output": "hello"}\n')
    env = {"PATH": "/usr/bin:/bin", "TUNELEDGER_PROFILE_STEP": "three", "HOME": str(tmp_path)}
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    p = subprocess.run([sys.executable, "-m", "tuneledger", "dryrun", str(ROOT / "configs" / "tiny.yaml"),
                        f"model_name_or_path={model}", f"dataset={data}", f"output_dir={tmp_path / 'run'}", "--cpu"],
                       capture_output=True, text=True, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT / "src")}, timeout=300)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert "TUNELEDGER_PROFILE_STEP='three': not a step number" in p.stderr and "Traceback" not in p.stderr
