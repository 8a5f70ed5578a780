"""What a user reads: step progress, and no line without information."""

import argparse
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from tuneledger.progress import LogLine, StepProgress, log_line, progress_line


def test_train_progress_line():
    assert progress_line("train tiny", 30, 1000, 2.5) == "train tiny: step 30/1000, 2.50 s/step so far; ETA 40 min 25 s"


def test_dryrun_progress_line_says_its_estimate_covers_the_running_preset_only():
    """Issue 21 (11): "~3 min more" while A ran, when later presets stepped twice as slow. A preset's
    step time does not predict another's, so the line estimates this preset and says the rest are out."""
    line = progress_line("dry-run preset B (2 of 4)", 2, 6, 10.0, later_presets=2, dryrun=True)
    assert line == ("dry-run preset B (2 of 4): step 2/6, 10.00 s/step so far; this preset ~0 min 40 s more "
                    "(2 more presets after it, not in this estimate: each steps at its own speed)")
    assert progress_line("dry-run preset A (1 of 2)", 2, 6, 10.0, later_presets=1, dryrun=True).endswith(
        "(1 more preset after it, not in this estimate: each steps at its own speed)")
    assert progress_line("dry-run preset D (4 of 4)", 5, 6, 10.0, dryrun=True).endswith("this preset ~0 min 10 s more (the last)")
    assert "the dry-run ~" not in line
    # Said on a preset's first line; the lines after it would repeat it word for word.
    assert progress_line("dry-run preset B (2 of 4)", 3, 6, 10.0, later_presets=2, dryrun=True, first=False) == (
        "dry-run preset B (2 of 4): step 3/6, 10.00 s/step so far; this preset ~0 min 30 s more")


def test_step_progress_prints_first_last_and_throttled(capsys, monkeypatch):
    import tuneledger.progress as progress

    clock = iter([0.0, 10.0, 11.0, 12.0, 30.0])  # step 1 at 10 s, 2 and 3 within 10 s, 4 (the last) at 30 s
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    cb = StepProgress("dry-run preset A (1 of 1)", every_s=10.0, later_presets=0, started_wall=None)
    state = SimpleNamespace(global_step=0, max_steps=4, is_world_process_zero=True)
    cb.on_step_begin(None, state, None)
    for step in range(1, 5):
        state.global_step = step
        cb.on_step_end(None, state, None)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["dry-run preset A (1 of 1): step 1/4, 10.00 s/step so far; ETA 0 min 30 s",
                     "dry-run preset A (1 of 1): step 4/4, 7.50 s/step so far; ETA 0 min 00 s"]


def test_a_training_prints_its_eta_not_a_dry_runs(capsys, monkeypatch):
    """A training's launcher also gives the start time (for "ready after"); its step line still says
    ETA, never "this preset" or "the dry-run"."""
    import time

    import tuneledger.progress as progress

    clock = iter([0.0, 30.0])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    cb = StepProgress("train tiny", started_wall=time.time() - 20)
    state = SimpleNamespace(global_step=0, max_steps=40, is_world_process_zero=True)
    cb.on_step_begin(None, state, None)
    state.global_step = 1
    cb.on_step_end(None, state, None)
    assert capsys.readouterr().out == "train tiny: step 1/40, 30.00 s/step so far; ETA 19 min 30 s\n"


