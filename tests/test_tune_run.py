"""`tuneledger tune` running: candidates measured, the --levers phase, bad input before any run,
stops (SIGTERM, kill -9), failed candidates and the docs' example (test_tune.py: the space and
the ranking)."""

import json
import os
import sys
from pathlib import Path

import pytest

import procs
from tuneledger import tune_space as ts
from tuneledger.config import ConfigError

from test_tune import measured

ROOT = Path(__file__).resolve().parents[1]


def tl(*args):
    return procs.run([sys.executable, "-m", "tuneledger", *args], env={**os.environ}, cwd=ROOT)


def job(tmp_path, tiny_model):
    return [str(ROOT / "configs" / "tiny.yaml"), f"model_name_or_path={tiny_model}", f"output_dir={tmp_path / 'run'}",
            f"cache_dir={tmp_path / 'cache'}", "max_samples=32", "cutoff_len=128", "global_batch_size=4"]


def test_levers_are_key_value_speed_levers_and_make_variants_of_the_pick():
    assert ts.parse_levers(None) == []
    for empty in ("", " "):  # an empty --levers is bad input, as "," is, not "no levers"
        with pytest.raises(ConfigError, match="--levers '.*': empty; give one or more key=value"):
            ts.parse_levers(empty)
    assert ts.parse_levers("grouped_lora=true, torch_compile=false") == [{"grouped_lora": "true"}, {"torch_compile": "false"}]
    both = ts.parse_levers("absmax_once=true + drop_padding_mask=true,grouped_lora=true")
    assert both == [{"absmax_once": "true", "drop_padding_mask": "true"}, {"grouped_lora": "true"}]
    assert ts.lever_text(both[0]) == "absmax_once=true+drop_padding_mask=true"
    for bad, says in (("grouped_lora", "is not key=value"), ("lora_rank=8", "'lora_rank' is not a speed lever"),
                      ("grouped_lora=", "is not key=value"), ("grouped_lora=true+", "'' is not key=value"),
                      ("absmax_once=true+absmax_once=false", "'absmax_once' is set twice"),
                      ("grouped_lora=true,absmax_once=true,grouped_lora=true", "'grouped_lora=true' is asked for twice")):
        with pytest.raises(ConfigError, match=says):
            ts.parse_levers(bad)
    pick = measured(next(c for c in ts.build_space(16, 1, 1024, [2], [False], [False]) if c.key == (2, False, False)),
                    100, 0.9, 1.1)
    v = ts.lever_variants(pick, [{"grouped_lora": "true"}, {"torch_compile": "false"}, both[0]])
    assert [c.levers for c in v] == [{"grouped_lora": "true"}, {"torch_compile": "false"}, both[0]]
    assert v[2].overrides()[-2:] == ["absmax_once=true", "drop_padding_mask=true"]
    assert v[2].short == "mb2-nogc-pad+absmax_once=true+drop_padding_mask=true"
    assert all(c.status == "planned" and not c.presets and c.units == pick.units for c in v)
    assert v[0].overrides()[-1] == "grouped_lora=true" and v[0].short == "mb2-nogc-pad+grouped_lora=true"
    assert v[0].key != pick.key and v[0].label.endswith(", grouped_lora=true")
    measured(v[0], 120, 0.9, 1.0)
    assert "grouped_lora: true" in ts.snippet(v[0], 16, 1, 80.0) and "grouped_lora" not in ts.snippet(pick, 16, 1, 80.0)


