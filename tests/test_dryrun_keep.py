"""dryrun_keep's logs: the ledger's own log survives whatever the runs after it do (a kill -9 at
any point, then a stop or a failure), and each run's log is findable by name."""

from __future__ import annotations

import json

from tuneledger.dryrun_keep import failed_log, keep_earlier_log, kept_log_words, mark_log, marked, start_log


def _run(d, text, date=None):
    """A dry-run's life: start, write its log; with `date` it also writes the ledger and marks."""
    log, ledger = d / "dryrun.log", d / "dryrun.json"
    earlier = start_log(log, ledger)
    log.write_text(log.read_text() + text)
    if date:
        mark_log(log, date)
        ledger.write_text(json.dumps({"date": date}))
    return log, earlier


def test_a_killed_run_then_a_stopped_one_keep_the_ledgers_log(tmp_path):
    # A trial: complete run, kill -9, then SIGTERM: "left as it was with its log dryrun.log", and
    # dryrun.log was the killed run's two lines; the ledger's log was gone.
    log, _ = _run(tmp_path, "the ledger's run\n", date="2026-12-06T21:00:00+00:00")
    assert marked(log, "2026-12-06T21:00:00+00:00")
    _run(tmp_path, "killed run\n")  # kill -9: no ledger, no mark, no end
    assert (tmp_path / "dryrun.log.1").read_text().startswith("the ledger's run")
    log, earlier = _run(tmp_path, "stopped run\n")  # its start sets the killed log aside
    assert (tmp_path / "dryrun.unfinished.log").read_text() == "killed run\n"
    assert earlier == tmp_path / "dryrun.log.1" and earlier.read_text().startswith("the ledger's run")
    moved = keep_earlier_log(log, earlier)  # stopped, measured nothing: the earlier ledger stays
    assert log.read_text().startswith("the ledger's run") and moved.read_text() == "stopped run\n"
    assert kept_log_words(log, moved) == (f" with its log dryrun.log; this run's log is {moved} (the lines above "
                                          "that name dryrun.log meant that file)")
    assert (tmp_path / "dryrun.unfinished.log").read_text() == "killed run\n"  # a failed run's log goes elsewhere


def test_a_run_stopped_between_its_mark_and_its_ledger_is_not_taken_for_the_ledgers(tmp_path):
    # A second trial: killed right after the ledger write, before the mark: the ledger's own log was
    # set aside, then overwritten. The mark now comes first, so the only window leaves the old ledger.
    _run(tmp_path, "the ledger's run\n", date="d1")
    log = tmp_path / "dryrun.log"
    start_log(log, tmp_path / "dryrun.json")
    log.write_text("stopped before its ledger\n")
    mark_log(log, "d2")  # killed here: dryrun.json still says d1
    log, earlier = _run(tmp_path, "next\n")
    assert (tmp_path / "dryrun.unfinished.log").read_text().startswith("stopped before its ledger")
    assert earlier.read_text().startswith("the ledger's run")


def test_logs_from_before_the_marks_move_to_dot_one_as_they_did(tmp_path):
    (tmp_path / "dryrun.json").write_text(json.dumps({"date": "d0"}))
    (tmp_path / "dryrun.log").write_text("unmarked, the ledger's\n")
    (tmp_path / "dryrun.log.1").write_text("unmarked, older\n")
    earlier = start_log(tmp_path / "dryrun.log", tmp_path / "dryrun.json")
    assert earlier.read_text() == "unmarked, the ledger's\n" and not (tmp_path / "dryrun.unfinished.log").exists()


def test_runs_that_write_the_ledger_move_the_log_before_them_to_dot_one(tmp_path):
    _run(tmp_path, "first\n", date="d1")
    _run(tmp_path, "second\n", date="d2")
    log, earlier = _run(tmp_path, "third\n")
    assert earlier.read_text().startswith("second") and log.read_text() == "third\n"
    assert not failed_log(log).exists()


def test_the_first_run_and_other_nodes(tmp_path):
    assert start_log(tmp_path / "dryrun.log", tmp_path / "dryrun.json") is None
    assert (tmp_path / "dryrun.log").read_text() == ""
    (tmp_path / "dryrun.json").write_text(json.dumps({"date": "d1"}))
    node = tmp_path / "dryrun.node1.log"  # a node that writes no ledger: its log is never marked
    node.write_text("node 1 run\n")
    (tmp_path / "dryrun.node1.log.1").write_text("older\n")
    assert start_log(node, tmp_path / "dryrun.json", first_node=False) == tmp_path / "dryrun.node1.log.1"
    assert (tmp_path / "dryrun.node1.log.1").read_text() == "node 1 run\n"
    assert keep_earlier_log(tmp_path / "x.log", None) is None and kept_log_words(tmp_path / "x.log", None) == ""


def test_a_signal_after_the_presets_is_held_until_the_ledger_is_written():
    # A second trial: Ctrl-C while the dry-run built its ledger (after the last preset) exited 130
    # with nothing written and nothing said. From SignalHold.start on, SIGINT and SIGTERM are recorded.
    import subprocess
    import sys

    code = ("import os, signal\n"
            "from tuneledger.launch import SignalHold\n"
            "before = signal.getsignal(signal.SIGINT)\n"
            "with SignalHold() as hold:\n"
            "    hold.start()\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    print('ledger written', hold.held)\n"
            "print(signal.getsignal(signal.SIGINT) is before)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.split("\n")[:2] == ["ledger written [2, 15]", "True"], p.stdout + p.stderr