def test_a_resumed_runs_eta_counts_this_process_steps_only(capsys, monkeypatch):
    """Issue 21 (4): after a resume from checkpoint-500 of 1000, the rate is over the steps this
    process did (global_step at on_train_begin is the start), the rest is max_steps - global_step:
    step 501 after 20 s is 20 s/step with 499 left, not 20/501 s/step."""
    import tuneledger.progress as progress

    clock = iter([100.0, 120.0, 130.0, 200.0])  # steps 501, 502 (within every_s) and 510
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    cb = StepProgress("train r", every_s=30.0)
    state = SimpleNamespace(global_step=500, max_steps=1000, is_world_process_zero=True)
    cb.on_train_begin(None, state, None)
    # The start is on_train_begin's global_step, whatever the first step hook sees.
    state.global_step = 503
    cb.on_step_begin(None, state, None)
    for step in (501, 502, 510):
        state.global_step = step
        cb.on_step_end(None, state, None)
    assert capsys.readouterr().out.splitlines() == [
        "train r: ready; 500 steps to run",
        f"train r: step 501/1000, 20.00 s/step so far; ETA {progress.fmt_h(499 * 20.0)}",
        f"train r: step 510/1000, 10.00 s/step so far; ETA {progress.fmt_h(490 * 10.0)}"]
    assert progress.fmt_h(499 * 20.0) == "2 h 46 min"


def test_other_ranks_keep_the_same_start_on_a_resume():
    """on_train_begin records the start on every rank (only rank 0 prints)."""
    cb = StepProgress("train r")
    state = SimpleNamespace(global_step=40, max_steps=100, is_world_process_zero=False)
    cb.on_train_begin(None, state, None)
    cb.on_step_begin(None, state, None)
    assert cb._first_step == 40


def test_only_rank_zero_prints(capsys):
    cb = StepProgress("train r")
    state = SimpleNamespace(global_step=0, max_steps=4, is_world_process_zero=False)
    cb.on_step_begin(None, state, None)
    state.global_step = 1
    cb.on_step_end(None, state, None)
    assert capsys.readouterr().out == ""


def test_dryrun_heading_names_the_preset_once_and_passes_progress(monkeypatch, capsys):
    import tuneledger.dryrun as dryrun
    from tuneledger.config import ConfigError, resolve
    from tuneledger.config_load import load_config

    seen = []

    def fake_run_one(cfg, prep_path, nproc, cpu, out_root, log, cap_gib=None, progress=None, **kw):
        seen.append(progress)
        return 1, None, False, None

    monkeypatch.setattr(dryrun, "run_one", fake_run_one)
    base = {"model_name_or_path": "m", "dataset": ["d.json"], "quantization_bit": None}
    planned = [("A", resolve(load_config(None, {**base, "preset": "A"}), 2)), ("B", ConfigError("not divisible")),
               ("C", resolve(load_config(None, {**base, "preset": "C"}), 2))]
    rows = []
    dryrun.measure_presets(argparse.Namespace(no_fit_check=True), planned, 2, True, SimpleNamespace(path="p"), {}, None,
                           "log", rows, {})
    out = capsys.readouterr().out
    assert "=== [1/2] preset A: micro-batch 1" in out and "=== [2/2] preset C: micro-batch 2" in out
    assert "preset A: preset A" not in out
    assert [p["label"] for p in seen] == ["dry-run preset A (1 of 2)", "dry-run preset C (2 of 2)"]
    assert [p["later_presets"] for p in seen] == [1, 0] and not any("earlier_s" in p for p in seen)


def test_a_preset_that_meets_a_full_disk_stops_the_dryrun_and_names_the_rest(monkeypatch, capsys):
    import tuneledger.dryrun as dryrun
    from tuneledger.config import resolve
    from tuneledger.config_load import load_config

    ran = []
    full = "DiskFullError: [Errno 28] disk full while saving run/dryrun/A/checkpoint-6: a checkpoint needs more"

    def fake_run_one(cfg, *a, **kw):
        ran.append(cfg.preset)
        return 1, None, False, full

    monkeypatch.setattr(dryrun, "run_one", fake_run_one)
    base = {"model_name_or_path": "m", "dataset": ["d.json"], "quantization_bit": None}
    planned = [(p, resolve(load_config(None, {**base, "preset": p}), 2)) for p in "ABC"]
    rows = []
    dryrun.measure_presets(argparse.Namespace(no_fit_check=True), planned, 2, True, SimpleNamespace(path="p"), {}, None,
                           "log", rows, {})
    out = capsys.readouterr().out
    assert ran == ["A"]  # B and C would meet the same disk after their model load
    assert "preset A: the disk is full (the worker error above); B, C after it are not measured" in out
    assert rows == [{"preset": "A", "skipped": f"disk full: {full}"},
                    {"preset": "B", "skipped": "not measured: the disk was full"},
                    {"preset": "C", "skipped": "not measured: the disk was full"}]