def test_the_levers_are_tried_on_the_pick_in_what_is_left_of_the_budget(tmp_path, monkeypatch, capsys):
    import argparse

    from tuneledger import tune

    ran = []

    def run_candidate(c, k, items, args, cpu, nproc, tune_dir, cap):
        ran.append((k, c.short))
        row = fake_row(c, 10 * 1024)
        row["tokens_per_s"] = 1e4 if c.levers else row["tokens_per_s"]
        return row, False, "log"

    monkeypatch.setattr(tune, "run_candidate", run_candidate)
    args = argparse.Namespace(memory_gib=None)
    space = ts.build_space(4, 1, 128, [1], [True], [False])
    info = tune.search(space, [], args, False, 1, tmp_path, None, 80.0)
    pick = ts.rank(space)["pick"]
    items = [str(ROOT / "configs" / "tiny.yaml"), "model_name_or_path=m", "lora_dropout=0"]
    variants = tune.try_levers(space, [{"grouped_lora": "true"}], info, items, args, False, 1, tmp_path, None, 80.0)
    assert ran[-1] == (len(space) + 1, f"{pick.split(' ')[0]}+grouped_lora=true") and variants[0].status == "measured"
    assert ts.rank(space + variants)["pick"] == variants[0].short  # a faster variant becomes the pick
    # a variant the pick's own settings cannot run, or one that would change nothing, is not measured
    ran.clear()
    gc_pick = next(c for c in space if c.gradient_checkpointing and c.status == "measured")
    monkeypatch.setattr(ts, "rank", lambda cands: {"pick": gc_pick.short})
    skipped = tune.try_levers(space, [{"grouped_lora": "true"}], info, [*items, "torch_compile=true"], args, False, 1,
                              tmp_path, None, 80.0)
    assert skipped[0].status == "not measured" and "gradient checkpointing inside compiled layers" in skipped[0].reason
    cpp = tune.try_levers(space, [{"compile_cpp_wrapper": "true"}], info, [*items, "torch_compile=false"], args, True, 1,
                          tmp_path, None, 80.0)
    assert cpp[0].status == "not measured" and ran == []
    # A variant of several levers is skipped only when none of them would change anything here.
    both = tune.try_levers(space, [{"compile_cpp_wrapper": "true", "absmax_once": "true"},
                                   {"compile_cpp_wrapper": "true", "drop_padding_mask": "true"}],
                           info, items, args, True, 1, tmp_path, None, 80.0)  # on a CPU, compile is off
    assert both[0].status == "not measured" and "C++ wrapper" in both[0].reason and "absmax_once" in both[0].reason
    assert both[1].status == "measured" and ran == [(len(space) + 2, both[1].short)]
    n = len(space) + 2  # the variant not measured keeps its number in the progress lines, with why
    assert f"tune [{len(space) + 1}/{n}] {both[0].short}: not measured: nothing is compiled here" in capsys.readouterr().out
    same = tune.try_levers(space, [{"compile_cpp_wrapper": "false"}, {"compile_cpp_wrapper": "false", "absmax_once": "true"}],
                           info, items, args, True, 1, tmp_path, None, 80.0)  # the job's own value: nothing to measure
    assert same[0].status == same[1].status == "not measured" and len(ran) == 1
    assert same[0].reason == "the job already runs with compile_cpp_wrapper=false" and "absmax_once" in same[1].reason
    monkeypatch.undo()
    info["elapsed_s"] = 100.0
    late = tune.try_levers(space, [{"grouped_lora": "true"}], info, items, args, False, 1, tmp_path, 60.0, 80.0)
    assert late[0].status == "not measured" and "budget ran out before the levers" in late[0].reason


def test_bad_input_exits_2_before_any_run(tmp_path):
    # No model is needed: the command line is checked first.
    base = [str(ROOT / "configs" / "tiny.yaml"), f"output_dir={tmp_path / 'run'}", "global_batch_size=4", "--nproc", "1", "--cpu"]
    p = tl("tune", *base, "--budget", "abc")
    assert p.returncode == 2 and "--budget 'abc'" in p.stderr
    p = tl("tune", *base, "--micro-batches", "1,3")
    assert p.returncode == 2 and "3 does not divide global batch 4" in p.stderr
    p = tl("tune", *base, "--levers", "grouped_lora=maybe")
    assert p.returncode == 2 and "grouped_lora" in p.stderr, p.stderr
    p = tl("tune", *base, "lora_dropout=0.05", "--levers", "grouped_lora=true")  # a lever the job cannot run
    assert p.returncode == 2 and "--levers grouped_lora=true: " in p.stderr, p.stderr
    assert "configs/tiny.yaml + overrides" in p.stderr and "grouped_lora: true needs lora_dropout 0" in p.stderr, p.stderr
    p = tl("tune", *base, "--levers", "")
    assert p.returncode == 2 and "--levers '': empty" in p.stderr, p.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["nan", "inf", "Infinity", "0", "-3"])
def test_a_memory_budget_that_is_not_a_finite_number_above_0_is_refused(value, capsys):
    from tuneledger import cli

    assert cli.main(["tune", f"--memory-gib={value}", "--cpu"]) == cli.BAD_INPUT
    err = capsys.readouterr().err
    assert f"--memory-gib {float(value):g}: must be a finite number above 0" in err, err


def test_a_second_tune_in_the_same_run_folder_is_refused_before_any_run(tmp_path):
    from tuneledger.runlock import RunLock

    base = [str(ROOT / "configs" / "tiny.yaml"), f"output_dir={tmp_path / 'run'}", "global_batch_size=4", "--nproc", "1", "--cpu"]
    with RunLock(tmp_path / "run" / "tune", "tune.lock"):  # the first tune, still searching
        p = tl("tune", *base)
    assert p.returncode == 1 and f"{tmp_path / 'run' / 'tune'} is in use by pid {os.getpid()}" in p.stderr, p.stderr
    assert "Two tunes in one run directory overwrite each other's candidates" in p.stderr
    assert not list((tmp_path / "run" / "tune").glob("cand-*"))


