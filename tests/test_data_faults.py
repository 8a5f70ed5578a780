"""Data that used to crash or mislead (issue 13, item 12): each fault of one record is a counted,
named invalid record, and `train` reports them exactly as `stats` does."""

import json
import os
import sys
from pathlib import Path

import pytest

import procs
from tuneledger.data import Invalid, encode, read_records, to_messages

ROOT = Path(__file__).resolve().parents[1]
GOOD = json.dumps({"instruction": "What is 2+2?", "output": "4"}).encode()


def records(path):
    return [(w, o) for w, o in read_records(path)]


def test_non_utf8_line_names_file_and_line_and_the_rest_still_counts(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(GOOD + b"\n" + b'{"instruction": "caf\xe9", "output": "x"}\n' + GOOD + b"\n")
    rows = records(p)
    assert [w for w, _ in rows] == [f"{p}:1", f"{p}:2", f"{p}:3"]
    bad = rows[1][1]
    assert isinstance(bad, Invalid) and bad.kind == "not UTF-8"
    assert str(bad) == f"{p}:2: the line: not UTF-8: byte 0xe9 at column 21"
    assert rows[0][1] == rows[2][1] == json.loads(GOOD)


def test_non_utf8_in_a_json_list_is_one_invalid_record(tmp_path):
    p = tmp_path / "d.json"
    p.write_bytes(b"[" + GOOD + b',\n{"instruction": "q", "output": "\xff\xfe"},\n' + GOOD + b"]")
    rows = records(p)
    assert isinstance(rows[1][1], Invalid) and (rows[1][1].where, rows[1][1].field) == (f"{p}:2 (record 2)", "output")
    assert rows[1][1].reason == "not UTF-8: byte 0xff"
    assert rows[0][1] == rows[2][1] == json.loads(GOOD)


def test_lone_surrogate_escape_is_invalid_not_a_crash_later(tmp_path):
    # Valid JSON, but no UTF-8 encodes it: pyarrow and the tokenizer would raise on it.
    p = tmp_path / "d.jsonl"
    p.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a\\ud800"}]}\n')
    (where, bad), = records(p)
    assert isinstance(bad, Invalid) and bad.field == "messages[1].content" and "lone surrogate \\ud800" in bad.reason


def test_non_utf8_key_can_still_be_reported(tmp_path):
    # Found by bench/fuzz_data.py: the bad bytes were in a key, so the field name carried them and
    # writing invalid.jsonl raised UnicodeEncodeError.
    p = tmp_path / "d.json"
    p.write_bytes(b'[{"\xed\xa0\x80": null}]')
    (where, bad), = records(p)
    assert isinstance(bad, Invalid) and bad.field == "\\udced\\udca0\\udc80" and "(in a key)" in bad.reason
    json.dumps(bad.as_dict(), ensure_ascii=False).encode("utf-8")


def test_to_messages_refuses_text_no_tokenizer_can_take():
    # Records from files are checked by read_records; this is every other way in (placeholders too).
    got = to_messages({"instruction": "{{name}}", "output": "a"}, "x:1", {"name": "\udc80"})
    assert isinstance(got, Invalid) and got.kind == "not UTF-8" and got.field == "instruction"


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_utf8_bom_is_accepted(tmp_path, suffix):
    p = tmp_path / f"d{suffix}"
    body = GOOD + b"\n" + GOOD + b"\n" if suffix == ".jsonl" else b"[" + GOOD + b",\n" + GOOD + b"]"
    p.write_bytes(b"\xef\xbb\xbf" + body)
    assert [o for _, o in records(p)] == [json.loads(GOOD)] * 2


def test_bom_inside_a_joined_jsonl_is_accepted(tmp_path):
    p = tmp_path / "d.jsonl"  # `cat a.jsonl b.jsonl` where b.jsonl was saved with a BOM
    p.write_bytes(GOOD + b"\n\xef\xbb\xbf" + GOOD + b"\n")
    assert [o for _, o in records(p)] == [json.loads(GOOD)] * 2


def test_truncated_last_line_says_so(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(GOOD + b"\n" + GOOD[:15])
    bad = records(p)[1][1]
    assert isinstance(bad, Invalid) and bad.kind == "not valid JSON" and "was the file cut short?" in bad.reason


@pytest.mark.parametrize("line,what", [
    (b"[" * 100_000, "RecursionError"),
    (b'{"output": ' + b"1" * 5000 + b"}", "ValueError"),
])
def test_json_python_refuses_is_an_invalid_line(tmp_path, line, what):
    p = tmp_path / "d.jsonl"
    p.write_bytes(GOOD + b"\n" + line + b"\n" + GOOD + b"\n")
    rows = records(p)
    assert len(rows) == 3 and isinstance(rows[1][1], Invalid) and what in rows[1][1].reason


def test_unhashable_role_is_invalid_not_a_type_error():
    got = to_messages({"messages": [{"role": ["user"], "content": "q"}, {"role": "assistant", "content": "a"}]}, "x:1")
    assert isinstance(got, Invalid) and got.kind == "unsupported role" and got.field == "messages[0].role"


def test_cutoff_reason_says_where_the_reply_starts(qwen_tokenizer):
    enc = encode([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}], qwen_tokenizer, cutoff_len=1)
    assert enc["reason"].startswith("0 supervised tokens left after cutoff_len: the first assistant reply starts at token ")
    assert enc["reason"].endswith(f"of {enc['n_tokens']}, cutoff_len is 1")


# ------------------------------------------------------------------------- through the verbs
def tl(*args, env=None):
    return procs.run([sys.executable, "-m", "tuneledger", *args], cwd=ROOT, env={**os.environ, **(env or {})})


def common(tmp_path, model, data, name, *extra):
    return [f"model_name_or_path={model}", f"dataset={data}", f"cache_dir={tmp_path / 'cache'}",
            f"output_dir={tmp_path / name}", "quantization_bit=null", "preprocessing_num_workers=1", *extra]


def test_train_reports_invalid_records_exactly_as_stats(tmp_path, tiny_model):
    data = tmp_path / "cut.jsonl"
    data.write_bytes((GOOD + b"\n") * 3 + b'{"instruction": "caf\xe9", "output": "x"}\n' + GOOD[:12])
    # 2 of 5 invalid is above max_invalid_ratio=0.05: both verbs stop at the gate, after reporting.
    stats = tl("stats", *common(tmp_path, tiny_model, data, "s"))
    train = tl("train", *common(tmp_path, tiny_model, data, "t"), "--cpu", "--nproc", "2")
    assert stats.returncode == train.returncode == 2, train.stdout + train.stderr
    lines = lambda out: [line for line in out.splitlines() if line.startswith("invalid ")]  # noqa: E731
    assert lines(stats.stdout) == lines(train.stdout) and len(lines(stats.stdout)) == 2
    assert f"{data}:4: the line: not UTF-8: byte 0xe9" in lines(train.stdout)[0]
    assert "was the file cut short?" in lines(train.stdout)[1]
    assert (tmp_path / "s" / "invalid.jsonl").read_text() == (tmp_path / "t" / "invalid.jsonl").read_text()
    assert "2 of 5 records are invalid" in train.stderr
    assert "launch:" not in train.stdout  # no rank started


def test_cutoff_len_1_gives_the_reason(tmp_path, tiny_model):
    data = tmp_path / "d.jsonl"
    data.write_bytes((GOOD + b"\n") * 4)
    p = tl("stats", *common(tmp_path, tiny_model, data, "s", "cutoff_len=1"))
    assert p.returncode == 2  # bad data is bad input, as a bad key is
    assert "no valid record" in p.stderr and "all 4 are invalid (0 supervised tokens left after cutoff_len: 4)" in p.stderr
    assert "cutoff_len is 1" in p.stderr


def test_stats_refuses_a_vision_language_model(tmp_path, tiny_model):
    import shutil

    vl = tmp_path / "vl"
    shutil.copytree(tiny_model, vl)
    config = json.loads((vl / "config.json").read_text())
    config.update(model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"], vision_config={"depth": 2})
    (vl / "config.json").write_text(json.dumps(config))
    data = tmp_path / "d.jsonl"
    data.write_bytes(GOOD + b"\n")
    p = tl("stats", *common(tmp_path, vl, data, "s"))
    assert p.returncode == 1 and "vision-language model" in p.stderr
