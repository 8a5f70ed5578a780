"""Run a command from a test, and on timeout leave nothing of it behind.

`tuneledger train` starts torchrun, and torchrun starts each worker with start_new_session=True
(torch.distributed.elastic's SubprocessHandler), so killing the command, or even its process
group, orphans the workers, and an orphaned rank keeps training on the CI machine's two cores.
On timeout `run` therefore freezes the whole tree first (SIGSTOP: no process can start another
between the listing and the kill), then SIGKILLs the process group and every descendant, whatever
session it is in.

The timeout is a guard against a hang, not a speed check: TIMEOUT_S (default 3600 s, three times
the slowest honest run seen under load, $TUNELEDGER_TEST_TIMEOUT to change, 0 for none).
"""

from __future__ import annotations

import os
import signal
import subprocess

import psutil
import pytest

TIMEOUT_S = float(os.environ.get("TUNELEDGER_TEST_TIMEOUT", 3600)) or None


def kill_tree(pid: int, wait_s: float = 10.0) -> list[int]:
    """SIGKILL process `pid`, its process group (when it leads one) and all its descendants,
    including those in sessions of their own. Returns the pids killed."""
    found: dict[int, psutil.Process] = {}
    try:
        todo = [psutil.Process(pid)]
    except psutil.NoSuchProcess:
        todo = []
    while todo:  # stop a parent before listing its children, so the list is complete
        p = todo.pop()
        if p.pid in found:
            continue
        try:
            p.suspend()
            found[p.pid] = p
            todo.extend(p.children())
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    try:
        os.killpg(pid, signal.SIGKILL)  # group members no longer children of `pid` (reparented)
    except (ProcessLookupError, PermissionError):
        pass
    for p in found.values():
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(list(found.values()), timeout=wait_s)
    return list(found)


def run(cmd: list[str], timeout: float | None = TIMEOUT_S, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, **kwargs) in a new session; on timeout
    kills the whole tree (kill_tree) and fails the test with the output so far."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        killed = kill_tree(proc.pid)
        try:  # a survivor would hold the pipes open: say so rather than hang
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            out, err = "", "a process of the tree survived SIGKILL and holds its output pipes"
        pytest.fail(f"{' '.join(map(str, cmd[:6]))} ... ran past {timeout:.0f} s ($TUNELEDGER_TEST_TIMEOUT); "
                    f"killed its {len(killed)} processes\n{out[-3000:]}\n{err[-3000:]}")
    except BaseException:  # Ctrl-C in pytest, or a failure: never leave the tree running
        kill_tree(proc.pid)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