@pytest.mark.e2e
@pytest.mark.slow  # seven short dry-runs: minutes on 2 cores
def test_tune_on_the_cpu_ranks_measured_candidates_and_picks_the_fastest(tmp_path, tiny_model):
    """The space (mb 1-2 x packing, GC on, and presets C and D), then --levers: its pick measured
    again with grouped_lora=false (one search, one run: CI's 2 cores pay for one)."""
    p = tl("tune", *job(tmp_path, tiny_model), "--micro-batches", "1,2", "--gc", "on", "--nproc", "1", "--cpu",
           "--levers", "grouped_lora=false", "lora_dropout=0", "dryrun_steps=4", "dryrun_warmup_steps=1")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    tune = tmp_path / "run" / "tune"
    led = json.loads((tune / "tune.json").read_text())
    space, variant = led["candidates"][:-1], led["candidates"][-1]
    cands = {c["short"]: c for c in space}
    # mb 1-2 x packed/padded with GC on, plus presets C and D (GC off) from outside the asked space.
    assert len(cands) == 6 and sorted(p for c in cands.values() for p in c["presets"]) == ["A", "B", "C", "D"]
    done = [c for c in cands.values() if c["status"] == "measured"]
    assert len(done) == 6 and led["not_measured"] == [] and led["pruned"] == []
    everything = {**cands, variant["short"]: variant}
    speeds = [everything[s]["result"]["tokens_per_s"] for s in led["ranking"]["order"]]
    assert speeds == sorted(speeds, reverse=True) and len(speeds) == 7
    pick, fastest = everything[led["ranking"]["pick"]], everything[led["ranking"]["fastest"]]
    assert fastest["result"]["tokens_per_s"] == max(c["result"]["tokens_per_s"] for c in [*done, variant])
    # the pick is the fastest, or one tied with it (p10-p90 overlap) that needs less memory
    tied = [t["with"] for t in led["ranking"]["ties"]]
    assert pick is fastest or (pick["short"] in tied and pick["result"]["peak_rss_mib"] <= fastest["result"]["peak_rss_mib"])
    best_preset = max(c["result"]["tokens_per_s"] for c in done if c["presets"])
    assert fastest["result"]["tokens_per_s"] >= best_preset
    assert pick["result"]["fits"] is None and led["memory_budget_gib"] is None  # CPU: memory not checked
    assert f"per_device_train_batch_size: {pick['micro_batch']}" in led["snippet"]
    assert f"packing: {str(pick['packing']).lower()}" in led["snippet"] and "global_batch_size: 4" in led["snippet"]
    assert led["finding"].startswith(fastest["short"]) and pick["short"] in led["finding"]
    for c in done:
        assert c["micro_batch"] * c["accumulation"] == 4 and c["result"]["steps_measured"] == 3
    md = (tune / "tune.md").read_text()
    assert "```yaml" in md and "| order | candidate |" in md and "**pick**" in md
    assert p.stdout.count("tune [") >= 14 and "tune [7/7]" in p.stdout and "budget" in p.stdout
    assert (tune / "cand-1" / "dryrun.json").is_file() and (tune / "tune.png").is_file() and led["plot"].endswith("tune.png")
    # --levers: the space's pick (the fastest, or one tied with it) again with grouped_lora off, as cand-7
    space_pick = max(done, key=lambda c: c["result"]["tokens_per_s"])
    assert variant["levers"] == {"grouped_lora": "false"} and variant["status"] == "measured", variant
    assert (variant["micro_batch"], variant["gradient_checkpointing"], variant["packing"]) in {
        (c["micro_batch"], c["gradient_checkpointing"], c["packing"]) for c in done}
    # grouped_lora is on where it applies (lora_dropout 0 here): the variant measures the pick without it
    assert variant["result"]["levers"]["grouped_lora"] == "off"
    assert space_pick["result"]["levers"]["grouped_lora"].startswith("on (")
    assert (tune / "cand-7" / "dryrun.json").is_file()
    assert "with each of grouped_lora=false" in p.stdout and led["levers_tried"] == ["grouped_lora=false"]
    assert ("grouped_lora: false" in led["snippet"]) == (led["ranking"]["pick"] == variant["short"])
    assert "then the pick with each of: grouped_lora=false" in md


