"""Faults as they happen, without a training run: damaged checkpoints, a killed export swap, two
processes at one lock or one cache, NaN and collapse in the logs, a full disk's errors.

The runs with 2 gloo ranks (NaN, SIGTERM, kill -9, full tmpfs, resume) are in test_faults_e2e.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tuneledger import checkpoints as ck
from tuneledger.config_load import load_config

ROOT = Path(__file__).resolve().parents[1]


def fake_checkpoint(run: Path, step: int, seal: bool = True) -> Path:
    """A checkpoint-N with every file a resume needs (contents are stand-ins of realistic sizes)."""
    c = run / f"checkpoint-{step}"
    c.mkdir(parents=True)
    for name, size in [("adapter_model.safetensors", 5000), ("optimizer.pt", 9000), ("scheduler.pt", 300),
                       ("rng_state_0.pth", 200), ("rng_state_1.pth", 200)]:
        (c / name).write_bytes(os.urandom(size))
    (c / "adapter_config.json").write_text("{}")
    (c / "trainer_state.json").write_text(json.dumps({"global_step": step, "max_steps": 10, "log_history": []}))
    (c / ck.CONFIG).write_text("{}")
    if seal:
        ck.write_manifest(c, step)
    return c


def train_cfg(run: Path, **kw):
    return load_config(None, {"model_name_or_path": "m", "dataset": ["x.json"], "output_dir": str(run), **kw})


# ------------------------------------------------------------------ items 2, 5, 8: checkpoints
@pytest.mark.parametrize("damage, named", [
    (lambda c: (c / "trainer_state.json").write_bytes(b""), "trainer_state.json has 0 bytes"),  # kill -9 during its write
    (lambda c: os.truncate(c / "adapter_model.safetensors", 100), "adapter_model.safetensors has 100 bytes"),
    (lambda c: os.truncate(c / "optimizer.pt", 10), "optimizer.pt has 10 bytes"),
    (lambda c: (c / "optimizer.pt").unlink(), "optimizer.pt is missing"),  # item 2
    (lambda c: (c / "rng_state_1.pth").unlink(), "rng_state_1.pth is missing"),
    (lambda c: (c / ck.MANIFEST).unlink(), "tuneledger_manifest.json is missing"),  # killed before the seal
])
def test_damaged_newest_checkpoint_falls_back_to_the_newest_good_one_and_is_kept(tmp_path, capsys, damage, named):
    from tuneledger.train import pick_checkpoint

    run = tmp_path / "run"
    fake_checkpoint(run, 2)
    newest = fake_checkpoint(run, 4)
    damage(newest)
    before = sorted(p.name for p in newest.iterdir())
    resume, refusal = pick_checkpoint(train_cfg(run))
    assert refusal is None and resume == str(run / "checkpoint-2")
    err = capsys.readouterr().err
    assert "checkpoint-4" in err and named in err and "not deleted" in err
    kept = run / "damaged-checkpoint-4"  # renamed out of the Trainer's way (it would write over it at step 4)
    assert sorted(p.name for p in kept.iterdir()) == before and not newest.exists()


def test_only_node_0_renames_a_damaged_checkpoint(tmp_path, capsys):
    """The nodes of a job share runs/: every node skips the damaged checkpoint, one renames it."""
    from tuneledger.train import pick_checkpoint

    run = tmp_path / "run"
    fake_checkpoint(run, 2)
    (fake_checkpoint(run, 4) / "optimizer.pt").unlink()
    assert pick_checkpoint(train_cfg(run), rename_damaged=False) == (str(run / "checkpoint-2"), None)
    assert "left for node 0 to rename" in capsys.readouterr().err
    assert (run / "checkpoint-4").is_dir() and not (run / "damaged-checkpoint-4").exists()
    assert pick_checkpoint(train_cfg(run)) == (str(run / "checkpoint-2"), None)
    assert (run / "damaged-checkpoint-4").is_dir() and not (run / "checkpoint-4").exists()


def test_no_checkpoint_verifies_refuses_naming_the_missing_file_and_again_on_the_second_start(tmp_path, capsys):
    """A refusal must not turn into a fresh start: nothing is renamed, so the same command again
    (a supervisor's restart) refuses again; so does a folder whose checkpoints an earlier start set
    aside. Only resume_from_checkpoint=never starts over."""
    from tuneledger.train import pick_checkpoint

    run = tmp_path / "run"
    (fake_checkpoint(run, 2) / "optimizer.pt").unlink()
    (fake_checkpoint(run, 4) / "optimizer.pt").unlink()
    for _ in range(2):
        resume, refusal = pick_checkpoint(train_cfg(run))
        assert resume is None and "no checkpoint" in refusal and "resume_from_checkpoint=never" in refusal
        assert "checkpoint-2/optimizer.pt is missing" in capsys.readouterr().err
        assert (run / "checkpoint-2" / "adapter_model.safetensors").is_file() and not list(run.glob("damaged-*"))
    (run / "checkpoint-4").rename(run / "damaged-checkpoint-4")  # as a start with a good checkpoint-6 once left it
    (run / "checkpoint-2").rename(run / "damaged-checkpoint-2")
    resume, refusal = pick_checkpoint(train_cfg(run))
    assert resume is None and "2 checkpoints" in refusal
    assert "damaged-checkpoint-2: set aside" in capsys.readouterr().err
    assert pick_checkpoint(train_cfg(run, resume_from_checkpoint="never")) == (None, None)


def test_bits_flipped_in_place_are_found_by_the_content_hash(tmp_path):
    c = fake_checkpoint(tmp_path / "run", 2)
    f = c / "adapter_model.safetensors"
    data = bytearray(f.read_bytes())
    data[1234] ^= 0b1000_0001  # same size, other bytes
    f.write_bytes(bytes(data))
    why = ck.problem(c)
    assert why and "adapter_model.safetensors does not match its content hash" in why
    assert ck.problem(c, hashes=False) is None  # sizes alone miss it
    assert ck.scan(c.parent) == (None, [(c, why)])


@pytest.mark.parametrize("health, reason", [
    ({"loss": 2.1, "grad_norm": 0.5, "max_abs_weight": 1e30, "finite_weights": True}, "largest |weight| is 1e+30"),
    ({"loss": 2.1, "grad_norm": 0.5, "max_abs_weight": None, "finite_weights": False}, "NaN or Inf weights"),
    ({"loss": float("nan"), "grad_norm": 0.5, "max_abs_weight": 0.1, "finite_weights": True}, "loss is nan"),
    ({"loss": 2.1, "grad_norm": float("inf"), "max_abs_weight": 0.1, "finite_weights": True}, "grad norm is inf"),
])
def test_a_sealed_checkpoint_is_good_only_if_its_step_was(tmp_path, health, reason):
    """'Good' means checked: finite loss and grad norm at the step, finite weights of a sane size."""
    run = tmp_path / "run"
    fake_checkpoint(run, 2)
    bad = run / "checkpoint-4"
    fake_checkpoint(run, 4, seal=False)
    ck.write_manifest(bad, 4, health)
    why = ck.problem(bad)
    assert why and reason in why and "not good" in why
    assert ck.scan(run) == (run / "checkpoint-2", [(bad, why)])
    ck.write_manifest(bad, 4, {"loss": 2.1, "grad_norm": 0.5, "max_abs_weight": 0.3, "finite_weights": True})
    assert ck.problem(bad) is None


def test_explicit_checkpoint_without_optimizer_is_refused(tmp_path):
    from tuneledger.train import pick_checkpoint

    c = fake_checkpoint(tmp_path / "run", 2, seal=False)  # a checkpoint from before manifests
    assert pick_checkpoint(train_cfg(tmp_path / "run", resume_from_checkpoint=str(c))) == (str(c), None)
    (c / "optimizer.pt").unlink()
    resume, refusal = pick_checkpoint(train_cfg(tmp_path / "run", resume_from_checkpoint=str(c)))
    assert resume is None and "lacks optimizer.pt" in refusal


def test_a_checkpoint_missing_its_config_is_never_sealed_nor_passes_the_settings_check(tmp_path):
    from tuneledger.guards import resume_conflicts

    c = fake_checkpoint(tmp_path / "run", 2, seal=False)
    (c / ck.CONFIG).unlink()
    with pytest.raises(ValueError, match="missing tuneledger_config.json"):
        ck.write_manifest(c, 2)
    assert ck.problem(c).endswith("before tuneledger sealed checkpoints")
    conflicts = resume_conflicts(c, train_cfg(tmp_path / "run"))
    assert conflicts and "tuneledger_config.json is missing" in conflicts[0]


# ------------------------------------------------------------------------------ item 3: data hash
def test_changed_data_is_named_with_both_hashes(tmp_path):
    from tuneledger.guards import data_changes

    c = fake_checkpoint(tmp_path / "run", 2)
    (c / ck.DATA).write_text(json.dumps({"data_files": {"d.jsonl": "aaa", "e.jsonl": "bbb"}}))
    assert data_changes(c, {"d.jsonl": "aaa", "e.jsonl": "bbb"}) == []
    assert data_changes(c, {"d.jsonl": "ccc", "e.jsonl": "bbb"}) == [
        "d.jsonl: checkpoint trained on sha256 aaa, the file now has sha256 ccc"]


# --------------------------------------------------------------------------------- item 4: lock
HOLD = "from tuneledger.runlock import RunLock; import sys, time\nwith RunLock(sys.argv[1]):\n print('held', flush=True); time.sleep(120)"


def test_second_process_is_refused_and_a_killed_holders_lock_is_taken_over(tmp_path):
    from tuneledger.runlock import RunLock, RunLocked

    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLocked, match=f"in use by pid {holder.pid} on {os.uname().nodename}"):
            with RunLock(tmp_path):
                pass
    finally:
        holder.kill()  # kill -9: no chance to release
        holder.wait()
    with RunLock(tmp_path) as lock:  # the kernel dropped the lock; the text it left marks it stale
        assert lock.stale["pid"] == holder.pid
    assert (tmp_path / "run.lock").read_text() == ""  # released cleanly
    with RunLock(tmp_path) as lock:
        assert lock.stale is None


def test_a_second_dryrun_in_one_run_folder_is_refused_and_the_ledger_kept(tmp_path, tiny_model):
    """Two dry-runs at once in one run folder would write one ledger: the second is refused before
    any work, naming the holder, and the first's files are left as they were."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "dryrun.json").write_text("{}")
    hold = HOLD.replace("RunLock(sys.argv[1])", "RunLock(sys.argv[1], 'dryrun.lock')")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(out)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    try:
        assert holder.stdout.readline().strip() == "held"
        p = subprocess.run([sys.executable, "-m", "tuneledger", "dryrun", str(ROOT / "configs/tiny.yaml"),
                            f"model_name_or_path={tiny_model}", f"output_dir={out}", "--cpu"],
                           capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    finally:
        holder.kill()
        holder.wait()
    assert p.returncode == 1 and f"in use by pid {holder.pid}" in p.stderr, p.stderr
    assert "Two dry-runs in one run directory overwrite each other's ledger" in p.stderr
    assert (out / "dryrun.json").read_text() == "{}" and not (out / "dryrun.log").exists()


def test_cache_built_by_two_processes_at_once(tmp_path, tiny_model):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) + "\n" for i in range(40)))
    cmd = [sys.executable, "-m", "tuneledger", "stats", f"model_name_or_path={tiny_model}", f"dataset={data}",
           f"cache_dir={tmp_path / 'cache'}", "template=qwen", "preprocessing_num_workers=1"]
    procs = [subprocess.Popen(cmd + [f"output_dir={tmp_path / f'out{i}'}"], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(entries) == 1 and ".tmp" not in entries[0], entries  # one cache, no temporary left
    assert (tmp_path / "cache" / entries[0] / "tuneledger.json").is_file()


# ------------------------------------------------------------------------- item 6: export swap
SWAP = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    import tuneledger.atomicdir as ad
    out, version, kill_at, exchange = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
    if not exchange:
        ad._exchange = lambda a, b: False
    calls = [0]
    def killing(real):
        def op(*a, **kw):
            calls[0] += 1
            if calls[0] == kill_at:
                os.kill(os.getpid(), 9)
            return real(*a, **kw)
        return op
    Path.rename = killing(Path.rename)
    Path.symlink_to = killing(Path.symlink_to)
    ad._exchange = killing(ad._exchange)
    ad.os.replace = killing(ad.os.replace)
    ad.shutil.rmtree = killing(ad.shutil.rmtree)
    with ad.atomic_dir(out) as tmp:
        tmp.mkdir()
        for f in ("model.safetensors", "tokenizer.json", "export.json"):
            (tmp / f).write_text(version)
""")


def whole(out: Path) -> str:
    files = {f.name: f.read_text() for f in out.iterdir()}
    assert sorted(files) == ["export.json", "model.safetensors", "tokenizer.json"], files
    assert len(set(files.values())) == 1, files  # one export, not a mix
    return next(iter(files.values()))


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "versioned-symlink"])
def test_export_killed_at_each_file_operation_leaves_one_whole_export(tmp_path, exchange):
    """At every instant `export` is one whole export: swapped by RENAME_EXCHANGE where the
    filesystem has it, else a symlink to a versioned folder moved by one rename."""
    from tuneledger.atomicdir import _recover

    out = tmp_path / "export"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    x = str(int(exchange))
    assert subprocess.run([sys.executable, "-c", SWAP, str(out), "v1", "0", x], env=env).returncode == 0
    assert out.is_symlink() != exchange
    seen = set()
    for kill_at in range(1, 10):
        p = subprocess.run([sys.executable, "-c", SWAP, str(out), f"v{kill_at + 1}", str(kill_at), x], env=env)
        if p.returncode == 0:
            break
        assert p.returncode == -9
        seen.add(whole(out))  # at every instant
        _recover(out)  # what the next export does first
        seen.add(whole(out))
    assert p.returncode == 0 and whole(out) == f"v{kill_at + 1}"
    assert kill_at >= 3 and len(seen) >= 2  # the kills did land before and after the swap
    left = sorted(x.name for x in tmp_path.iterdir())
    if exchange:
        assert left == ["export"]  # no .old or .partial left
    else:
        assert len(left) == 2 and left[0] == "export" and left[1].startswith("export.v") and out.resolve().name == left[1]


def test_an_export_written_before_links_still_swaps_without_the_exchange(tmp_path, monkeypatch):
    """A real `export` folder (an older version's) on a filesystem without the exchange: the
    two-rename swap, whose one gap _recover undoes."""
    import tuneledger.atomicdir as ad

    monkeypatch.setattr(ad, "_exchange", lambda a, b: False)
    out = tmp_path / "export"
    out.mkdir()
    (out / "export.json").write_text("old")
    with ad.atomic_dir(out) as tmp:
        tmp.mkdir()
        (tmp / "export.json").write_text("new")
    assert (out / "export.json").read_text() == "new" and not out.is_symlink()


# --------------------------------------------------------------------- item 1: NaN and collapse
def control():
    from transformers import TrainerControl

    return TrainerControl()


def state(step):
    from transformers import TrainerState

    s = TrainerState()
    s.global_step = step
    return s


def test_nonfinite_loss_or_grad_norm_stops_before_the_save(capsys):
    from tuneledger.guards import NonFiniteGuard

    g, args = NonFiniteGuard(), train_cfg(Path("r"))
    c = control()
    c.should_save = True
    g.on_step_end(args, state(2), c)
    assert c.should_log  # a save step is always checked
    g.on_log(args, state(2), c, logs={"loss": 2.0, "grad_norm": 1.0})
    assert c.should_save and not c.should_training_stop
    g.on_log(args, state(4), c, logs={"loss": 2.0, "grad_norm": float("inf")})
    assert not c.should_save and c.should_training_stop
    assert g.tripped == {"reason": "nonfinite", "step": 4, "loss": 2.0, "grad_norm": float("inf"), "last_finite_step": 2}
    assert "at step 4 (finite until step 2)" in capsys.readouterr().err
    g2, c2 = NonFiniteGuard(), control()
    g2.on_log(args, state(3), c2, logs={"loss": float("nan"), "grad_norm": 0.5})
    assert c2.should_training_stop and g2.tripped["step"] == 3


def test_collapse_warns_once(capsys):
    from tuneledger.guards import NonFiniteGuard

    g, args, c = NonFiniteGuard(), train_cfg(Path("r")), control()
    for step in (1, 2, 3):  # a healthy run never warns
        g.on_log(args, state(step), c, logs={"loss": 5.0, "grad_norm": 0.8})
    assert "collapsed" not in capsys.readouterr().err

    g, args, c = NonFiniteGuard(), train_cfg(Path("r"), learning_rate=1e6), control()
    for step, loss, gn in [(1, 11.9, 3.0), (2, 7.5, 0.0), (3, 7.4, 0.0), (4, 7.5, 0.0), (5, 7.5, 0.0)]:
        g.on_log(args, state(step), c, logs={"loss": loss, "grad_norm": gn})
    err = capsys.readouterr().err
    assert err.count("WARNING: training has collapsed") == 1 and "grad norm 0 from step 2 to 4, loss 7.4..7.5" in err
    assert not c.should_training_stop  # a warning: the numbers are finite


# ---------------------------------------------------------------------------- item 11: disk full
def test_disk_full_errors_are_recognised_in_every_form_they_take(tmp_path):
    import errno

    from tuneledger.files import disk_full
    from tuneledger.guards import disk_full_message

    assert disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert disk_full(RuntimeError("[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing file data/3: file write failed"))
    try:
        try:
            raise OSError(errno.ENOSPC, "x")
        except OSError as e:
            raise ValueError("wrapped") from e
    except ValueError as e:
        assert disk_full(e)
    assert not disk_full(OSError(errno.EACCES, "Permission denied"))
    msg = disk_full_message(tmp_path / "checkpoint-4", 13_000_000, tmp_path / "checkpoint-2")
    assert "checkpoint-4: a checkpoint needs 13,000,000 bytes" in msg and "bytes are free there" in msg
    assert "checkpoint-2, is kept" in msg


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs (root only, as CI's container runs), unmounted after the test."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode:
        pytest.skip("a tmpfs mount needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)])


def _fill(mnt: Path) -> None:
    with open(mnt / "ballast", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


def test_a_ledger_written_on_a_full_disk_keeps_the_earlier_one_whole(small_tmpfs):
    """ledger.write goes through a temporary file and a rename: the disk filling up mid-write
    leaves the earlier dryrun.json as it was (not 0 bytes, as a plain write_text did), and no
    temporary file behind."""
    import errno

    from tuneledger import ledger

    ledger.write(small_tmpfs, "dryrun", {"presets": [{"preset": "A"}]}, "# old\n")
    old = (small_tmpfs / "dryrun.json").read_text()
    _fill(small_tmpfs)
    with pytest.raises(OSError) as e:
        ledger.write(small_tmpfs, "dryrun", {"presets": [{"preset": "B", "pad": "x" * 200_000}]}, "# new\n")
    assert e.value.errno == errno.ENOSPC
    assert (small_tmpfs / "dryrun.json").read_text() == old
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["ballast", "dryrun.json", "dryrun.md"]


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    """The same without a tmpfs: the write fails at fsync (as ENOSPC shows up on some filesystems)."""
    import errno

    from tuneledger import files

    path = tmp_path / "result.json"
    files.write_text_atomic(path, "old")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full)
    with pytest.raises(OSError):
        files.write_text_atomic(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_a_full_disk_at_any_file_operation_is_one_line_not_a_traceback(tmp_path, tiny_model, small_tmpfs):
    """A verb that meets a full disk anywhere (here the run folder's lock, before preflight can
    speak) ends with one line naming it, exit 1."""
    _fill(small_tmpfs)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"instruction": "hi", "output": "hello"}) + "\n")
    p = subprocess.run([sys.executable, "-m", "tuneledger", "stats", f"model_name_or_path={tiny_model}",
                        f"dataset={data}", f"output_dir={small_tmpfs / 'run'}", f"cache_dir={tmp_path / 'cache'}"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    last = [line for line in p.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("tuneledger stats: disk full: ") and "then run the same command again" in last, last
    assert f"on the filesystem of {small_tmpfs / 'run'}" in last, last  # the file it could not write


@pytest.mark.parametrize("fails", [True, False])
def test_a_presets_earlier_result_is_kept_until_its_new_run_succeeds(tmp_path, monkeypatch, fails):
    """run_one sets the preset's earlier folder aside (a rename, which a full disk allows) and puts
    it back when the new run fails, leaving the failed one beside it as `<preset>.failed`."""
    import tuneledger.dryrun as dryrun
    from tuneledger.config import resolve

    cfg = resolve(load_config(None, {"model_name_or_path": "m", "dataset": ["d.json"], "quantization_bit": None,
                                     "preset": "A"}), 2)
    folder = tmp_path / "dryrun" / "A"
    folder.mkdir(parents=True)
    (folder / "result.json").write_text('{"earlier": true}')
    full = "OSError: [Errno 28] No space left on device"

    def fake_workers(job, job_path, nproc, log, nodes, rdzv_id, outcome):
        assert not (folder / "result.json").exists()  # the run starts in an empty folder
        job_path.parent.mkdir(parents=True, exist_ok=True)
        job_path.write_text(json.dumps(job))
        if fails:
            outcome["causes"] = [full]
            return 1
        Path(job["result_path"]).write_text(json.dumps({"new": True}))
        outcome["causes"] = []
        return 0

    monkeypatch.setattr(dryrun, "run_workers", fake_workers)
    monkeypatch.setattr(dryrun, "time_publish", lambda d: 0.0)
    rc, result, oom, disk = dryrun.run_one(cfg, tmp_path / "prep", 2, True, tmp_path, tmp_path / "dryrun.log")
    if fails:
        assert (rc, result, disk) == (1, None, full)
        assert json.loads((folder / "result.json").read_text()) == {"earlier": True}
        assert (tmp_path / "dryrun" / "A.failed" / "job.json").exists()
    else:
        assert rc == 0 and result["new"] and disk is None
        assert json.loads((folder / "result.json").read_text()) == {"new": True}
    assert not (tmp_path / "dryrun" / "A.earlier").exists()


@pytest.mark.parametrize("error", [
    RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space left on device\" })"),
    Exception("No space left on device (os error 28)"),  # a tokenizer's save (the Rust tokenizers)
])
def test_a_full_disk_in_a_librarys_own_error_type_is_one_line_too(monkeypatch, capsys, error):
    """safetensors and tokenizers raise their own types on a full disk (a trial's `export`
    printed 20 lines of traceback): the verb ends with the same one line, exit 1."""
    from tuneledger import cli, export

    def full(args):
        raise error

    monkeypatch.setattr(export, "run", full)
    assert cli.main(["export", "runs/x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tuneledger export: disk full: ") and "then run the same command again" in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_presets_earlier_result_survives_a_stop_and_a_kill_9(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM mid-preset puts the earlier folder back at once; a kill -9 leaves it as
    `<preset>.earlier`, which the next run puts back before it sets the folder aside again (a trial
    lost it: the second stopped run renamed its empty folder over it)."""
    import tuneledger.dryrun as dryrun
    from tuneledger.config import resolve

    cfg = resolve(load_config(None, {"model_name_or_path": "m", "dataset": ["d.json"], "quantization_bit": None,
                                     "preset": "A"}), 2)
    dry = tmp_path / "dryrun"
    (dry / "A").mkdir(parents=True)
    (dry / "A" / "result.json").write_text('{"earlier": true}')

    def stopped(job, job_path, *a, **kw):
        job_path.parent.mkdir(parents=True, exist_ok=True)
        job_path.write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(dryrun, "run_workers", stopped)
    for _ in range(2):  # stopped twice in a row: the earlier result is still there
        with pytest.raises(KeyboardInterrupt):
            dryrun.run_one(cfg, tmp_path / "prep", 2, True, tmp_path, tmp_path / "dryrun.log")
        assert json.loads((dry / "A" / "result.json").read_text()) == {"earlier": True}
        assert (dry / "A.failed" / "job.json").exists() and not (dry / "A.earlier").exists()
    # a kill -9 mid-preset: the earlier folder set aside, the new one without a result; the next
    # dry-run puts it back at its start, whichever presets it measures (a re-trial ran C next)
    (dry / "A").rename(dry / "A.earlier")
    (dry / "A").mkdir()
    (dry / "A" / "job.json").write_text("{}")
    assert dryrun.put_back_earlier(dry) == ["A"]
    assert json.loads((dry / "A" / "result.json").read_text()) == {"earlier": True} and not (dry / "A.earlier").exists()

    def fails(job, job_path, *a, outcome, **kw):
        job_path.parent.mkdir(parents=True, exist_ok=True)
        job_path.write_text("{}")
        outcome["causes"] = []
        return 1

    monkeypatch.setattr(dryrun, "run_workers", fails)
    assert dryrun.run_one(cfg, tmp_path / "prep", 2, True, tmp_path, tmp_path / "dryrun.log")[1] is None
    assert json.loads((dry / "A" / "result.json").read_text()) == {"earlier": True}

    def works(job, job_path, *a, outcome, **kw):
        job_path.parent.mkdir(parents=True, exist_ok=True)
        Path(job["result_path"]).write_text("{}")
        outcome["causes"] = []
        return 0

    monkeypatch.setattr(dryrun, "run_workers", works)
    monkeypatch.setattr(dryrun, "time_publish", lambda d: 0.0)
    dryrun.run_one(cfg, tmp_path / "prep", 2, True, tmp_path, tmp_path / "dryrun.log")
    assert sorted(p.name for p in dry.iterdir()) == ["A"]  # measured: no .earlier, no .failed left


def test_preflight_counts_tokenizer_files_and_the_extra_checkpoint(tiny_model, tmp_path):
    from tuneledger.preflight_checks import check_disk, checkpoint_bytes, checkpoint_estimate, tokenizer_bytes
    from tuneledger.model import read_model_config

    cfg = train_cfg(tmp_path / "run", model_name_or_path=str(tiny_model))
    config = read_model_config(str(tiny_model))
    one, basis = checkpoint_estimate(cfg, config)
    assert tokenizer_bytes(str(tiny_model)) > 11_000_000  # Qwen2.5's tokenizer.json is saved in every checkpoint
    assert one > checkpoint_bytes(cfg, config) + 11_000_000 and "tokenizer" in basis
    assert "4 checkpoints" in check_disk(cfg, config)  # save_total_limit 3 + the one written before rotation
    assert "room for 2 checkpoints at once (the dry-run's timed save" in check_disk(cfg, config, dryrun=True)
    # A real checkpoint of the run replaces the estimate, and those it holds are already on disk.
    real = fake_checkpoint(tmp_path / "run", 2)
    assert checkpoint_estimate(cfg, config) == (ck.size_of(real), "measured on checkpoint-2")
    assert "3 checkpoints" in check_disk(cfg, config)


def test_preflight_names_a_nearly_full_disk_in_mb(tiny_model, tmp_path, monkeypatch):
    """Under 1 GB free the line says MB: "0.0 GB free" read as no room at all while the check passed."""
    import shutil

    from tuneledger import preflight_checks
    from tuneledger.model import read_model_config

    cfg = train_cfg(tmp_path / "run", model_name_or_path=str(tiny_model))
    config = read_model_config(str(tiny_model))
    one, _ = preflight_checks.checkpoint_estimate(cfg, config)
    free = max(int(one * 4 * 1.1) + 1, 40_000_000)
    monkeypatch.setattr(preflight_checks.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12 - free, free))
    line = preflight_checks.check_disk(cfg, config)
    assert line.startswith(f"disk: {free / 1e6:.0f} MB free at ") and free < 1e9, line


# ------------------------------------------------------------------- item 9: the grace period
STUBBORN_PARENT = textwrap.dedent("""
    import subprocess, sys, time
    # A "rank" that ignores SIGTERM (a step that never ends), in its own session as torchrun starts them.
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(300)"],
                             start_new_session=True, stdout=subprocess.PIPE, text=True)
    child.stdout.readline()
    print(child.pid, flush=True)
    child.wait()
""")


def test_ranks_that_do_not_stop_within_the_grace_period_are_killed():
    from tuneledger.launch import _child_pids, _Stopper

    torchrun = subprocess.Popen([sys.executable, "-c", STUBBORN_PARENT], stdout=subprocess.PIPE, text=True)
    rank = int(torchrun.stdout.readline())
    assert _child_pids(torchrun.pid) == [rank]
    stopper = _Stopper(torchrun, grace_s=1.0)
    stopper.handle(signal.SIGTERM, None)  # as the launcher's handler: SIGTERM to the ranks, then the grace period
    assert stopper.signal == "SIGTERM"
    torchrun.wait(timeout=60)
    stopper.timer.join(timeout=60)
    assert stopper.killed == "not stopped within stop_grace_period_s=1 s of SIGTERM"
    deadline = time.monotonic() + 60
    while Path(f"/proc/{rank}").exists() and open(f"/proc/{rank}/stat").read().split()[2] != "Z":
        assert time.monotonic() < deadline, "the rank outlived the grace period"
        time.sleep(0.05)


def test_step_health_reads_the_step_log_and_the_adapter():
    from types import SimpleNamespace

    import torch

    from tuneledger.guards import step_health

    m = torch.nn.Linear(4, 4)
    m.bias.requires_grad_(False)
    with torch.no_grad():
        m.weight.fill_(0.5)
        m.weight[0, 0] = -3.0
        m.bias.fill_(1e30)  # frozen: not the adapter's
    state = SimpleNamespace(global_step=2, log_history=[{"loss": 9.0, "step": 1}, {"loss": 2.5, "grad_norm": 0.7, "step": 2}])
    assert step_health(m, state) == {"loss": 2.5, "grad_norm": 0.7, "max_abs_weight": 3.0, "finite_weights": True}
    with torch.no_grad():
        m.weight[1, 1] = float("nan")
    h = step_health(m, state)
    assert h["finite_weights"] is False and ck.unhealthy(h)


@pytest.mark.parametrize("valid, val_size, train, needle", [
    (3, 0.0, 3, "3 training records in d.jsonl are fewer than one global batch (global_batch_size=16)"),
    (20, 0.5, 10, "10 training records (20 valid, 10 held out by val_size=0.5)"),
])
def test_fewer_records_than_one_global_batch_is_refused_before_launch(tmp_path, valid, val_size, train, needle):
    """stats, dryrun and train share the gate: it names the counts and the batch that would work."""
    from tuneledger.prepare import Prepared
    from tuneledger.stats import gate

    cfg = load_config(None, {"model_name_or_path": "m", "dataset": ["d.jsonl"], "global_batch_size": 16,
                             "val_size": val_size})
    report = {"records": {"total": valid, "valid": valid, "invalid": 0, "invalid_by_reason": {}},
              "train_records": train}
    why = gate(Prepared(tmp_path, report, [], False), cfg, world=2)
    fits = train // 2 * 2
    assert why and needle in why and f"The largest global batch that works on 2 ranks is {fits}: global_batch_size={fits}" in why
    assert load_config(None, {"model_name_or_path": "m", "dataset": ["d.jsonl"], "global_batch_size": fits,
                              "per_device_train_batch_size": 1})  # the advice is a config that loads
    assert "fewer than the 4 ranks too: add data, or run on 3 ranks or fewer" in gate(
        Prepared(tmp_path, {**report, "train_records": 3}, [], False), cfg, world=4)
    one = gate(Prepared(tmp_path, {**report, "train_records": 1}, [], False), cfg, world=4)
    assert one.startswith("1 training record ") and "d.jsonl is fewer than one global batch" in one and "It is fewer than the 4 ranks too: add data, or run on 1 rank" in one
    report["train_records"] = 16
    assert gate(Prepared(tmp_path, report, [], False), cfg, world=2) is None


def test_a_second_ctrl_c_is_named_as_such_not_as_the_grace_period():
    from tuneledger.launch import _Stopper

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stopper = _Stopper(proc, grace_s=120)
    stopper.handle(signal.SIGINT, None)
    stopper.handle(signal.SIGINT, None)
    proc.wait(timeout=30)
    stopper.timer.cancel()
    assert stopper.killed.startswith("a second Ctrl-C 0.") and "after the first SIGINT" in stopper.killed
    assert "stop_grace_period_s" not in stopper.killed


@pytest.mark.parametrize("rc, outcome, clean, ckpts, want", [
    (124, {"signal": "SIGTERM", "killed": "not stopped within stop_grace_period_s=120 s of SIGTERM"}, True, "good",
     "the ranks were killed (not stopped within stop_grace_period_s=120 s of SIGTERM). The last good checkpoint is checkpoint-2"),
    (-9, {"signal": None, "killed": None}, True, "good",
     "torchrun exited -9 without this command being signalled (killed?)"),
    (1, {"signal": None, "killed": None, "causes": ["rank 0: OSError: [Errno 28] No space left on device: /r/checkpoint-2"]},
     False, "none", "a rank failed (exit 1): rank 0: OSError: [Errno 28] No space left on device: /r/checkpoint-2. "
     "No checkpoint was saved: the same command starts over."),
    (1, {"signal": None, "killed": None, "causes": []}, False, "damaged", "No checkpoint verifies: the same command refuses"),
])
def test_the_last_line_of_a_failed_train_says_what_happened_and_what_to_do(tmp_path, rc, outcome, clean, ckpts, want):
    from tuneledger.train import failure_line

    run = tmp_path / "run"
    run.mkdir()
    if ckpts == "good":
        fake_checkpoint(run, 2)
    elif ckpts == "damaged":
        (fake_checkpoint(run, 2) / "optimizer.pt").unlink()
    line = failure_line(rc, outcome, clean, run, run / "train.log")
    assert want in line and line.startswith("tuneledger train: ") and line.endswith(f"The log is {run / 'train.log'}.")
    assert ("resumes from" in line) == (ckpts == "good")


def test_the_final_adapter_is_published_at_the_run_root_as_llamafactory_leaves_it(tmp_path):
    run = tmp_path / "run"
    c = fake_checkpoint(run, 4)
    (c / "tokenizer.json").write_text("{}")
    names = ck.publish_final(c, run)
    assert "adapter_model.safetensors" in names and "tokenizer.json" in names and "adapter_config.json" in names
    assert not {"optimizer.pt", "scheduler.pt", "rng_state_0.pth", ck.MANIFEST} & set(names)
    assert (run / "adapter_model.safetensors").read_bytes() == (c / "adapter_model.safetensors").read_bytes()
    assert json.loads((run / ck.FINAL).read_text())["checkpoint"] == "checkpoint-4"
    assert not list(run.glob(".*.tmp")) and ck.problem(c) is None  # the checkpoint itself is untouched
    (c / "adapter_model.safetensors").write_bytes(b"x" * 10)  # a later publish replaces, never appends
    c2 = fake_checkpoint(run, 6)
    ck.publish_final(c2, run)
    assert (run / "adapter_model.safetensors").read_bytes() == (c2 / "adapter_model.safetensors").read_bytes()


def test_a_damaged_final_checkpoint_loads_its_verified_copy_at_the_root(tmp_path, capsys):
    """The newest checkpoint damaged after training (a trial truncated its adapter): export and chat
    took the older checkpoint while the root's copy of the final one was whole. The root copy is
    used when it matches the damaged checkpoint's own manifest, with a warning; a root copy that
    does not match falls back to the newest checkpoint that verifies, as before."""
    from tuneledger.checkpoints import find_checkpoint

    run = tmp_path / "run"
    older = fake_checkpoint(run, 2)
    final = fake_checkpoint(run, 4)
    ck.publish_final(final, run, finished=True)
    (final / "adapter_model.safetensors").write_bytes(b"")
    assert find_checkpoint(run) == run
    assert "checkpoint-4 does not verify" in capsys.readouterr().err
    (run / "adapter_model.safetensors").write_bytes(b"x")  # the root copy damaged too
    assert find_checkpoint(run) == older
    err = capsys.readouterr().err
    # Why, then which one is used instead, and what that means.
    assert "the run's final adapter (checkpoint-4) does not verify (" in err, err
    assert (f"nor does its copy at {run}/: using checkpoint-2, the newest checkpoint that verifies (an earlier step "
            "than the run's end)") in err, err


def test_stats_names_the_invalid_file_it_really_wrote(tmp_path, capsys):
    """Beside another run's data, the records go to invalid-<key>.jsonl: the line must say so."""
    from tuneledger.data import Invalid
    from tuneledger.prepare import Prepared
    from tuneledger.stats import print_invalid, write

    run = tmp_path / "run"
    run.mkdir()
    (run / "job.json").write_text(json.dumps({"data_path": str(tmp_path / "cache" / "otherkey")}))
    cfg = load_config(None, {"model_name_or_path": "m", "dataset": ["d.jsonl"], "output_dir": str(run)})
    report = {"cache_key": "thiskey", "records": {"total": 2, "valid": 1, "invalid": 1, "invalid_by_reason": {}}}
    prep = Prepared(tmp_path, report, [Invalid("d.jsonl:2", "output", "empty")], False)
    print_invalid(prep, cfg)
    write(prep, cfg)
    out = capsys.readouterr().out
    assert f"(all of them in {run / 'invalid-thiskey.jsonl'})" in out
    assert "d.jsonl:2" in (run / "invalid-thiskey.jsonl").read_text() and not (run / "invalid.jsonl").exists()


def test_a_refused_dryrun_on_other_data_leaves_the_runs_stats_alone(tmp_path):
    from tuneledger.prepare import Prepared
    from tuneledger.stats import write

    run = tmp_path / "run"
    run.mkdir()
    (run / "dryrun.json").write_text(json.dumps({"data_hash": "firstkey"}))
    (run / "stats.json").write_text('{"cache_key": "firstkey"}')
    cfg = load_config(None, {"model_name_or_path": "m", "dataset": ["other.jsonl"], "output_dir": str(run)})
    report = {"cache_key": "otherkey", "records": {"total": 1, "valid": 1, "invalid": 0, "invalid_by_reason": {}}}
    path = write(Prepared(tmp_path, report, [], False), cfg, gate_passed=False, training=True)
    assert path.name == "stats-otherkey.json" and json.loads((run / "stats.json").read_text())["cache_key"] == "firstkey"


def test_unfilled_placeholders_name_the_override_that_fills_them(tmp_path):
    from tuneledger.data import Invalid
    from tuneledger.prepare import Prepared
    from tuneledger.stats import gate

    cfg = load_config(None, {"model_name_or_path": "m", "dataset": ["identity.json"], "global_batch_size": 1})
    inv = [Invalid(f"identity.json#{i}", "output", f"unfilled placeholder {{{{{k}}}}}: set placeholders: ...",
                   "unfilled placeholder") for i, k in enumerate(["name", "author", "name"])]
    report = {"records": {"total": 4, "valid": 1, "invalid": 3, "invalid_by_reason": {"unfilled placeholder": 3}},
              "train_records": 1}
    why = gate(Prepared(tmp_path, report, inv, False), cfg)
    assert "fill the placeholders: placeholders.author=... placeholders.name=..." in why
    assert "max_invalid_ratio=0.75" in why  # the smallest value that passes: the gate refuses above it
    for invalid, total, want in ((1, 3, "0.34"), (1, 2, "0.5"), (3, 5, "0.6"), (99, 100, "0.99")):
        report["records"] |= {"total": total, "valid": total - invalid, "invalid": invalid}
        why = gate(Prepared(tmp_path, report, inv, False), cfg)
        assert why.endswith(f"max_invalid_ratio={want}"), why
        ok = load_config(None, {"model_name_or_path": "m", "dataset": ["identity.json"], "global_batch_size": 1,
                                "max_invalid_ratio": float(want)})
        assert not (gate(Prepared(tmp_path, report, inv, False), ok) or "").startswith(f"{invalid} of {total}")


def test_export_and_chat_load_only_checkpoints_that_verify(tmp_path, capsys):
    """Given a checkpoint folder itself, or a run whose checkpoints are all bad, the loader names
    what is wrong instead of merging damaged weights (a fresh tester's find)."""
    from tuneledger.checkpoints import LoadError, find_checkpoint

    run = tmp_path / "run"
    good = fake_checkpoint(run, 2)
    flipped = fake_checkpoint(run, 4)
    f = flipped / "adapter_model.safetensors"
    f.write_bytes(bytes([f.read_bytes()[0] ^ 1]) + f.read_bytes()[1:])
    with pytest.raises(LoadError, match="checkpoint-4 does not verify: .*content hash"):
        find_checkpoint(flipped)
    assert find_checkpoint(run) == good
    assert "checkpoint-4 skipped:" in capsys.readouterr().err
    ck.write_manifest(good, 2, {"loss": 1.0, "grad_norm": 1.0, "max_abs_weight": 1e30, "finite_weights": True})
    with pytest.raises(LoadError, match="no checkpoint of .* verifies: .*checkpoint-2: .*not good"):
        find_checkpoint(run)


def test_a_resumed_run_saves_and_logs_at_the_commands_intervals_not_the_checkpoints():
    """transformers restores save/logging/eval steps from the checkpoint's trainer_state.json; a
    trial's resume with save_steps=2 kept saving every 5. StepsFromArgs puts the command's back
    when training begins (after the state is loaded); a fraction is of max_steps."""
    from types import SimpleNamespace

    from transformers import TrainerState

    from tuneledger.trainer import StepsFromArgs

    state = TrainerState(max_steps=40, save_steps=5, logging_steps=10, eval_steps=5)  # as the checkpoint had them
    StepsFromArgs().on_train_begin(SimpleNamespace(save_steps=2, logging_steps=0.1, eval_steps=None), state, None)
    assert (state.save_steps, state.logging_steps, state.eval_steps) == (2, 4, 5)


def test_a_rank_left_waiting_by_a_dead_one_is_told_apart():
    """A rank in a collective when another dies gets gloo's or NCCL's connection error: the worker
    says it in one line instead of 30 lines of frames (the dead rank's own error is the cause)."""
    from tuneledger.worker import peer_lost

    assert peer_lost(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                                  "[127.0.0.1]:60000"))
    assert peer_lost(RuntimeError("NCCL error: remote process exited or there was a network error"))
    assert not peer_lost(RuntimeError("CUDA error: an illegal memory access was encountered"))


def test_a_dryruns_full_disk_message_speaks_of_the_dryrun(tmp_path):
    """The dry-run's one timed save told the user to lower save_total_limit and that the run
    'starts over': a training's advice. Each says what its own command does next."""
    from tuneledger.guards import disk_full_message

    dry = disk_full_message(tmp_path / "dryrun" / "A" / "checkpoint-6", None, None, dryrun=True)
    assert dry.endswith("The dry-run times one real save: free space, then run the same command again.")
    assert "save_total_limit" not in dry
    train = disk_full_message(tmp_path / "checkpoint-20", 2**20, tmp_path / "checkpoint-10")
    assert f"The last good checkpoint, {tmp_path / 'checkpoint-10'}, is kept." in train and "1,048,576 bytes" in train


def test_an_export_from_an_earlier_checkpoint_says_which_final_it_stands_in_for(tmp_path):
    """export.json's `instead_of_final`: the run's final checkpoint when neither it nor its root copy
    verified and an earlier one was exported; None when the final one (or its root copy) was."""
    from tuneledger.checkpoints import find_checkpoint
    from tuneledger.export import instead_of_final

    run = tmp_path / "run"
    older = fake_checkpoint(run, 2)
    final = fake_checkpoint(run, 4)
    ck.publish_final(final, run, finished=True)
    assert instead_of_final(run, find_checkpoint(run)) is None  # checkpoint-4 itself
    (final / "adapter_model.safetensors").write_bytes(b"")
    assert instead_of_final(run, find_checkpoint(run)) is None  # its copy at the root
    (run / "adapter_model.safetensors").write_bytes(b"x")
    assert find_checkpoint(run) == older and instead_of_final(run, older) == "checkpoint-4"
    assert instead_of_final(older, older) is None  # a checkpoint named directly: no run's final to stand in for


def test_an_export_of_the_root_copy_names_its_run_and_step(tmp_path):
    """The root copy stands in for a damaged final checkpoint: its step is the one tuneledger_final.json
    names (a re-trial's export.json said step null and the run's parent folder as its run)."""
    from tuneledger.checkpoints import find_checkpoint
    from tuneledger.loading import checkpoint_step

    run = tmp_path / "run"
    fake_checkpoint(run, 2)
    final = fake_checkpoint(run, 4)
    ck.publish_final(final, run, finished=True)
    (final / "adapter_model.safetensors").write_bytes(b"")
    assert find_checkpoint(run) == run and checkpoint_step(run) == 4
    assert checkpoint_step(final) == 4 and checkpoint_step(tmp_path) is None
