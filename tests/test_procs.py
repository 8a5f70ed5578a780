"""tests/procs.py: a command that runs past its timeout leaves no process behind, not even one that
left the process group (as torchrun's workers do) or ignores SIGTERM."""

import os
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

import procs
from tuneledger.launch import free_port

# A launcher like `tuneledger train`: a child in its own group that forks a grandchild, and a child
# in a session of its own (start_new_session=True, as torchrun starts each worker) that ignores
# SIGTERM. Each leaf writes "pid sid" to pids/<name> and sleeps.
TREE = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    pids = sys.argv[1]
    def leaf(name):
        return [sys.executable, "-c", "import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                f"open(os.path.join({pids!r}, {name!r}), 'w').write(f'{{os.getpid()}} {{os.getsid(0)}}'); time.sleep(600)"]
    subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                      f"subprocess.Popen({leaf('grandchild')!r}); time.sleep(600)"])
    subprocess.Popen(leaf("own-session"), start_new_session=True)
    time.sleep(600)
""")

# torchrun itself, 2 workers that write "pid sid" and sleep (no torch import in the workers).
WORKER = textwrap.dedent("""
    import os, sys, time
    open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"]), "w").write(f"{os.getpid()} {os.getsid(0)}")
    time.sleep(600)
""")


def timed_out(cmd, pids: Path, expect: int, first_timeout: float) -> list[tuple[int, int]]:
    """Run `cmd` with procs.run until its timeout fires after all `expect` leaves wrote their pid
    (a loaded machine gets a doubled timeout and a fresh try); return the leaves' (pid, sid)."""
    timeout = first_timeout
    while True:
        for f in pids.glob("*"):
            f.unlink()
        with pytest.raises(pytest.fail.Exception, match=r"ran past .* killed its \d+ processes"):
            procs.run(cmd, timeout=timeout)
        written = [tuple(map(int, f.read_text().split())) for f in pids.glob("*") if f.read_text()]
        if len(written) == expect or timeout > 200:
            assert len(written) == expect, f"only {len(written)} of {expect} processes started in {timeout} s"
            return written
        timeout *= 2


def survivors(leaves: list[tuple[int, int]]) -> list[int]:
    """The leaves still alive half a second on; they are killed, so a failure leaves none behind."""
    time.sleep(0.5)
    alive = []
    for pid, _ in leaves:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:  # a zombie is dead, its parent not yet told
                alive.append(pid)
                p.kill()
        except psutil.NoSuchProcess:
            pass
    return alive


def test_timeout_kills_the_tree_even_outside_the_group(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    leaves = timed_out([sys.executable, "-c", TREE, str(pids)], pids, 2, first_timeout=3)
    by_sid = {sid for _, sid in leaves}
    assert len(by_sid) == 2  # one leaf really was outside the launcher's session: killpg alone misses it
    assert survivors(leaves) == []


def test_timeout_kills_torchrun_and_its_workers(tmp_path):
    """The case of the field: torchrun starts each worker in a session of its own."""
    pids = tmp_path / "pids"
    pids.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--nnodes=1", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(script), str(pids)]
    leaves = timed_out(cmd, pids, 2, first_timeout=20)
    assert all(sid == pid for pid, sid in leaves)  # each worker leads its own session
    assert survivors(leaves) == []


def test_a_command_that_ends_in_time_is_left_alone(tmp_path):
    p = procs.run([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                  timeout=600, cwd=tmp_path, env={**os.environ})
    assert (p.returncode, p.stdout, p.stderr) == (3, "out\n", "err\n")