def test_preset_f_is_refused_before_any_run(tmp_path):
    base = [str(ROOT / "configs" / "tiny.yaml"), f"output_dir={tmp_path / 'run'}", "global_batch_size=4", "--nproc", "1", "--cpu"]
    for extra in ("preset=F", "fsdp=full_shard auto_wrap"):
        p = tl("tune", *base, extra)
        assert p.returncode == 2 and "tune searches the DDP settings" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def _procs_under(path, also: str = "") -> list[str]:
    """The pids whose command line names `path` (and holds `also`)."""
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # a process that ended while we looked
            continue
        if str(path) in text and also in text:
            out.append(cmdline.parent.name)
    return out


@pytest.mark.e2e
@pytest.mark.slow
def test_sigterm_stops_the_running_candidate_and_writes_what_was_measured(tmp_path, tiny_model):
    import signal
    import subprocess
    import time

    cmd = [sys.executable, "-m", "tuneledger", "tune", *job(tmp_path, tiny_model), "--micro-batches", "1,2", "--gc", "on",
           "--packing", "off", "--nproc", "1", "--cpu", "dryrun_steps=40", "dryrun_warmup_steps=1"]
    out = tmp_path / "tune.out"
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(out, "w"), stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while "measuring" not in out.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.2)
        # until the candidate's dry-run has started its ranks
        while not (tmp_path / "run" / "tune" / "cand-1" / "dryrun.log").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 143, out.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.read_text()
    assert "SIGTERM: the running candidate was stopped; writing the tune ledger" in text, text[-3000:]
    led = json.loads((tmp_path / "run" / "tune" / "tune.json").read_text())
    assert led["stopped"]["signal"] == "SIGTERM" and led["stopped"]["measured"] == 0 and led["stopped"]["not_measured"] == 4
    assert [c["status"] for c in led["candidates"]] == ["terminated (SIGTERM)"] * 4  # docs/runs-and-output.md's word
    assert "nothing was measured" in led["snippet"] and "fits" not in led["snippet"]
    time.sleep(2)
    left = _procs_under(tmp_path / "run" / "tune")
    assert not left, f"a candidate's processes were left running: pids {left}"


def fake_row(c: ts.Candidate, peak_mib: float) -> dict:
    tps = 100.0 * c.micro_batch * (1.1 if not c.gradient_checkpointing else 1.0)
    return {"tokens_per_s": tps, "tokens_per_step": tps, "s_per_step": 1.0, "steps_measured": 4, "warmup_steps_excluded": 2,
            "step_spread": {"median": 1.0, "p10": 0.99, "p90": 1.01, "sd": 0.01}, "tokens_per_s_per_gpu": tps, "mfu": 0.3,
            "memory_mib": [{"peak_allocated": peak_mib, "peak_rss": None}], "gpu_window": {"util_mean_pct": 90.0},
            "diagnosis": {"bottleneck": "compute-bound", "line": "compute-bound: ...", "lever": "-"}, "eta": {"total_s": 60.0}}


def test_the_search_prunes_by_measured_peaks_and_stops_at_the_time_budget(tmp_path, monkeypatch, capsys):
    import argparse

    from tuneledger import tune

    # 10 GiB + 2 GiB per 1024 units: a GC-on micro-batch of 8 at cutoff 1024 needs 26 GiB.
    def run_candidate(c, k, items, args, cpu, nproc, tune_dir, cap):
        ran.append(c.key)
        return fake_row(c, (10 + 2 * c.units / 1024) * 1024), False, "log"

    ran: list = []
    monkeypatch.setattr(tune, "run_candidate", run_candidate)
    args = argparse.Namespace(memory_gib=24.0)
    space = ts.build_space(16, 1, 1024, [1, 2, 4, 8, 16], [True], [False])
    info = tune.search(space, [], args, False, 1, tmp_path, None, 24.0)
    by = {c.key: c for c in space}
    assert by[(8, True, False)].status == by[(16, True, False)].status == "pruned"
    d = by[(8, False, True)]  # preset D: needs at least C's memory, which did not fit
    assert d.status == "pruned" and "needs at least the memory of mb2-nogc-pad (=C)" in d.reason
    assert info["pruned"] == [by[(8, True, False)].short, by[(16, True, False)].short, d.short]
    assert (8, True, False) not in ran and by[(4, True, False)].result["fits"] is True
    # Preset C (GC off) was measured: over budget, it is ranked as not fitting.
    assert by[(2, False, False)].result["fits"] is False and ts.rank(space)["pick"] == by[(4, True, False)].short
    out = capsys.readouterr().out
    assert "tune [1/" in out and "pruned mb8-gc-pad: estimated" in out

    ran.clear()
    space = ts.build_space(16, 1, 1024, [1, 2], [True], [False])
    tune.search(space, [], args, True, 1, tmp_path, 1e-9, None)  # the budget is spent after the first
    assert len(ran) == 1 and [c.status for c in space].count("not measured") == len(space) - 1
    assert "budget ran out" in space[-1].reason


