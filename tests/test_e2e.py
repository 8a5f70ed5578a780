"""Real runs on a tiny random Qwen2 through torchrun with 2 gloo processes (CPU)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import procs

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e


def tl(*args, env=None, cwd=None):
    return procs.run([sys.executable, "-m", "tuneledger", *args], env={**os.environ, **(env or {})}, cwd=cwd or ROOT)


def small(tmp_path, tiny_model, name, *extra):
    return [str(ROOT / "configs" / "tiny.yaml"), f"model_name_or_path={tiny_model}", f"output_dir={tmp_path / name}",
            f"cache_dir={tmp_path / 'cache'}", "max_samples=48", "cutoff_len=128", "global_batch_size=8", *extra]


@pytest.mark.slow  # minutes on 2 cores: the fast tier stays under 10 min (make test-all runs it)
def test_dryrun_all_presets_two_gloo_ranks_writes_the_ledger(tmp_path, tiny_model):
    p = tl("dryrun", *small(tmp_path, tiny_model, "dry", "dryrun_steps=3", "dryrun_warmup_steps=1"), "--preset", "all", "--nproc", "2", "--cpu")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    led = json.loads((tmp_path / "dry" / "dryrun.json").read_text())
    assert led["world_size"] == 2 and led["backend"] == "gloo" and led["synthetic"] is True
    assert not any("monitor" in v for v in led["verdicts"].values())  # no GPU for it to sample (issue 21.18)
    assert [r["preset"] for r in led["presets"]] == ["A", "B", "C", "D"]
    for r in led["presets"]:
        assert r["steps_measured"] == 2 and r["warmup_steps_excluded"] == 1
        assert r["micro_batch"] * r["gradient_accumulation_steps"] * 2 == 8
        assert r["s_per_step"] > 0 and r["tokens_per_s"] > 0
        assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / 2)
        assert r["save_s"] > 0 and r["checkpoint_bytes"] > 0
        assert r["allreduce"]["bytes"] == r["model"]["trainable_params"] * 4 and r["allreduce"]["busbw_gbs"] > 0
        parts = r["split"]
        assert parts["forward_backward_per_micro_s"] > 0 and parts["micro_batches_per_step"] == r["gradient_accumulation_steps"]
        e = r["eta"]
        assert e["total_steps"] == 6  # ceil(48 / 8)
        assert e["total_s"] == pytest.approx(sum(e["parts"].values()))
        assert e["parts"]["steps_s"] == pytest.approx(5 * r["s_per_step"])  # the 1 warm-up step is timed as it ran
        # the final save only, and the loss plot a train redraws at each save (timed, with the final copy)
        assert e["checkpoints"] == 1 and e["parts"]["saves_s"] == pytest.approx(r["save_s"] + r["plot_timing"]["next_s"])
        assert r["publish_s"] > 0 and r["plot_timing"]["first_s"] > 0
        assert r["run_steps_replayed"][0] == 0 and len(r["run_steps_replayed"]) == 3
    assert led["data_hash"] and led["versions"]["torch"]
    assert led["finding"].startswith(("preset ", "presets "))  # one fastest, or a tie
    md = (tmp_path / "dry" / "dryrun.md").read_text()
    assert "SYNTHETIC" in md and "| preset |" in md and "Where the step time goes" in md
    assert "rendezvous 127.0.0.1:" in p.stdout
    # Progress while it runs, and no line without information (issue 10, items 3 and 6).
    assert "=== [1/4] preset A: micro-batch" in p.stdout and "preset A: preset A" not in p.stdout
    assert "dry-run preset A (1 of 4): step 1/3," in p.stdout and "3 more presets after it, not in this estimate" in p.stdout
    assert "dry-run preset D (4 of 4): step 3/3," in p.stdout
    for noise in ("PAD/BOS/EOS", "Loading weights", "gemm_4bit_forward", "Filter:"):
        assert noise not in p.stdout + p.stderr, noise
    assert "cuda" not in led["versions"] and "cuda " not in md  # a CPU run used no CUDA
    assert not list((tmp_path / "dry" / "dryrun").glob("*/checkpoint-*"))  # timed, weighed, removed
    # What every preset shares is said once (a tester's four ~400-character levers lines), and the
    # command's own time, to hold against the shell's `time`.
    assert re.search(r"\nlevers [ABCD], [ABCD], [ABCD], [ABCD]: ", p.stdout) and sum(ln.startswith("VERDICT") for ln in p.stdout.splitlines()) == 1
    assert re.search(r"\ndry-run: this command took \d+ min \d\d s \(process start to this line", p.stdout)


@pytest.mark.slow  # minutes on 2 cores: the fast tier stays under 10 min (make test-all runs it)
def test_train_checkpoints_crashes_and_resumes_at_the_right_step(tmp_path, tiny_model):
    args = small(tmp_path, tiny_model, "run", "max_steps=4", "save_steps=2", "preset=C", "logging_steps=1")
    crashed = tl("train", *args, "--nproc", "2", "--cpu", env={"TUNELEDGER_CRASH_AFTER_STEP": "2"})
    assert crashed.returncode != 0
    run = tmp_path / "run"
    assert (run / "checkpoint-2" / "trainer_state.json").is_file() and not (run / "checkpoint-4").exists()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))

    # No --cpu: on a machine without GPUs the verb finds that itself (as `make train` relies on).
    resumed = tl("train", *args, "--nproc", "2")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resuming from {run / 'checkpoint-2'}" in resumed.stdout
    result = json.loads((run / "train.json").read_text())
    assert result["global_step"] == 4 and result["resumed_from"] == str(run / "checkpoint-2")
    state = json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())
    steps = [h["step"] for h in state["log_history"] if "loss" in h]
    assert steps == [1, 2, 3, 4]  # history carried over, no step repeated or skipped
    assert any("tokens_per_s" in h and "eta_h" in h for h in state["log_history"])
    assert (run / "checkpoint-4" / "adapter_model.safetensors").is_file()
    losses = [h["loss"] for h in state["log_history"] if "loss" in h]
    assert result["train_loss"] == pytest.approx(sum(losses) / len(losses))  # not skewed by the resume
    # One loss printed, the right one: not transformers' train_loss beside ours (issue 10, item 7).
    assert "train_loss" not in resumed.stdout and "last None" not in resumed.stdout
    assert f"loss {result['train_loss']:.4f} (mean over the run's 4 steps), last {losses[-1]:.4f} at step 4" in resumed.stdout

    again = tl("train", *args, "--nproc", "2", "--cpu")  # a finished run is left as it is
    assert again.returncode == 0 and "is already trained" in again.stdout
    assert json.loads((run / "train.json").read_text()) == result
    changed = tl("train", *args, "lora_rank=8", "--nproc", "2", "--cpu")
    assert changed.returncode == 2 and "lora_rank: checkpoint 64, now 8" in changed.stderr


def test_sigterm_to_the_dryrun_launcher_stops_every_rank(tmp_path, tiny_model):
    """`kill`, `docker stop` or a CI timeout reach the `tuneledger` process only; torchrun runs each
    rank in a session of its own, so the launcher must stop them, not leave them running as orphans.
    (A training's ranks save first: tests/test_faults_e2e.py.)"""
    args = small(tmp_path, tiny_model, "dry", "dryrun_steps=100000", "dryrun_warmup_steps=1")
    with open(tmp_path / "out.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tuneledger", "dryrun", *args, "--preset", "C", "--nproc", "2",
                                 "--cpu"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    try:
        ranks: list[psutil.Process] = []
        deadline = time.monotonic() + (procs.TIMEOUT_S or 3600)
        while len(ranks) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
            ranks = [rank for torchrun in psutil.Process(proc.pid).children() for rank in torchrun.children()
                     if "tuneledger.worker" in rank.cmdline()]  # torchrun's children, not torchrun itself
        assert len(ranks) == 2, (tmp_path / "out.log").read_text()[-3000:]
        assert all(r.pid == os.getsid(r.pid) for r in ranks)  # each rank leads its own session
        proc.send_signal(signal.SIGTERM)  # to the launcher alone
        assert proc.wait(timeout=120) == 143
        _, alive = psutil.wait_procs(ranks, timeout=60)  # torchrun gives a rank 30 s before SIGKILL
        assert alive == [], alive
        assert "terminated (SIGTERM): the ranks were stopped" in (tmp_path / "out.log").read_text()
    finally:
        procs.kill_tree(proc.pid)


def _sigterm_when(args, log_path, text, signum=signal.SIGTERM):
    """Start a CPU dry-run, SIGTERM its launcher once `text` is in its output (SIGINT: to its whole
    process group, as Ctrl-C in a terminal does); returns (rc, output)."""
    with open(log_path, "w") as log:
        # A terminal's process has Ctrl-C's default; a shell's background job (`make test &`, how a
        # harness may run this) inherits SIGINT ignored, which Python, rightly, keeps ignoring.
        proc = subprocess.Popen([sys.executable, "-m", "tuneledger", "dryrun", *args], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + (procs.TIMEOUT_S or 3600)
        while text not in log_path.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, log_path.read_text()[-3000:]
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signum)
        return proc.wait(timeout=180), log_path.read_text()
    finally:
        procs.kill_tree(proc.pid)


def test_sigterm_keeps_the_presets_measured_and_never_replaces_a_ledger_with_nothing(tmp_path, tiny_model):
    """SIGTERM (a scheduler, `docker stop`) after preset A finished: A's row is in the ledger, the rest
    say they were terminated, exit 143. A second run stopped by Ctrl-C (SIGINT to the terminal's
    process group) before any preset finished exits 130, as docs/runs-and-output.md gives it, says
    interrupted, and leaves that ledger as it was."""
    args = [*small(tmp_path, tiny_model, "dry", "dryrun_steps=3", "dryrun_warmup_steps=1"), "--preset", "all",
            "--nproc", "1", "--cpu"]
    rc, out = _sigterm_when(args, tmp_path / "out.log", "\npreset A: ")
    assert rc == 143, out[-3000:]
    led = json.loads((tmp_path / "dry" / "dryrun.json").read_text())
    rows = {r["preset"]: r for r in led["presets"]}
    assert "s_per_step" in rows["A"] and set(rows) == {"A", "B", "C", "D"}, out[-3000:]
    assert all(rows[p].get("skipped") == "terminated (SIGTERM)" for p in "BCD" if "s_per_step" not in rows[p])
    assert "terminated (SIGTERM): writing the ledger of the presets measured so far" in out and "Traceback" not in out
    before = (tmp_path / "dry" / "dryrun.json").read_bytes()
    log_before = (tmp_path / "dry" / "dryrun.log").read_text()
    rc, out = _sigterm_when(args, tmp_path / "out2.log", "=== [1/4]", signal.SIGINT)
    assert rc == 130 and "\ninterrupted: no preset finished" in out and "is left as it was" in out, out[-3000:]
    assert (tmp_path / "dry" / "dryrun.json").read_bytes() == before
    # The kept ledger's log is back under the name it had; this run's is beside it, and said.
    assert (tmp_path / "dry" / "dryrun.log").read_text() == log_before and "dry-run preset A" in log_before
    assert f"this run's log is {tmp_path / 'dry' / 'dryrun.failed.log'}" in out
    assert (tmp_path / "dry" / "dryrun.failed.log").exists() and not (tmp_path / "dry" / "dryrun.log.1").exists()


def test_a_dry_run_whose_every_preset_fails_leaves_the_earlier_ledger(tmp_path, tiny_model):
    """Every preset failing (here each rank crashes after its first step) measures nothing: the
    earlier whole dryrun.json stays as it was, and this run's failed rows go to dryrun.failed.json."""
    args = [*small(tmp_path, tiny_model, "dry", "dryrun_steps=3", "dryrun_warmup_steps=1"), "--preset", "A",
            "--nproc", "1", "--cpu"]
    # The good run profiles its step 2, a measured one (a run of its own would cost another dry-run):
    # said before the ranks start, marked on the row and in dryrun.md, and the profile is written.
    # The memory split needs the CUDA allocator: on a CPU it is said, and nothing else changes.
    first = tl("dryrun", *args, env={"TUNELEDGER_PROFILE_STEP": "2", "TUNELEDGER_MEMORY_STEP": "1"})
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "TUNELEDGER_MEMORY_STEP=1: no CUDA GPU here" in first.stdout + first.stderr + (tmp_path / "dry" / "dryrun.log").read_text()
    assert "TUNELEDGER_PROFILE_STEP=2: step 2 is one of the measured steps" in first.stdout
    assert json.loads((tmp_path / "dry" / "dryrun.json").read_text())["presets"][0]["profiled_step"] == 2
    assert "Profiled with TUNELEDGER_PROFILE_STEP among the measured steps: A (step 2)" in (tmp_path / "dry" / "dryrun.md").read_text()
    assert list((tmp_path / "dry").rglob("profile-step2.md"))
    before = (tmp_path / "dry" / "dryrun.json").read_bytes()
    log_before = (tmp_path / "dry" / "dryrun.log").read_bytes()
    crashed = tl("dryrun", *args, env={"TUNELEDGER_CRASH_AFTER_STEP": "1"})
    assert crashed.returncode == 1, crashed.stdout[-3000:] + crashed.stderr[-3000:]
    assert (tmp_path / "dry" / "dryrun.json").read_bytes() == before
    assert (tmp_path / "dry" / "dryrun.log").read_bytes() == log_before  # the kept ledger's log, under its name
    assert "this run's log is" in crashed.stdout and (tmp_path / "dry" / "dryrun.failed.log").exists()
    failed = json.loads((tmp_path / "dry" / "dryrun.failed.json").read_text())["presets"]
    assert [r["preset"] for r in failed] == ["A"] and "s_per_step" not in failed[0], failed
    assert f"is left as it was with its log dryrun.log; this run's log is {tmp_path / 'dry' / 'dryrun.failed.log'}" \
        in crashed.stdout and "\nthis run's rows are in" in crashed.stdout
    # The failed rows' "see .../dryrun.log" names this run's log where it went, not the kept one.
    text = (tmp_path / "dry" / "dryrun.failed.json").read_text()
    assert "dryrun.failed.log" in text and f"{tmp_path / 'dry' / 'dryrun.log'}\"" not in text
