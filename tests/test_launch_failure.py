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


def test_torchruns_table_is_one_line_on_the_terminal_and_whole_in_the_log(tmp_path):
    """tuneledger.torchrun prints its table of failed ranks after "torchrun: ChildFailedError:";
    the terminal gets a pointer to the log (which the launcher writes whole), the lines around it
    as they are; without a log, or cut short, the table is shown."""
    from tuneledger.rank_output import FailureTable

    table = "torchrun: ChildFailedError:\n" + KILLED_RANK_1.split("ChildFailedError:\n", 1)[1]
    text = "rank 0: stopped: another rank died\n" + table + "after\n"
    table_filter = FailureTable(tmp_path / "train.log")
    shown = "".join(table_filter.shown(line) for line in text.splitlines(keepends=True))
    assert shown == ("rank 0: stopped: another rank died\n"
                     f"launch: torchrun's table of the failed ranks is in {tmp_path / 'train.log'}\nafter\n")
    no_log = FailureTable(None)
    assert "".join(no_log.shown(line) for line in text.splitlines(keepends=True)) == text
    cut = FailureTable(tmp_path / "train.log")
    held = "".join(cut.shown(line) for line in table.splitlines(keepends=True)[:5])
    assert held == "" and cut.shown("") == "".join(table.splitlines(keepends=True)[:5])