def test_a_missing_matplotlib_costs_the_picture_only(tmp_path, monkeypatch, capsys):
    from tuneledger import tune

    space = ts.build_space(4, 1, 128, [1], [True], [False])
    measured(space[0], 100, 0.9, 1.1)
    space[0].result.update(tokens_per_s_p10=90.0, tokens_per_s_p90=110.0, peak_rss_mib=1000)
    assert tune.plot(space, tmp_path / "t.png", "t", None) == tmp_path / "t.png" and (tmp_path / "t.png").is_file()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert tune.plot(space, tmp_path / "u.png", "t", None) is None
    assert "WARNING: no picture" in capsys.readouterr().err and not (tmp_path / "u.png").exists()


def test_a_failed_or_out_of_memory_candidate_is_listed_with_why(tmp_path, monkeypatch):
    import argparse

    from tuneledger import tune

    log = tmp_path / "cand.log"
    log.write_text("tuneledger dryrun ...\ntuneledger dryrun: config error: boom\n\n")
    monkeypatch.setattr(tune, "run_candidate", lambda c, k, *a: (None, c.micro_batch > 1, str(log)))
    space = ts.build_space(2, 1, 128, [1, 2], [True], [False])
    tune.search(space, [], argparse.Namespace(memory_gib=None), False, 1, tmp_path, None, 80.0)
    by = {c.key: c for c in space}
    assert by[(1, True, False)].status == "failed" and "config error: boom" in by[(1, True, False)].reason
    assert by[(2, True, False)].status == "out of memory" and by[(2, True, False)].reason == "out of memory on the card"
    assert by[(2, False, True)].status == "pruned"  # preset D needs at least B's memory, which did not fit
    assert ts.rank(space)["pick"] is None and ts.finding(ts.rank(space), space).startswith("no measured candidate fits")


def test_a_negative_budget_after_a_space_gets_tunes_own_message(capsys):
    # argparse alone takes "-5m" for an option ("expected one argument"); the CLI glues it to
    # --budget so that tune's own check names the value. "--budget=-5m" gets the same message.
    from tuneledger import cli

    assert cli._glue_dashed_values(["tune", "--budget", "-5m", "x=1"]) == ["tune", "--budget=-5m", "x=1"]
    assert cli._glue_dashed_values(["tune", "--cpu", "--budget", "5m"]) == ["tune", "--cpu", "--budget", "5m"]
    assert cli.main(["tune", "--budget", "-5m", "--cpu"]) == cli.BAD_INPUT
    err = capsys.readouterr().err
    assert "--budget" in err and "expected one argument" not in err


def test_a_failed_candidates_error_is_its_end_cut_at_a_word(tmp_path, monkeypatch):
    import argparse

    from tuneledger import tune
    from tuneledger.tune_report import error_tail

    cmd = "tuneledger dryrun configs/tiny.yaml " + " ".join(f"per_device_train_batch_size={i}" for i in range(40))
    assert error_tail(cmd + "\n") == error_tail(cmd + "\n\n  \n") == "it printed nothing"  # never the command line
    long = "tuneledger dryrun: config error: " + " ".join(f"word{i}" for i in range(80)) + " the end"
    tail = error_tail(f"{cmd}\n{long}\n")
    assert tail.startswith("...word") and tail.endswith("word79 the end") and len(tail) <= 243
    assert f" {tail[3:]}" in long  # whole words from a word boundary, not the middle of one
    assert error_tail(f"{cmd}\nshort error\n") == "short error"
    log = tmp_path / "cand.log"
    log.write_text(cmd + "\n")  # a dry-run that printed nothing (killed at its start)
    monkeypatch.setattr(tune, "run_candidate", lambda c, k, *a: (None, False, str(log)))
    space = ts.build_space(1, 1, 128, [1], [True], [False])
    tune.search(space, [], argparse.Namespace(memory_gib=None), True, 1, tmp_path, None, None)
    assert space[0].reason == f"the dry-run failed (it printed nothing); see {log}"


def test_the_candidates_dry_run_dies_with_tune(tmp_path, monkeypatch):
    """kill -9 of tune must not leave its candidate measuring as an orphan: the dry-run starts with
    PR_SET_PDEATHSIG (launch.die_with_parent), as the dry-run starts torchrun."""
    import argparse
    import subprocess

    from tuneledger import launch, tune

    seen = {}

    class Proc:
        def __init__(self, cmd, **kwargs):
            seen.update(kwargs)

        def wait(self, timeout=None):
            return 1

    monkeypatch.setattr(subprocess, "Popen", Proc)
    space = ts.build_space(1, 1, 128, [1], [True], [False])
    tune.run_candidate(space[0], 1, ["x.yaml"], argparse.Namespace(), True, 1, tmp_path, None)
    assert seen["preexec_fn"] is launch.die_with_parent