def test_bitsandbytes_cpu_kernel_message_is_dropped_at_its_logger():
    from tuneledger import quiet

    quiet.install()
    quiet.install()  # idempotent
    got = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append(record.getMessage())

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    handler = Keep()
    logger.addHandler(handler)
    try:
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure", "offline")
        logger.warning("something else entirely")
    finally:
        logger.removeHandler(handler)
    assert got == ["something else entirely"]


def test_special_tokens_aligned_before_the_trainer_leaves_it_nothing_to_say():
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.trainer_utils import align_special_tokens as hf_align
    from transformers.utils import logging as hf_logging

    from tuneledger.model import align_special_tokens

    model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, vocab_size=200, bos_token_id=1, eos_token_id=2))
    tok = SimpleNamespace(eos_token_id=7, bos_token_id=None, pad_token_id=5)  # Qwen2.5 after load_tokenizer: no bos
    align_special_tokens(model, tok)
    assert model.config.pad_token_id == 5 and model.generation_config.eos_token_id[0] == 7
    assert 2 in model.generation_config.eos_token_id  # the model's own eos still stops generation

    got = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append(record.getMessage())

    logger = hf_logging.get_logger("transformers.trainer_utils")
    handler = Keep()
    logger.addHandler(handler)
    try:
        hf_align(model, tok)  # what Trainer.train() runs on every rank
    finally:
        logger.removeHandler(handler)
    assert not [m for m in got if "PAD/BOS/EOS" in m]


def test_run_loss_weights_each_log_by_the_steps_it_covers():
    from tuneledger.ledger import run_loss

    # logging_steps 5, a crash after checkpoint 12, resumed there, logs at 15 and at the last step 17.
    history = [{"loss": 4.0, "step": 5}, {"loss": 3.0, "step": 10}, {"learning_rate": 1e-4, "step": 10},
               {"loss": 2.0, "step": 15}, {"loss": 1.0, "step": 17}]
    got = run_loss(history, resumed_step=12)
    assert got["steps_covered"] == 5 + 5 + 3 + 2  # steps 11-12 ran before the crash and were never logged
    assert got["mean"] == pytest.approx((4 * 5 + 3 * 5 + 2 * 3 + 1 * 2) / 15)
    assert got["last"] == 1.0 and got["last_step"] == 17
    assert run_loss([]) == {"mean": None, "last": None, "last_step": 0, "steps_covered": 0}


def test_train_prints_one_loss():
    from tuneledger.train import loss_text

    assert loss_text({"train_loss": 2.5, "last_logged_loss": 1.25, "last_logged_step": 17, "global_step": 17,
                      "loss_steps_covered": 15}) == "loss 2.5000 (mean over the 15 logged of the run's 17 steps), last 1.2500 at step 17"
    assert loss_text({"train_loss": None, "global_step": 3}) == "no loss was logged"


def test_final_metrics_drop_transformers_train_loss():
    from tuneledger.trainer import LedgerTrainer

    seen = []

    class Probe(LedgerTrainer):
        def __init__(self):  # only log() is exercised
            self.state = SimpleNamespace(global_step=4)

    import transformers

    orig = transformers.Trainer.log
    transformers.Trainer.log = lambda self, logs, *a, **k: seen.append(dict(logs))
    try:
        Probe().log({"train_runtime": 1.0, "train_loss": 11.86, "epoch": 1.0})
    finally:
        transformers.Trainer.log = orig
    assert seen == [{"train_runtime": 1.0, "epoch": 1.0}]


