"""Faults injected into real `tuneledger train` runs: 2 gloo ranks of a tiny random Qwen2 (CPU).

NaN from a huge learning rate, SIGTERM mid-run, a second run into the same directory, kill -9 of
the launcher, a tmpfs that fills up after the first save, a deleted optimizer.pt, changed data at
the same path, a finished run asked for more steps. Runs are short (global batch 2, 8 records).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import procs
from tuneledger.checkpoints import problem
from tuneledger.dryrun_keep import MARK

ROOT = Path(__file__).resolve().parents[1]
# Each test trains (2 gloo ranks, often twice): minutes in all, so the slow tier (`make test-all`, CI).
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The first 8 demo records, in a file the tests may change."""
    out = tmp_path_factory.mktemp("data") / "d.jsonl"
    lines = (ROOT / "src/tuneledger/data/demo.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    out.write_text("".join(lines[:8]), encoding="utf-8")
    return out


def args(tiny_model, data, run: Path, *extra) -> list[str]:
    # 8 records / global batch 2 = 4 steps per epoch; micro-batch 1 on 2 ranks, no accumulation.
    return ["train", str(ROOT / "configs/tiny.yaml"), f"model_name_or_path={tiny_model}", f"dataset={data}",
            f"output_dir={run}", f"cache_dir={run.parent / 'cache'}", "cutoff_len=128", "global_batch_size=2",
            "save_steps=2", "logging_steps=1", *extra, "--cpu", "--nproc", "2"]


def tl(*a):
    return procs.run([sys.executable, "-m", "tuneledger", *a], cwd=ROOT)


def start(*a, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tuneledger", *a], cwd=ROOT, stdout=open(out, "w"),
                            stderr=subprocess.STDOUT, text=True)


FIRST_STEP = re.compile(r": step \d+/\d+, loss \d")  # progress.log_line's training line


def wait_for_first_step(run: Path, proc: subprocess.Popen) -> None:
    """Until train.log (line-buffered) holds the first logged step's loss line, while the run goes on."""
    wait_for(lambda: bool(FIRST_STEP.search((run / "train.log").read_text())) if (run / "train.log").exists()
             else False, "the first logged step", proc=proc, log=run / "train.log")


def wait_for(cond, what: str, timeout: float = procs.TIMEOUT_S or 3600, proc: subprocess.Popen | None = None,
             log: Path | None = None):
    """Polls `cond` every 50 ms. Fails at once when `proc` has exited first (a run that ended or
    crashed cannot satisfy it: waiting on would only eat the timeout), else after `timeout` s
    ($TUNELEDGER_TEST_TIMEOUT), with the tail of `log`."""
    def tail() -> str:
        return log.read_text()[-3000:] if log is not None and log.exists() else ""

    end = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            if cond():
                return
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}\n{tail()}")
        if time.monotonic() > end:
            raise AssertionError(f"gave up waiting {timeout:.0f} s for {what}\n{tail()}")
        time.sleep(0.05)


def logged(ckpt: Path) -> list[dict]:
    return [h for h in json.loads((ckpt / "trainer_state.json").read_text())["log_history"] if "loss" in h]


def processes_of(job: Path) -> list[int]:
    """pids whose command line names this run's job.json (torchrun and its ranks)."""
    out = []
    for cmd in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(job).encode() in cmd.read_bytes():
                out.append(int(cmd.parent.name))
        except OSError:
            pass
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model, data) -> Path:
    """A run of one epoch (4 steps) with checkpoints 2 and 4."""
    run = tmp_path_factory.mktemp("finished") / "run"
    p = tl(*args(tiny_model, data, run))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return run


def copy_of(finished: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    return run


# ------------------------------------------------------------------------------------- item 1
def test_nan_stops_before_saving_names_the_step_and_exits_non_zero(tmp_path, tiny_model, data):
    run = tmp_path / "run"
    # lr 1e30 from step 2 (step 1 is warm-up at 0): the loss is not finite from step 3. Logging
    # every 5 steps: the save at step 4 forces the check on its own numbers.
    p = tl(*args(tiny_model, data, run, "learning_rate=1e30", "max_steps=8", "logging_steps=5"))
    assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-3000:]
    assert "at step 4 (finite until step 2)" in p.stderr and "that step not saved" in p.stderr
    assert sorted(c.name for c in run.glob("checkpoint-*")) == ["checkpoint-2"]  # no NaN save, nothing rotated
    # Step 2 ran at 1e30: its weights are finite but ~1e30. Sealed with that health, it is not "good".
    why = problem(run / "checkpoint-2")
    assert why and "largest |weight|" in why, why
    assert "no checkpoint is known good (checkpoint-2:" in p.stderr and "the last good checkpoint" not in p.stderr
    assert json.loads((run / "train.json").read_text())["stopped"]["step"] == 4