@pytest.mark.e2e
@pytest.mark.slow  # one candidate's ranks started, then killed: about a minute on 2 cores
def test_kill_9_of_tune_takes_the_candidate_and_its_ranks_with_it(tmp_path, tiny_model):
    import contextlib
    import signal
    import subprocess
    import time

    cmd = [sys.executable, "-m", "tuneledger", "tune", *job(tmp_path, tiny_model), "--micro-batches", "1", "--gc", "on",
           "--packing", "off", "--nproc", "1", "--cpu", "dryrun_steps=200", "dryrun_warmup_steps=1"]
    out = tmp_path / "tune.out"
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(out, "w"), stderr=subprocess.STDOUT, text=True)
    cand = tmp_path / "run" / "tune" / "cand-1"
    try:
        deadline = time.monotonic() + 600
        # until the candidate's rank runs (the worker's job file is under cand-1)
        while not _procs_under(cand, "-u -m tuneledger.worker"):  # the rank (torchrun names the worker too)
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.2)
        assert len(_procs_under(cand)) >= 3  # the dry-run, torchrun, the rank
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 180  # the dry-run stops its ranks (SIGTERM) and writes its ledger
    while _procs_under(tmp_path / "run" / "tune") and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _procs_under(tmp_path / "run" / "tune")
    for pid in left:  # an orphan must not outlive the test either
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGTERM)
    assert not left, f"kill -9 of tune left its candidate's processes running: pids {left}"
    assert "terminated (SIGTERM)" in (tmp_path / "run" / "tune" / "cand-1.log").read_text()


def _stopped_tune(tmp_path, tiny_model, monkeypatch, stop_at: int, *extra: str) -> tuple[int, dict, str]:
    """`tuneledger tune` in this process on the tiny job (4 candidates: presets A-D), each candidate
    a fake measurement, with SIGTERM arriving while cand-`stop_at` runs. Returns (exit code,
    tune.json, tune.md)."""
    import signal

    from tuneledger import cli, tune

    def run_candidate(c, k, items, args, cpu, nproc, tune_dir, cap):
        if k == stop_at:
            signal.raise_signal(signal.SIGTERM)  # tune's handler: the search stops here
        return fake_row(c, 1024), False, str(tune_dir / f"cand-{k}.log")

    monkeypatch.setattr(tune, "run_candidate", run_candidate)
    rc = cli.main(["tune", *job(tmp_path, tiny_model), "--micro-batches", "1", "--gc", "on", "--packing", "off",
                   "--nproc", "1", "--cpu", *extra])
    tune_dir = tmp_path / "run" / "tune"
    return rc, json.loads((tune_dir / "tune.json").read_text()), (tune_dir / "tune.md").read_text()


def test_a_search_stopped_by_sigterm_says_it_is_not_the_searchs_answer(tmp_path, tiny_model, monkeypatch, capsys):
    rc, led, md = _stopped_tune(tmp_path, tiny_model, monkeypatch, 2, "--memory-gib", "24")
    out = capsys.readouterr().out
    assert rc == 143
    assert led["stopped"] == {"signal": "SIGTERM", "measured": 1, "candidates": 4, "not_measured": 3}
    said = "stopped by SIGTERM after 1 of 4 candidates: the fastest measured so far, not the search's answer"
    assert led["finding"].startswith(said + "; mb1-gc-pad (=A) is fastest")
    assert "no point of the space beat it" not in led["finding"] and "no measured point beat it" in led["finding"]
    assert led["snippet"].startswith(f"# tuneledger tune, {said}\n") and "per_device_train_batch_size: 1" in led["snippet"]
    assert f"**Finding:** {said}" in md and f"**{said}** (3 not measured)" in md and f"**Finding:** {said}" in out
    # the running candidate and the ones not reached: the dry-run's word (docs/runs-and-output.md)
    rest = [c for c in led["candidates"] if c["status"] != "measured"]
    assert [c["status"] for c in rest] == ["terminated (SIGTERM)"] * 3 and len(led["not_measured"]) == 3
    assert rest[0]["reason"].startswith("its dry-run was stopped by SIGTERM before it finished (")
    assert rest[1]["reason"] == "not reached: the search was stopped by SIGTERM"
    # --memory-gib on a CPU run: said to be unchecked, not shown as no budget
    assert "tune: --memory-gib 24 is not checked on a CPU run" in out and "memory budget none" not in out
    assert "memory budget not checked (CPU; --memory-gib 24 not applied)" in md


