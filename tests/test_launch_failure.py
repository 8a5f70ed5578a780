"""The launcher's one-line cause of a failed run (tuneledger.rank_output.FailureReader)."""

from tuneledger.rank_output import FailureReader

# What torchrun 2.5 printed when a tester kill -9'ed rank 1 of a 2-rank CPU training (abridged).
KILLED_RANK_1 = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "/x/torch/distributed/distributed_c10d.py", line 2501, in all_reduce
[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by peer
Traceback (most recent call last):
  File "/x/torch/distributed/run.py", line 919, in main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
tuneledger.trainer FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-30_21:20:01
  host      : vm
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 31001)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_21:20:00
  host      : vm
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 31002)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 31002
============================================================
"""


def test_a_killed_rank_is_named_first_and_the_lost_connection_after():
    r = FailureReader()
    for line in KILLED_RANK_1.splitlines(keepends=True):
        r.feed(line)
    causes = r.causes()
    assert causes[0].startswith("rank 1 was killed by SIGKILL (signal 9): the kernel's out-of-memory killer")
    assert len(causes) == 2 and "Connection reset by peer" in causes[1]


def test_a_python_error_alone_is_said_once():
    r = FailureReader()
    for rank in (0, 1):
        r.feed(f"[rank{rank}]: ValueError: bad batch\n")
    assert r.causes() == ["ValueError: bad batch"]