def test_collapse_warns_and_the_run_goes_on(tmp_path, tiny_model, data):
    # lr 1e6 saturates the model after step 2: the grad norm reads 0 from step 3 on.
    p = tl(*args(tiny_model, data, tmp_path / "run", "learning_rate=1e6", "max_steps=5", "save_steps=100"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "WARNING: training has collapsed: grad norm 0 from step 3 to 5" in p.stdout + p.stderr


# ----------------------------------------------------------------------------- items 4, 9, 10
def sigterm_mid_run(tmp_path, tiny_model, data, run: Path, *extra: str) -> Path:
    """A 40-step run stopped by SIGTERM after its first logged step, a second run into the same
    folder refused while it runs. Asserts the clean stop (exit 0, one sealed checkpoint holding
    every step so far, the lock released); returns that checkpoint. Also run under preset F."""
    a = args(tiny_model, data, run, *extra, "max_steps=40", "save_steps=100", "stop_grace_period_s=300")
    first = start(*a, out=tmp_path / "first.out")
    try:
        wait_for_first_step(run, first)
        job = (run / "job.json").read_text()
        second = tl(*args(tiny_model, data, run, *extra, "max_steps=40", "learning_rate=1e-3"))
        assert second.returncode == 1 and f"is in use by pid {first.pid}" in second.stderr
        assert (run / "job.json").read_text() == job  # the first run's job was not overwritten
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=600) == 0
    finally:
        if first.poll() is None:
            first.kill()
    out = (tmp_path / "first.out").read_text()
    assert "stopped by SIGTERM after step" in out, out[-3000:]
    ckpts = list(run.glob("checkpoint-*"))
    assert len(ckpts) == 1 and problem(ckpts[0]) is None
    step = int(ckpts[0].name.split("-")[1])
    assert 1 <= step < 40 and [h["step"] for h in logged(ckpts[0])] == list(range(1, step + 1))
    assert (run / "run.lock").read_text() == ""  # released
    # The run's root holds the stopped run's newest adapter, and says it is not the end of training.
    final = json.loads((run / "tuneledger_final.json").read_text())
    assert final["checkpoint"] == ckpts[0].name and final["finished"] is False
    return ckpts[0]


def test_sigterm_saves_and_exits_0_and_a_second_run_is_refused(tmp_path, tiny_model, data):
    run = tmp_path / "run"
    ckpt = sigterm_mid_run(tmp_path, tiny_model, data, run)
    ckpts, step = [ckpt], int(ckpt.name.split("-")[1])
    resumed = tl(*args(tiny_model, data, run, f"max_steps={step + 1}", "save_steps=100"))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resuming from {ckpts[0]}" in resumed.stdout
    assert [h["step"] for h in logged(run / f"checkpoint-{step + 1}")] == list(range(1, step + 2))
    final = json.loads((run / "tuneledger_final.json").read_text())
    assert (final["checkpoint"], final["step"], final["finished"]) == (f"checkpoint-{step + 1}", step + 1, True)


def test_kill_9_of_the_launcher_leaves_a_log_and_no_orphan_ranks(tmp_path, tiny_model, data):
    run = tmp_path / "run"
    launcher = start(*args(tiny_model, data, run, "max_steps=40", "save_steps=100", "stop_grace_period_s=60"),
                     out=tmp_path / "out")
    try:
        wait_for_first_step(run, launcher)
        assert processes_of(run / "job.json")  # torchrun and the ranks are running
        launcher.kill()
        launcher.wait()
        wait_for(lambda: not processes_of(run / "job.json"), "the ranks to die with their launcher", timeout=180)
    finally:
        for pid in processes_of(run / "job.json"):
            os.kill(pid, signal.SIGKILL)
    assert FIRST_STEP.search((run / "train.log").read_text())  # written line by line, not lost in a buffer


def test_kill_9_of_torchrun_is_no_success(tmp_path, tiny_model, data):
    """The ranks lose their agent and stop (they save if they can); the launcher got no signal,
    so the run was interrupted, not stopped as asked: exit non-zero, and say what happened."""
    from tuneledger.launch import _child_pids

    run = tmp_path / "run"
    launcher = start(*args(tiny_model, data, run, "max_steps=40", "save_steps=100", "stop_grace_period_s=60"),
                     out=tmp_path / "out")
    try:
        wait_for_first_step(run, launcher)
        torchrun = _child_pids(launcher.pid)
        assert len(torchrun) == 1
        os.kill(torchrun[0], signal.SIGKILL)
        rc = launcher.wait(timeout=600)
    finally:
        for pid in processes_of(run / "job.json"):
            os.kill(pid, signal.SIGKILL)
    out = (tmp_path / "out").read_text()
    assert rc != 0, out[-3000:]
    last = [line for line in out.splitlines() if line.strip()][-1]
    assert last.startswith("tuneledger train: ") and ("torchrun exited" in last or "a rank failed" in last), last
    assert "stopped by SIGTERM" not in out


# ------------------------------------------------------------------------------------ item 11
@pytest.fixture
def tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=72m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("a tmpfs mount needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)])


def fill(mnt: Path, leave: int) -> None:
    """Write a ballast file until the filesystem is full, then free `leave` bytes of it."""
    with open(mnt / "ballast", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 2**20)
                f.flush()
        except OSError:
            pass
    os.truncate(mnt / "ballast", max(0, (mnt / "ballast").stat().st_size - leave))


def fill_under(launcher: subprocess.Popen, mnt: Path, leave: int) -> int:
    """Fill `mnt` (fill) while the launcher's ranks are paused (SIGSTOP), so their next write is
    the one that meets the full disk; then let them go on and return the launcher's exit code."""
    from tuneledger.launch import _child_pids

    ranks = [r for t in _child_pids(launcher.pid) for r in _child_pids(t)]
    for r in ranks:
        os.kill(r, signal.SIGSTOP)
    fill(mnt, leave=leave)
    for r in ranks:
        os.kill(r, signal.SIGCONT)
    return launcher.wait(timeout=600)


def test_disk_full_names_path_need_and_free_and_keeps_the_last_good_checkpoint(tmp_path, tmpfs, tiny_model, data):
    run = tmpfs / "run"
    launcher = start(*args(tiny_model, data, run, "max_steps=8"), out=tmp_path / "out")
    try:
        # Another writer fills the disk once the first checkpoint is sealed; the ranks are paused
        # meanwhile (SIGSTOP), so the next save is the one that meets the full disk.
        wait_for(lambda: (run / "checkpoint-2" / "tuneledger_manifest.json").exists(), "checkpoint-2", proc=launcher,
                 log=run / "train.log")
        rc = fill_under(launcher, tmpfs, leave=3 * 2**20)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    out = (tmp_path / "out").read_text()
    assert rc != 0, out[-3000:]
    assert f"disk full while saving {run / 'checkpoint-4'}: a checkpoint needs" in out, out[-4000:]
    assert "bytes are free there" in out and "checkpoint-2, is kept" in out
    assert problem(run / "checkpoint-2") is None


def test_a_disk_that_fills_during_a_dryrun_preset_is_said_once_and_keeps_the_earlier_dryrun(tmp_path, tmpfs, tiny_model,
                                                                                              data):
    run = tmpfs / "run"
    dry = ["dryrun", str(ROOT / "configs/tiny.yaml"), f"model_name_or_path={tiny_model}", f"dataset={data}",
           f"output_dir={run}", f"cache_dir={tmp_path / 'cache'}", "cutoff_len=128", "global_batch_size=2",
           "dryrun_steps=4", "dryrun_warmup_steps=1", "--preset", "A", "--cpu", "--nproc", "2"]
    first = tl(*dry)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    ledger, result = (run / "dryrun.json").read_text(), (run / "dryrun" / "A" / "result.json").read_text()
    # The second dry-run measures every preset: the first one meets the full disk, the others are not run.
    launcher = start(*[a if a != "A" else "all" for a in dry], out=tmp_path / "out")
    try:
        # Another writer fills the disk while the preset runs (its ranks paused), before its timed save.
        wait_for(lambda: (run / "dryrun.log.1").exists() and (run / "dryrun.log").exists()
                 and "step 1/" in (run / "dryrun.log").read_text(),
                 "the first step", proc=launcher, log=run / "dryrun.log")
        rc = fill_under(launcher, tmpfs, leave=0)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    out = (tmp_path / "out").read_text()
    assert rc == 1, out[-3000:]
    assert "Traceback" not in out, out[-4000:]  # the ranks' and torchrun's tracebacks are one line each
    # (global batch 2 on 2 ranks: presets A and D run, B and C are skipped as they plan)
    assert "preset A: the disk is full (the worker error above); D after it is not measured" in out, out[-3000:]
    assert "worker error: DiskFullError: " in out and out.count("=== [") == 1  # one preset ran
    last = [line for line in out.splitlines() if line.strip()][-1]
    assert last.startswith("tuneledger dryrun: disk full: "), last
    # What the first dry-run left is all there: its ledger, the preset's result, its log.
    assert (run / "dryrun.json").read_text() == ledger
    assert (run / "dryrun" / "A" / "result.json").read_text() == result
    # The ledger's log is back under the name the ledger gives (with its mark); this run's is beside it,
    # as the output says before the rows' write meets the full disk.
    assert f"{MARK}{json.loads(ledger)['date']}" in (run / "dryrun.log").read_text()
    assert "step 1/" in (run / "dryrun.failed.log").read_text() and not (run / "dryrun.log.1").exists()
    assert f"this run's log is {run / 'dryrun.failed.log'}" in out, out[-3000:]


# -------------------------------------------------------------------------------- items 2, 5, 8
def test_deleted_optimizer_resumes_from_the_previous_checkpoint_with_its_schedule(tmp_path, finished, tiny_model, data):
    run = copy_of(finished, tmp_path)
    (run / "checkpoint-4" / "optimizer.pt").unlink()
    p = tl(*args(tiny_model, data, run))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "checkpoint-4/optimizer.pt is missing -> kept as damaged-checkpoint-4" in p.stderr
    assert f"resuming from {run / 'checkpoint-2'}" in p.stdout
    original = {h["step"]: h for h in logged(run / "damaged-checkpoint-4")}
    again = {h["step"]: h for h in logged(run / "checkpoint-4")}
    assert sorted(again) == [1, 2, 3, 4] and problem(run / "checkpoint-4") is None
    for s in (3, 4):  # optimizer, scheduler and RNG restored: the same steps as the first time
        assert again[s]["learning_rate"] == original[s]["learning_rate"]
        assert again[s]["loss"] == pytest.approx(original[s]["loss"], rel=1e-4)


# ------------------------------------------------------------------------------------- item 3
def test_changed_data_is_refused_unless_resume_on_changed_data(tmp_path, finished, tiny_model, data):
    run = copy_of(finished, tmp_path)
    before = data.read_text(encoding="utf-8")
    try:
        lines = before.splitlines(keepends=True)
        record = json.loads(lines[0])
        record["output"] += " Changed."  # same path, same number of records, other contents
        data.write_text(json.dumps(record, ensure_ascii=False) + "\n" + "".join(lines[1:]), encoding="utf-8")
        p = tl(*args(tiny_model, data, run, "max_steps=6"))
        assert p.returncode == 2 and "the data changed since" in p.stderr
        assert p.stderr.count("sha256") == 2 and "resume_on_changed_data=true" in p.stderr
        both = tl(*args(tiny_model, data, run, "max_steps=6", "lora_rank=8"))  # one refusal names both changes
        assert both.returncode == 2 and "lora_rank: checkpoint" in both.stderr and both.stderr.count("sha256") == 2
        anyway = tl(*args(tiny_model, data, run, "resume_on_changed_data=true"))
        assert anyway.returncode == 0 and "resuming on changed data" in anyway.stderr
        assert "is already trained" in anyway.stdout  # got past the check; 4 of 4 steps done
    finally:
        data.write_text(before, encoding="utf-8")


# ------------------------------------------------------------------------------------- item 7
@pytest.mark.parametrize("more", ["max_steps=6", "num_train_epochs=1.5"])
def test_a_finished_run_goes_on_when_asked_for_more(tmp_path, finished, tiny_model, data, more):
    run = copy_of(finished, tmp_path)
    p = tl(*args(tiny_model, data, run, more))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "resuming from" in p.stdout and "(step 4 of 6)" in p.stdout
    assert [h["step"] for h in logged(run / "checkpoint-6")] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(h["loss"]) for h in logged(run / "checkpoint-6"))
    if more == "max_steps=6":
        # The steps after the resume follow the schedule of the new total (cosine, 1e-4, warm-up
        # ceil(0.03 x steps)), logged as the first 4 steps were logged against the old one; the first
        # resumed step used to keep the old schedule's end (0) from the optimizer's saved state.
        lrs = [h["learning_rate"] for h in logged(run / "checkpoint-6")]
        shift = next(k for k in (0, 1) if lrs[:4] == pytest.approx(_cosine(4)[k:k + 4], abs=1e-12))
        assert lrs[4:] == pytest.approx(_cosine(6)[shift + 4:shift + 6], abs=1e-12), lrs


def _cosine(total: int) -> list[float]:
    """transformers' cosine schedule with warm-up as the tiny config sets it: the LR of steps
    1..total, then the one after the last."""
    import torch
    from transformers import get_cosine_schedule_with_warmup

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-4)
    sched = get_cosine_schedule_with_warmup(opt, math.ceil(0.03 * total), total)
    out = []
    for _ in range(total + 1):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out