def test_a_search_stopped_before_any_measurement_says_nothing_was_measured(tmp_path, tiny_model, monkeypatch, capsys):
    rc, led, md = _stopped_tune(tmp_path, tiny_model, monkeypatch, 1)
    assert rc == 143 and led["pick"] is None
    assert led["stopped"] == {"signal": "SIGTERM", "measured": 0, "candidates": 4, "not_measured": 4}
    assert led["snippet"] == "# tuneledger tune, stopped by SIGTERM after 0 of 4 candidates: nothing was measured\n"
    assert "fits" not in led["snippet"] and "fits" not in led["finding"]
    assert led["finding"] == "stopped by SIGTERM after 0 of 4 candidates: nothing was measured, so there is nothing to pick."
    assert "memory not checked (CPU)" in capsys.readouterr().out
    from tuneledger.tune_report import no_pick_snippet

    space = ts.build_space(2, 1, 128, [1], [True], [False])
    for c in space:
        c.status = "failed"
    assert no_pick_snippet(space, None).startswith("# nothing was measured: no pick")
    measured(space[0], 100, 0.9, 1.1, peak=30.0, fits=False)
    assert no_pick_snippet(space, None) == "# no measured candidate fits the memory budget: no pick\n"


def test_a_lever_left_on_auto_that_the_pick_ran_with_is_not_measured_again(tmp_path, monkeypatch, capsys):
    import argparse

    from tuneledger import tune

    ran = []

    def run_candidate(c, k, items, args, cpu, nproc, tune_dir, cap):
        ran.append(c.short)
        row = fake_row(c, 1024)
        row["model"] = {"levers": {"fused_lora": "on (12 projections)", "liger": "off", "compile": "off (a CPU run)"}}
        return row, False, "log"

    monkeypatch.setattr(tune, "run_candidate", run_candidate)
    args = argparse.Namespace(memory_gib=None)
    space = ts.build_space(4, 1, 128, [1], [True], [False])
    info = tune.search(space, [], args, True, 1, tmp_path, None, None)
    items = [str(ROOT / "configs" / "tiny.yaml"), "model_name_or_path=m", "lora_dropout=0"]
    ran.clear()
    v = tune.try_levers(space, [{"fused_lora": "true"}, {"torch_compile": "false"}, {"fused_lora": "false"}],
                        info, items, args, True, 1, tmp_path, None, None)
    assert v[0].status == "not measured" and v[0].reason.startswith("the job already runs with fused_lora on (unset: auto")
    assert v[1].status == "not measured" and "torch_compile off" in v[1].reason
    assert v[2].status == "measured" and ran == [v[2].short]  # off is a change from what ran
    assert ts.already_runs("fused_lora", "true", True, None, None) is None  # no ledger line: measured, not guessed
    assert ts.already_runs("grouped_lora", "false", False, False, None) == "the job already runs with grouped_lora=false"
    left = {"drop_padding_mask": "off (padding on the left: the mask is needed)"}
    assert ts.already_runs("drop_padding_mask", "true", True, None, left).startswith("drop_padding_mask cannot apply to this job")
    assert ts.already_runs("drop_padding_mask", "true", True, None, {"drop_padding_mask": "off"}) is None


def test_the_lever_phase_says_what_is_left_of_the_whole_budget(tmp_path, monkeypatch, capsys):
    import argparse
    import re

    from tuneledger import tune

    monkeypatch.setattr(tune, "run_candidate", lambda c, k, *a: (fake_row(c, 1024), False, "log"))
    args = argparse.Namespace(memory_gib=None)
    space = ts.build_space(4, 1, 128, [1], [True], [False])
    info = tune.search(space, [], args, True, 1, tmp_path, 240.0, None)
    info["elapsed_s"] = 74.0  # 2 min 46 s of the 4 min left
    items = [str(ROOT / "configs" / "tiny.yaml"), "model_name_or_path=m", "lora_dropout=0"]
    capsys.readouterr()
    v = tune.try_levers(space, [{"grouped_lora": "true"}], info, items, args, True, 1, tmp_path, 240.0, None, keep=space)
    out = capsys.readouterr().out
    assert re.search(r"tune \[5/5\] .*: measuring; 2 min 4\d s of the 4 min 00 s budget left", out), out
    assert space[-1] is v[0] and len(space) == 5  # kept in the space as it is measured (a stop keeps it), still cand-5