def test_step_progress_says_when_the_model_is_ready(capsys):
    import time

    cb = StepProgress("train r", started_wall=time.time() - 42)
    cb.on_train_begin(None, SimpleNamespace(global_step=2, max_steps=10, is_world_process_zero=True), None)
    out = capsys.readouterr().out
    assert out.startswith("train r: ready after 4") and out.endswith("(start-up and model load); 8 steps to run\n")


def test_the_same_verdict_for_every_preset_is_printed_once(capsys, monkeypatch):
    """A CPU dry-run has no GPU samples, so each preset's verdict is the same 'unknown' line."""
    from tuneledger import dryrun_report

    monkeypatch.setattr(dryrun_report, "table", lambda led: "")
    same = "unknown: GPU util unavailable"
    dryrun_report.print_table({"presets": [], "verdicts": {p: same for p in "ABCD"}})
    assert capsys.readouterr().out.strip().splitlines() == [f"VERDICT A, B, C, D: {same}"]
    dryrun_report.print_table({"presets": [], "verdicts": {"A": "compute-bound", "B": same}})
    assert capsys.readouterr().out.strip().splitlines() == ["VERDICT A: compute-bound", f"VERDICT B: {same}"]



def test_what_every_preset_shares_is_printed_once():
    """A fresh tester's CPU dry-run: four ~400-character levers lines that differ in one word, and
    four verdicts that differ only in their measured details."""
    from tuneledger.dryrun_report import common_lines, verdict_lines

    base = {"attention": "sdpa", "liger": "off (needs a CUDA GPU)", "lora_dropout": 0.05}
    levers = {p: dict(base) for p in "ABC"} | {"D": base | {"attention": "sdpa (packed rows under a block-diagonal mask)"}}
    assert common_lines("levers", levers) == [
        "levers A, B, C, D: liger off (needs a CUDA GPU); lora_dropout 0.05",
        "levers A, B, C: attention sdpa",
        "levers D: attention sdpa (packed rows under a block-diagonal mask)"]
    assert common_lines("levers", {p: dict(base) for p in "AB"}) == [
        "levers A, B: attention sdpa; liger off (needs a CUDA GPU); lora_dropout 0.05"]
    assert common_lines("levers", {"C": base}) == ["levers C: attention sdpa; liger off (needs a CUDA GPU); lora_dropout 0.05"]
    v = lambda mb: f"unknown: a CPU run measures no GPU [micro-batch {mb}; GC on] Lever: dry-run on the GPUs"  # noqa: E731
    assert verdict_lines({"A": v(1), "B": v(2), "C": "compute-bound [util 97%] Lever: none"}) == [
        "VERDICT A, B: unknown: a CPU run measures no GPU. Lever: dry-run on the GPUs",
        "  A: [micro-batch 1; GC on]", "  B: [micro-batch 2; GC on]",
        "VERDICT C: compute-bound [util 97%] Lever: none"]
    assert verdict_lines({"A": v(1), "B": v(1)}) == [f"VERDICT A, B: {v(1)}"]


def test_peak_memory_is_the_gpus_or_on_a_cpu_the_rss():
    from tuneledger.dryrun_report import peak_mib

    assert peak_mib({"memory_mib": [{"peak_allocated": 900, "peak_rss": 5000}, {"peak_allocated": 1200}]}) == "1,200"
    assert peak_mib({"memory_mib": [{"peak_allocated": None, "peak_rss": 1973}, {"peak_allocated": None, "peak_rss": 2100}]}) == "2,100 RSS"
    assert peak_mib({"memory_mib": [{"peak_allocated": None}]}) == "-"


