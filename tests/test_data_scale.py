"""Issue 22 at test size: nothing lost (the invalid report exact over thousands of records read,
validated and tokenized on 2 processes, a JSON list that breaks named, not fatal), every core by
default, and progress lines that a log can hold. No timing is asserted."""

import io
import json
import os
import sys
from pathlib import Path

import procs
from test_data import cfg_for
from tuneledger import data_progress
from tuneledger.data import num_proc
from tuneledger.prepare import prepare

ROOT = Path(__file__).resolve().parents[1]
LONG = " ".join(["word"] * 120)  # past cutoff_len=64 before the reply: 0 supervised tokens, found by the tokenizer


def test_the_invalid_report_is_exact_over_thousands_of_records(tmp_path, tiny_model, qwen_tokenizer):
    """3,000 JSONL lines and a 1,000-record JSON list with faults of four kinds spread through them:
    every one named by its own file:line, in file order (faults found reading first, then those the
    tokenizing workers found), counted by reason; every other record kept, none twice."""
    want: list[tuple[str, str]] = []
    jsonl, lines = tmp_path / "a.jsonl", []
    for i in range(3000):
        if i % 97 == 5:
            lines.append(json.dumps({"instruction": f"q{i}"}))
            want.append((f"{jsonl}:{i + 1}", "missing field"))
        elif i % 211 == 7:
            lines.append('{"instruction": "q", "output": ')
            want.append((f"{jsonl}:{i + 1}", "not valid JSON"))
        else:
            lines.append(json.dumps({"instruction": LONG if i % 353 == 11 else f"q{i}", "output": f"a{i}"}))
    jsonl.write_text("\n".join(lines) + "\n")
    listed, items = tmp_path / "b.json", []
    for i in range(1000):
        items.append('{"instruction": "x" "output": "y"}' if i in (123, 877) else json.dumps({"instruction": f"l{i}", "output": "z"}))
    listed.write_text("[\n" + ",\n".join(items) + "\n]\n")
    want += [(f"{listed}:{i + 2} (record {i + 1})", "not valid JSON") for i in (123, 877)]
    cut = [(f"{jsonl}:{i + 1}", "0 supervised tokens left after cutoff_len") for i in range(3000)
           if i % 353 == 11 and not (i % 97 == 5 or i % 211 == 7)]
    prep = prepare(cfg_for(tmp_path, tiny_model, [jsonl, listed], cutoff_len=64), qwen_tokenizer, progress=False)
    got = [(inv.where, inv.kind) for inv in prep.invalid]
    assert got == want + cut  # read-time faults in file order, then the tokenizer's in record order
    rec = prep.report["records"]
    assert rec["total"] == 4000 and rec["valid"] == 4000 - len(got) and rec["invalid"] == len(got)
    counts: dict[str, int] = {}
    for _, kind in got:
        counts[kind] = counts.get(kind, 0) + 1
    assert rec["invalid_by_reason"] == counts
    import datasets

    kept = datasets.load_from_disk(str(prep.path))["where"]
    assert len(kept) == len(set(kept)) == rec["valid"] and not set(kept) & {w for w, _ in got}


def test_stats_names_a_broken_json_list_and_goes_on(tmp_path, tiny_model):
    """The break costs its record: stats passes the gate (1 of 61 is under 5%), the record is in the
    invalid lines and invalid.jsonl, and stderr says where the list broke."""
    data = tmp_path / "d.json"
    good = [json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) for i in range(60)]
    data.write_text("[\n" + ",\n".join(good[:30] + ['{"instruction": "q", "output": "a",}'] + good[30:]) + "\n]\n")
    p = procs.run([sys.executable, "-m", "tuneledger", "stats", f"model_name_or_path={tiny_model}", f"dataset={data}",
                   f"cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'run'}", "quantization_bit=null",
                   "global_batch_size=4"], cwd=ROOT, env=dict(os.environ))
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"invalid {data}:32 (record 31): the record: not valid JSON: Expecting property name enclosed in double " \
           "quotes at line 32 column 36" in p.stdout
    assert f"{data}:32:36: not valid JSON: Expecting property name enclosed in double quotes; record 31 left out" in p.stderr
    stats = json.loads((tmp_path / "run" / "stats.json").read_text())
    assert stats["records"] == {"total": 61, "valid": 60, "invalid": 1, "invalid_by_reason": {"not valid JSON": 1}}
    assert [json.loads(line)["where"] for line in (tmp_path / "run" / "invalid.jsonl").read_text().splitlines()] == \
           [f"{data}:32 (record 31)"]


def test_every_core_by_default():
    cores = len(os.sched_getaffinity(0))
    assert num_proc(None) == cores and num_proc(1) == 1 and num_proc(16) == cores  # never more than the cores


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_progress_is_whole_lines_every_few_seconds_off_a_terminal():
    out, clock = io.StringIO(), Clock()
    m = data_progress.Meter("tokenizing 1,000 records on 2 processes", 1000, "records", stream=out, clock=clock)
    for step in range(1, 41):  # 20 s of updates every half second
        clock.t = step * 0.5
        m.update(step * 25, step * 25, step * 25 * 700)
    m.close(1000, 700_000)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert len(lines) == 5 and lines[0].startswith("tokenizing 1,000 records on 2 processes: 250 of 1,000 records (25%), ")
    assert "50 records/s, 35,000 tokens/s, ETA 15 s" in lines[0]
    assert lines[-1] == "tokenizing 1,000 records on 2 processes: done in 20 s: 1,000 records (50/s), 700,000 tokens (35,000/s)"


def test_progress_says_nothing_for_a_short_phase_and_redraws_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    quiet, clock = io.StringIO(), Clock()
    m = data_progress.Meter("reading 1 file", 10e6, "MB", stream=quiet, clock=clock)
    clock.t = 4.9
    m.update(10e6, 500)
    m.close(500)
    assert quiet.getvalue() == ""
    tty, clock = Tty(), Clock()
    m = data_progress.Meter("reading 1 file", 100e6, "MB", stream=tty, clock=clock)
    for step in range(1, 21):
        clock.t = step * 0.5
        m.update(step * 5e6, step * 100)
    m.close(2000)
    text = tty.getvalue()
    assert text.count("\r") == 7 and text.endswith("\n") and text.count("\n") == 1  # 5 s, then every second: one line
    assert "reading 1 file: 50 of 100 MB (50%), 200 records/s, ETA 5 s" in text


def test_worker_counts_add_up_across_processes(tmp_path):
    counts = data_progress.Counts(tmp_path / "c.bin", 3)
    data_progress.count(str(counts.path), 0, 64, 1000)
    data_progress.count(str(counts.path), 2, 10, 50)
    data_progress.count(str(counts.path), 0, 6, 7)
    assert counts.read() == (80, 1057)