def test_the_docs_name_every_lever_and_their_make_tune_example_runs_on_both_shipped_configs():
    import re
    import shlex

    from tuneledger.config_load import from_cli

    doc = (ROOT / "docs" / "tune.md").read_text()
    assert not [k for k in ts.LEVER_KEYS if f"`{k}`" not in doc], "docs/tune.md's --levers keys lack some of LEVER_KEYS"
    examples = re.findall(r'make tune [^\n]*ARGS="([^"]*)"', doc)
    assert examples
    for args in examples:
        words = shlex.split(args)
        levers = ts.parse_levers(words[words.index("--levers") + 1]) if "--levers" in words else []
        after = words.index("--levers") + 1 if "--levers" in words else None
        keys = [w for i, w in enumerate(words) if "=" in w and not w.startswith("-") and i != after]  # make passes ARGS after the config's keys
        for config in ("tiny.yaml", "qwen2.5-7b-qlora.yaml"):
            for variant in levers:  # the checks tune makes before any run (a lever at odds with the job: exit 2)
                from_cli([str(ROOT / "configs" / config), *keys, *(f"{k}={v}" for k, v in variant.items())])


def test_what_would_fail_every_candidate_fails_once_before_any(tmp_path, tiny_model, capsys):
    """A 4-bit job on a CPU (or a lora_target that is not a layer) ran every candidate to the same
    preflight error; tune now runs the preflight once, first."""
    from tuneledger import cli

    assert cli.main(["tune", *job(tmp_path, tiny_model), "quantization_bit=4", "--cpu", "--nproc", "1"]) == 1
    assert "quantization_bit=4 needs a CUDA GPU" in capsys.readouterr().err
    assert cli.main(["tune", *job(tmp_path, tiny_model), "lora_target=nosuch_proj", "--cpu", "--nproc", "1"]) == 1
    assert "lora_target: nosuch_proj: no such layer" in capsys.readouterr().err
    assert not list((tmp_path / "run").glob("tune/cand-*"))


def test_a_budget_stop_gives_each_candidate_left_its_numbered_line(tmp_path, monkeypatch, capsys):
    """The progress count never jumps: a stop names every candidate it leaves, out of the whole
    search's count (lever variants included), so [1/5] is followed by [2/5], not by [5/5]."""
    import argparse
    import time as _time

    from tuneledger import tune

    def slow(c, k, *a):
        _time.sleep(0.05)
        return fake_row(c, 1024), False, "log"

    monkeypatch.setattr(tune, "run_candidate", slow)
    space = ts.build_space(4, 1, 128, [1], [True], [False])
    tune.search(space, [], argparse.Namespace(memory_gib=None), True, 1, tmp_path, 0.01, None, total=len(space) + 1)
    out = capsys.readouterr().out
    n = len(space) + 1
    assert f"tune [1/{n}]" in out and space[0].status == "measured", out
    for k, c in enumerate(space[1:], 2):
        assert c.status == "not measured" and f"tune [{k}/{n}] {c.short}: not measured: the " in out, out


def test_the_lever_phase_keeps_the_budget_rules_of_the_space(tmp_path, monkeypatch, capsys):
    """The lever variants are the same search: one the budget stops gets its numbered line, and
    "the first candidate always runs" is the search's first, not the lever phase's again (a lever
    run started with 11 s left of a 2 min budget, past a typical 1 min 49 s candidate)."""
    import argparse

    from tuneledger import tune

    ran = []
    monkeypatch.setattr(tune, "run_candidate", lambda c, k, *a: (ran.append(k), (fake_row(c, 1024), False, "log"))[1])
    args = argparse.Namespace(memory_gib=None)
    items = [str(ROOT / "configs" / "tiny.yaml"), "model_name_or_path=m", "lora_dropout=0"]
    levers = [{"grouped_lora": "true"}, {"swiglu_recompute": "false"}]
    space = ts.build_space(4, 1, 128, [1], [True], [False])
    info = tune.search(space, [], args, True, 1, tmp_path, None, None)
    # some time left, less than a typical candidate took: no lever runs
    info.update(elapsed_s=100.0, walls=[30.0] * len(space))
    ran.clear()
    capsys.readouterr()
    v = tune.try_levers(space, levers, info, items, args, True, 1, tmp_path, 120.0, None)
    out = capsys.readouterr().out
    assert ran == [] and all(x.status == "not measured" for x in v), out
    n = len(space) + len(levers)
    for k, x in enumerate(v, len(space) + 1):
        assert f"tune [{k}/{n}] {x.short}: not measured: the 2 min 00 s budget ran out" in out, out
    # no time left at all: each variant still gets its line
    info["elapsed_s"] = 130.0
    v = tune.try_levers(space, levers, info, items, args, True, 1, tmp_path, 120.0, None)
    out = capsys.readouterr().out
    assert ran == [] and [f"tune [{k}/{n}]" in out for k in (n - 1, n)] == [True, True], out
    assert "budget ran out before the levers" in out