def test_no_progress_bars_in_a_log_file(tmp_path, tiny_model):
    """Issue 21 (14): off a terminal, tqdm's redraws (carriage returns) left every state of the bar
    on one line of the log: `tokenizing 500 records: 0%| ... 13%| ... 100%|`."""
    import json
    import os
    import sys
    from pathlib import Path

    import procs

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    synth = procs.run([sys.executable, "-m", "tuneledger", "synth-model", "--arch", "tiny", str(tmp_path / "m")],
                      cwd=root, env=env)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) + "\n" for i in range(8)))
    stats = procs.run([sys.executable, "-m", "tuneledger", "stats", f"model_name_or_path={tiny_model}", f"dataset={data}",
                       f"output_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}", "quantization_bit=null",
                       "global_batch_size=2"], cwd=root, env=env)
    assert synth.returncode == stats.returncode == 0, synth.stderr + stats.stderr
    for p in (synth, stats):
        assert "\r" not in p.stdout + p.stderr and "%|" not in p.stderr
    assert "wrote " in stats.stdout  # it ran through: the tokenizing (a bar before) happened


def test_bars_are_off_only_off_a_terminal(monkeypatch):
    import io
    import os
    import sys

    from tuneledger import quiet

    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a pipe or a file: not a terminal
    quiet.no_bars_off_a_terminal()
    assert os.environ["TQDM_DISABLE"] == "1"
    monkeypatch.setenv("TQDM_DISABLE", "0")  # the user's own setting stands
    quiet.no_bars_off_a_terminal()
    assert os.environ["TQDM_DISABLE"] == "0"

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("TQDM_DISABLE")
    monkeypatch.setattr(sys, "stderr", Tty())
    quiet.no_bars_off_a_terminal()
    assert "TQDM_DISABLE" not in os.environ


def test_trainer_logs_print_as_lines_not_dicts(capsys):
    """Issue 21 (14): train.log showed PrinterCallback's raw `{'loss': ..., 'eta_h': ...}` dicts."""
    logs = {"loss": 1.23456, "grad_norm": 0.51234, "learning_rate": 9e-4, "epoch": 0.25, "tokens_per_s": 2345.6,
            "eta_h": 0.01, "custom": 3}
    assert log_line("train r", 10, 40, logs) == ("train r: step 10/40, loss 1.2346, grad_norm 0.512, lr 9.00e-04, "
                                                 "epoch 0.25, 2,346 tokens/s (rank 0 x world size), custom 3")
    assert log_line("train r", 10, 40, {"eval_loss": 2.5, "eval_runtime": 3.14, "eval_samples_per_second": 9.0,
                                        "epoch": 0.25}) == "train r: eval at step 10/40, eval_loss 2.5000 in 3.1 s, epoch 0.25"
    # the end-of-run metrics: `tuneledger train` prints its own summary
    assert log_line("train r", 40, 40, {"train_runtime": 12.0, "train_samples_per_second": 3.0, "epoch": 1.0}) is None
    assert logs["loss"] == 1.23456  # the Trainer's dict is left as it was (the ledger reads log_history)

    cb = LogLine("train r")
    state = SimpleNamespace(is_world_process_zero=True, global_step=2, max_steps=4)
    cb.on_log(None, state, None, logs={"loss": 2.0})
    cb.on_log(None, SimpleNamespace(is_world_process_zero=False, global_step=2, max_steps=4), None, logs={"loss": 2.0})
    assert capsys.readouterr().out == "train r: step 2/4, loss 2.0000\n"


def test_torchruns_own_traceback_after_a_stop_is_one_line():
    """Issue 21: a SIGTERM as the ranks started printed torchrun's SignalException traceback under the
    launcher's own last line. After a stop signal it is one line (the log keeps it); before one, and
    for any other error, a traceback is shown whole."""
    from tuneledger.rank_output import StopTraceback

    tb = ["Traceback (most recent call last):\n", '  File "run.py", line 9, in main\n', "    agent.run()\n",
          "torch.distributed.elastic.multiprocessing.api.SignalException: Process 7 got signal: 15\n"]
    q = StopTraceback(Path("/r/train.log"))
    assert [q.shown(line, "SIGTERM") for line in ["step 1\n", *tb]] == ["step 1\n", "", "", "",
        "launch: torchrun stopped by the SIGTERM passed on to it (its traceback is in /r/train.log)\n"]
    other = [*tb[:3], "RuntimeError: CUDA error: out of memory\n"]
    assert "".join(q.shown(line, "SIGTERM") for line in other) == "".join(other)
    assert "".join(StopTraceback(None).shown(line, None) for line in tb) == "".join(tb)  # no stop: as it came
    cut = StopTraceback(None)
    assert [cut.shown(line, "SIGTERM") for line in tb[:2]] == ["", ""] and cut.shown("", None) == "".join(tb[:2])


