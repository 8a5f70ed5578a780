"""What a resumed `tuneledger train` prints (issue 21 (3)): one "resuming from" line, the launcher's,
which names the checkpoint and its step of the run's total. A real 2-rank run on the CPU, stopped
at step 2 and resumed to 4."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import procs

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, tiny_model) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("resume")
    data = tmp / "d.jsonl"
    lines = (ROOT / "src/tuneledger/data/demo.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    data.write_text("".join(lines[:8]), encoding="utf-8")
    run = tmp / "run"
    args = ["train", str(ROOT / "configs/tiny.yaml"), f"model_name_or_path={tiny_model}", f"dataset={data}",
            f"output_dir={run}", f"cache_dir={tmp / 'cache'}", "cutoff_len=128", "global_batch_size=2",
            "save_steps=2", "logging_steps=1", "--cpu", "--nproc", "2"]
    outs = []
    for steps in (2, 4):
        p = procs.run([sys.executable, "-m", "tuneledger", *args, f"max_steps={steps}"], cwd=ROOT)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        outs.append(p.stdout + p.stderr)
    (tmp / "first.out").write_text(outs[0])
    return run, outs[1]


def test_without_an_eta_check_the_command_still_says_its_time(resumed):
    """A fresh tester: with no dry-run ledger (an LF config's first run) or on a resume, train
    printed no wall time at all, so the tool's clock could not be held against `time`'s."""
    run, out = resumed
    first = (run.parent / "first.out").read_text()
    assert re.search(r"ETA check: none \(no dry-run ledger at .*\); .*; this command took \d+ min \d\d s "
                     r"\(process start to this line", first), first[-2000:]
    assert re.search(r"This command took \d+ min \d\d s \(process start to this line.*\); no ETA check: a resumed "
                     "run is part of what the dry-run predicted", out), out[-2000:]


def test_the_launcher_names_the_checkpoint_and_its_step(resumed):
    run, out = resumed
    assert f"resuming from {run / 'checkpoint-2'} (step 2 of 4)" in out


def test_resuming_is_said_once(resumed):
    _, out = resumed
    lines = [ln for ln in out.splitlines() if ln.startswith("resuming from")]
    assert len(lines) == 1, lines


def test_the_logs_rate_counts_from_the_resumed_step():
    """eta_h divides the time since the last log by the steps since it: after a resume the first
    log's steps are counted from the checkpoint's step, not from 0."""
    import types

    import torch

    from tuneledger.trainer import TokenSnapshot

    trainer = types.SimpleNamespace(tokens=torch.tensor(12_345), _log_tokens=0, _log_time=0.0, _log_step=0,
                                    step_tokens=[], step_losses=[], loss_sum=torch.zeros(()))
    TokenSnapshot(trainer).on_train_begin(None, types.SimpleNamespace(global_step=500), None)
    assert trainer._log_step == 500 and trainer._log_tokens == 12_345 and trainer._log_time > 0
