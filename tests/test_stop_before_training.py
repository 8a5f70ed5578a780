"""A stop signal that reaches `tuneledger train` before any rank has trained a step (issue 21): one
line on stderr that says so, and the exit code of an interrupted command (128 + the signal: 143 for
SIGTERM, 130 for Ctrl-C), as docs/runs-and-output.md gives it; never a silent death.

Real subprocesses and real signals. The first test holds the launcher in its data preparation (a
stand-in that sleeps, so the signal lands there every time); the second sends SIGTERM to a real
run as soon as torchrun is launched, before its ranks start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import procs

ROOT = Path(__file__).resolve().parents[1]

# `tuneledger train` whose data preparation is a long sleep: the signal comes while it prepares.
HELD_IN_PREPARATION = textwrap.dedent("""
    import sys, time
    import tuneledger.train as train

    def preparing(*args, **kwargs):
        print("PREPARING", flush=True)
        time.sleep(300)

    train.prepare_for_training = preparing
    from tuneledger.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def train_args(tiny_model: Path, run: Path, data: Path) -> list[str]:
    return ["train", str(ROOT / "configs/tiny.yaml"), f"model_name_or_path={tiny_model}", f"dataset={data}",
            f"output_dir={run}", f"cache_dir={run.parent / 'cache'}", "cutoff_len=128", "global_batch_size=2",
            "max_steps=4", "save_steps=100", "--cpu", "--nproc", "2"]


@pytest.fixture()
def data(tmp_path) -> Path:
    out = tmp_path / "d.jsonl"
    lines = (ROOT / "src/tuneledger/data/demo.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    out.write_text("".join(lines[:8]), encoding="utf-8")
    return out


def start(cmd: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def signal_at(proc: subprocess.Popen, marker: str, signum: int, timeout: float = 600) -> tuple[str, str, int]:
    """Send `signum` to `proc` once a stdout line holds `marker`; (stdout, stderr, exit code)."""
    seen = []
    deadline = time.monotonic() + timeout
    try:
        for line in proc.stdout:
            seen.append(line)
            if marker in line:
                proc.send_signal(signum)
                break
            assert time.monotonic() < deadline, f"no {marker!r} line in time"
        else:
            raise AssertionError(f"exited before a {marker!r} line: {''.join(seen)[-3000:]}")
        out, err = proc.communicate(timeout=timeout)
        return "".join(seen) + out, err, proc.returncode
    finally:
        if proc.poll() is None:
            procs.kill_tree(proc.pid)


def the_line(err: str) -> str:
    """The stop line, which must be there exactly once and be stderr's last line."""
    lines = [ln for ln in err.splitlines() if "before training began" in ln]
    assert len(lines) == 1, err[-3000:]
    assert err.strip().splitlines()[-1] == lines[0], err[-3000:]
    return lines[0]


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_a_signal_while_preparing_says_nothing_was_trained(tmp_path, tiny_model, data, signum, code):
    run = tmp_path / "run"
    proc = start([sys.executable, "-c", HELD_IN_PREPARATION, *train_args(tiny_model, run, data)])
    out, err, rc = signal_at(proc, "PREPARING", signum)
    assert rc == code, out[-2000:] + err[-3000:]
    name = signal.Signals(signum).name
    assert the_line(err) == (f"tuneledger train: stopped by {name} before training began, while preparing the checks, "
                             "the data and the run folder: nothing was trained and no checkpoint was saved; the same "
                             "command starts it.")
    assert "Traceback" not in err and not list(run.glob("checkpoint-*"))


def test_a_signal_while_preparing_a_resume_names_the_checkpoint_it_resumes_from(tmp_path, tiny_model, data):
    from test_faults import fake_checkpoint

    run = tmp_path / "run"
    run.mkdir()
    fake_checkpoint(run, 2)
    proc = start([sys.executable, "-c", HELD_IN_PREPARATION, *train_args(tiny_model, run, data)])
    out, err, rc = signal_at(proc, "PREPARING", signal.SIGTERM)
    assert rc == 143, out[-2000:] + err[-3000:]
    assert the_line(err).endswith("nothing was trained and no checkpoint was saved; the same command resumes from "
                                  "checkpoint-2.")


@pytest.mark.e2e
@pytest.mark.slow
def test_sigterm_as_torchrun_starts_reaches_the_ranks_and_is_said(tmp_path, tiny_model, data):
    """SIGTERM as soon as the launcher says `launch:`: torchrun is still starting (or its ranks are);
    before this fix the signal found no rank to pass on to and the run trained to its end."""
    run = tmp_path / "run"
    proc = start([sys.executable, "-m", "tuneledger", *train_args(tiny_model, run, data)])
    out, err, rc = signal_at(proc, "launch:", signal.SIGTERM)
    assert rc == 143, out[-3000:] + err[-3000:]
    line = the_line(err)
    assert line.startswith("tuneledger train: stopped by SIGTERM before training began, while ")
    assert line.endswith(": nothing was trained and no checkpoint was saved; the same command starts it.")
    assert "step 1/4" not in out and not list(run.glob("checkpoint-*")) and not (run / "train.json").exists()
    assert "worker error" not in err  # the ranks died of the SIGTERM passed on to them, not of an error
    assert "SignalException" not in out + err  # torchrun's own traceback: one launch: line (StopTraceback)


HELD_IN_DRYRUN_PREPARATION = HELD_IN_PREPARATION.replace("tuneledger.train as train", "tuneledger.dryrun as train")


def test_a_signal_while_the_dryrun_prepares_says_nothing_was_measured(tmp_path, tiny_model, data):
    run = tmp_path / "run"
    proc = start([sys.executable, "-c", HELD_IN_DRYRUN_PREPARATION, "dryrun", *train_args(tiny_model, run, data)[1:]])
    out, err, rc = signal_at(proc, "PREPARING", signal.SIGTERM)
    assert rc == 143, out[-2000:] + err[-3000:]
    assert err.strip().splitlines()[-1] == (
        "tuneledger dryrun: stopped by SIGTERM before any preset ran, while preparing the checks and the data: nothing "
        "was measured and the last ledger is unchanged; the same command starts it again"), err[-3000:]
    assert "Traceback" not in err and not (run / "dryrun.json").exists()