def test_no_count_is_printed_with_a_maybe_plural():
    """Issue 21 (15), found again by a second tester in strings the first fix missed: 'GPU(s)',
    'key(s)', 'do(es)'. Every string literal in the package is scanned; counts go through
    tuneledger.words.plural. A unit in parentheses ('time (s)') has a space before it and passes."""
    import io
    import re
    import tokenize

    src = Path(__file__).resolve().parents[1] / "src" / "tuneledger"
    found = []
    for f in sorted(src.rglob("*.py")):
        for tok in tokenize.generate_tokens(io.StringIO(f.read_text()).readline):
            if tok.type in (tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1)) and re.search(r"[A-Za-z]\((s|es)\)", tok.string):
                found.append(f"{f.relative_to(src)}:{tok.start[0]}: {tok.string[:80]}")
    assert not found, "\n".join(found)


def test_a_table_off_a_terminal_has_no_trailing_blanks_nor_colour_codes():
    """A tester's log: the ledger's and stats' title lines carried ~50-90 trailing spaces (rich pads
    each line to the table's width), and gpus' verdicts would carry colour codes into a file."""
    import io

    from rich.table import Table

    from tuneledger.tables import print_table

    t = Table(title="dry-run ledger: 2 x cpu  [SYNTHETIC model]", title_justify="left")
    t.add_column("preset")
    t.add_column("a long column header that widens the table")
    t.add_row("A", "[green]free[/]")
    out = io.StringIO()
    print_table(t, file=out, width=100)
    text = out.getvalue()
    assert text.splitlines()[0] == "dry-run ledger: 2 x cpu  [SYNTHETIC model]"
    assert all(line == line.rstrip() for line in text.splitlines()) and "\x1b[" not in text and "free" in text


def test_worker_counts_past_the_cores_are_capped_and_said_once(capsys, monkeypatch):
    """A tester's LF yaml on 2 cores: dataloader_num_workers 4 made torch warn from each rank, and
    preprocessing_num_workers 16 was taken as is."""
    import os

    from tuneledger.trainer import loader_workers

    cores = len(os.sched_getaffinity(0))
    assert loader_workers(cores) == cores and capsys.readouterr().out == ""
    assert loader_workers(cores + 2, say=True) == cores
    assert capsys.readouterr().out == (f"dataloader_num_workers={cores + 2} per rank, capped at {cores}: this process "
                                       f"may use {cores} CPU cores (more workers would only compete for them)\n")
    assert loader_workers(cores + 2) == cores and capsys.readouterr().out == ""  # ranks other than 0 say nothing


def test_the_presets_an_earlier_ledger_measured_are_read_for_the_replace_note(tmp_path):
    """A `--preset A` dry-run replaced a 4-preset ledger without a word; the note names what the
    earlier one held (earlier_presets), and a missing or damaged ledger holds none."""
    from tuneledger.dryrun import earlier_presets

    led = tmp_path / "dryrun.json"
    assert earlier_presets(led) == set()
    led.write_text(json.dumps({"presets": [{"preset": "A", "s_per_step": 1.0}, {"preset": "B", "skipped": "oom"},
                                           {"preset": "D", "s_per_step": 0.8}, 7]}))
    assert earlier_presets(led) == {"A", "D"}
    for bad in ("[1, 2]", '{"presets": [', '{"presets": "x"}'):
        led.write_text(bad)
        assert earlier_presets(led) == set()
