"""The streamed readers (records.py) agree with reading the whole file (the reader they replaced,
kept here as the reference): the same locations, objects, invalid reasons and errors, on the demo
data, the licensed demo sets where present, and bad input, with buffers cut at every few
characters so that values, escapes and multi-byte characters straddle the cut.

Where the whole-file reader gave up on a JSON list that breaks (issue 22: "a record that breaks
the stream is named, not fatal"), the streamed one names the break and reads on: BREAKS says what
each such file gives, the same at every buffer size."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tuneledger import data, records
from tuneledger.data import BOM, DataError, Invalid, _first_bad_text, bad_column, bad_text

ROOT = Path(__file__).resolve().parents[1]
_SURROGATE = re.compile("[\ud800-\udfff]")


def element_lines(text: str) -> list[int]:
    """The 1-based line each element of the JSON list `text` starts on, from the whole text."""
    dec, ws, lines = json.JSONDecoder(), re.compile(r"[ \t\r\n]*"), []
    pos = ws.match(text, text.index("[") + 1).end()
    while text[pos] != "]":
        lines.append(text.count("\n", 0, pos) + 1)
        pos = ws.match(text, dec.raw_decode(text, pos)[1]).end()
        pos = ws.match(text, pos + 1).end() if text[pos] == "," else pos
    return lines


def whole_file_records(path: Path):
    """The whole-file reader as it was before streaming (commit 7cf3ede)."""
    text = path.read_bytes().decode("utf-8", errors="surrogateescape").removeprefix(BOM)
    if path.suffix == ".jsonl" or (path.suffix != ".json" and not text.lstrip().startswith("[")):
        lines = text.split("\n")
        for lineno, line in enumerate(lines, 1):
            line = line.removeprefix(BOM)
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            bad = bad_text(line)
            if bad:
                yield where, Invalid(where, "<line>", f"{bad} at column {bad_column(line) + 1}", "not UTF-8")
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                cut = " (the last line, with no newline after it: was the file cut short?)" if lineno == len(lines) else ""
                yield where, Invalid(where, "<line>", f"not valid JSON: {e.msg.removesuffix(' at')} at column {e.colno}{cut}", "not valid JSON")
            except (ValueError, RecursionError) as e:
                yield where, Invalid(where, "<line>", f"not valid JSON: {type(e).__name__}: {str(e)[:200]}", "not valid JSON")
            else:
                field, bad = _first_bad_text(obj, escaped=True)
                yield where, Invalid(where, field, bad, "not UTF-8") if bad else obj
        return
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None
    except (ValueError, RecursionError) as e:
        raise DataError(f"{path}: not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(parsed, list):
        raise DataError(f"{path}: a .json dataset must be a list of records, got {type(parsed).__name__}")
    escaped = not _SURROGATE.search(text)
    for i, (obj, line) in enumerate(zip(parsed, element_lines(text))):
        where = f"{path}:{line} (record {i + 1})"
        field, bad = _first_bad_text(obj, escaped)
        yield where, Invalid(where, field, bad, "not UTF-8") if bad else obj


def outcome(reader, path):
    try:
        return [(w, o.as_dict() if isinstance(o, Invalid) else o) for w, o in reader(path)]
    except DataError as e:
        return f"DataError: {e}"


REC = {"instruction": "写一首诗 ünïcode", "input": "", "output": "好的 \" quoted \u00e9 \U0001F600 emoji"}
CASES = {
    "list.json": ("[\n  " + ",\n  ".join(json.dumps(REC, ensure_ascii=False) for _ in range(40)) + "\n]\n").encode(),
    "escaped.json": json.dumps([REC, {"instruction": "a", "output": "lone \udc80 escape"}]).encode(),
    "bad-bytes.json": b'[{"instruction": "caf\xe9", "output": "x"}, {"instruction": "ok", "output": "y"}]',
    "bom.json": BOM.encode() + json.dumps([REC]).encode(),
    "numbers.json": b"[1234567890123, -0.5e10, [1,2,3], {\"a\": 12}]",
    "empty.json": b"  [ ]  ",
    "not-a-list.json": b'{"instruction": "x"}',
    "blank.json": b"   ",
    "lines.jsonl": b"".join(json.dumps(REC, ensure_ascii=False).encode() + b"\n" for _ in range(30)),
    "cut.jsonl": json.dumps(REC).encode() + b'\n{"instruction": "x", "out',
    "bad-line.jsonl": b'{"a": 1}\n{not json}\n\n\xef\xbb\xbf{"b": 2}\r\n{"c": "caf\xe9"}\n',
    "bom.jsonl": BOM.encode() + b'{"a": 1}\n',
    "noext.txt": b'  [{"a": 1}]',
    "noext2.data": b'{"a": 1}\n{"b": 2}',
}


R = "<record>"
# name: (bytes, [(where after the path, the object, or (field, start of the reason)), ...]).
BREAKS = {
    "bad-syntax.json": (b'[\n {"a": 1},\n {"a": 2,,}\n, {"a": 3}]', [
        (":2 (record 1)", {"a": 1}),
        (":3 (record 2)", (R, "not valid JSON: Expecting property name enclosed in double quotes at line 3 column 10")),
        (":4 (record 3)", {"a": 3})]),
    "double-comma.json": (b'[{"instruction": "a", "output": "b"},,]', [  # two empty places: two records that are not
        (":1 (record 1)", {"instruction": "a", "output": "b"}),
        (":1 (record 2)", (R, "not valid JSON: Expecting value at line 1 column 38")),
        (":1 (record 3)", (R, "not valid JSON: Expecting value at line 1 column 39"))]),
    "missing-comma.json": (b'[{"a": 1}\n{"a": [2, "]"]},\n{"a": 3}]', [
        (":1 (record 1)", {"a": 1}),
        (":2 (record 2)", (R, "not valid JSON: Expecting ',' delimiter at line 2 column 1")),
        (":3 (record 3)", {"a": 3})]),
    "raw-newline.json": (b'[{"a": "one\ntwo", "b": "}, {"}, {"a": 2}]', [  # brackets inside strings are text
        (":1 (record 1)", (R, "not valid JSON: Invalid control character at line 1 column 12")),
        (":2 (record 2)", {"a": 2})]),
    "bad-escape.json": (b'[{"a": "x\\q \\"}"}, {"a": 2}]', [
        (":1 (record 1)", (R, "not valid JSON: Invalid \\escape at line 1 column 10")),
        (":1 (record 2)", {"a": 2})]),
    "deep.json": (b"[" + b"[" * 100000 + b"]" * 100000 + b", 5]", [
        (":1 (record 1)", (R, "not valid JSON: RecursionError: maximum recursion depth exceeded")),
        (":1 (record 2)", 5)]),
    "extra.json": (b"[1] [2]", [
        (":1 (record 1)", 1),
        (":1", ("<file>", "not valid JSON: Extra data at line 1 column 5: 3 characters after the list's ']' are not read"))]),
    "unterminated.json": (b'[{"a": 1}, {"a": "no end', [  # the file cut inside its last record
        (":1 (record 1)", {"a": 1}),
        (":1 (record 2)", (R, "not valid JSON: Unterminated string starting at line 1 column 18; the file ends before "
                              "this record does, 13 characters after its start (was the file cut short"))]),
    "cut-list.json": (b'[{"a": 1}, {"a": 2}', [  # cut between records: none lost that can be seen, and it is said
        (":1 (record 1)", {"a": 1}), (":1 (record 2)", {"a": 2}),
        (":1", ("<file>", "not valid JSON: Expecting ',' delimiter at line 1 column 20: the file ends inside the list, "
                          "with no ']' (was it cut short?)"))]),
    "cut-after-comma.json": (b'[{"a": 1},\n', [
        (":1 (record 1)", {"a": 1}),
        (":2", ("<file>", "not valid JSON: Expecting value at line 2 column 1: the file ends inside the list"))]),
    "open-quote.json": (b'[{"a": 1}, {"a": "x}, {"a": "y"}, {"a": "z"}]', [  # a quote that never closes: the rest is one
        (":1 (record 1)", {"a": 1}),
        (":1 (record 2)", (R, "not valid JSON: Expecting ',' delimiter at line 1 column 25; the file ends before this "
                              "record does, 34 characters after its start"))]),
}


def broken_outcome(path):
    got = []
    for w, o in data.read_records(path):
        assert w.startswith(str(path))
        got.append((w[len(str(path)):], (o.field, o.reason) if isinstance(o, Invalid) else o))
        if isinstance(o, Invalid):
            assert o.kind == "not valid JSON" and o.where == w
    return got


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1 << 20])
@pytest.mark.parametrize("name", sorted(CASES))
def test_streamed_equals_whole_file(tmp_path, monkeypatch, name, chunk):
    monkeypatch.setattr(records, "CHUNK", chunk)
    path = tmp_path / name
    path.write_bytes(CASES[name])
    assert outcome(data.read_records, path) == outcome(whole_file_records, path)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1 << 20])
@pytest.mark.parametrize("name", sorted(BREAKS))
def test_a_json_list_that_breaks_is_named_and_read_on(tmp_path, monkeypatch, capsys, name, chunk):
    """Where the whole-file reader stopped with a DataError, each break is an invalid record (or one
    for the file, when the list is cut or followed by more), named with json's line and column,
    said on stderr too, and the records after it are read."""
    if name == "deep.json" and chunk < 64:
        pytest.skip("100k nested lists re-parsed per byte: slow, and the same code path as chunk 64")
    monkeypatch.setattr(records, "CHUNK", chunk)
    path = tmp_path / name
    raw, want = BREAKS[name]
    path.write_bytes(raw)
    got = broken_outcome(path)
    assert [w for w, _ in got] == [w for w, _ in want]
    for (_, o), (_, w) in zip(got, want):
        if isinstance(w, tuple):
            assert isinstance(o, tuple) and o[0] == w[0] and o[1].startswith(w[1]), (o, w)
        else:
            assert o == w
    assert outcome(whole_file_records, path).startswith("DataError")  # what it was before
    err = capsys.readouterr().err
    first = next(o for _, o in got if isinstance(o, tuple))[1]
    line_col = first.split(" at line ", 1)[1].split(" column ")
    assert f"{path}:{line_col[0]}:{line_col[1].split()[0].rstrip(':;')}: not valid JSON" in err


def test_many_breaks_in_a_long_list_cost_only_their_records(tmp_path, monkeypatch, capsys):
    """600 records, 3 of them broken apart, values straddling every buffer cut: 597 read, each
    break named by its own line, and stderr says the first 10 per file only (here all 3)."""
    monkeypatch.setattr(records, "CHUNK", 61)
    bad = {57: '{"instruction": "q57", "output": }', 300: '{"instruction": "q300" "output": "a"}', 598: "{'a': 1}"}
    lines = [bad.get(i, json.dumps({"instruction": f"q{i} 写", "output": f"a{i} \u00e9"})) for i in range(600)]
    path = tmp_path / "long.json"
    path.write_text("[\n" + ",\n".join(lines) + "\n]\n", encoding="utf-8")
    got = list(data.read_records(path))
    assert len(got) == 600
    invalid = [(w, o.reason) for w, o in got if isinstance(o, Invalid)]
    assert [w for w, _ in invalid] == [f"{path}:{i + 2} (record {i + 1})" for i in sorted(bad)]
    assert all(r.startswith(f"not valid JSON: ") and f" at line {w.split(':')[1].split()[0]} column " in r for w, r in invalid)
    assert [o["instruction"] for _, o in got if not isinstance(o, Invalid)] == [f"q{i} 写" for i in range(600) if i not in bad]
    assert len([line for line in capsys.readouterr().err.splitlines() if "not valid JSON" in line]) == 3


@pytest.mark.parametrize("path", [ROOT / "src/tuneledger/data/demo.jsonl",
                                  ROOT.parent / "shared/data/alpaca_zh_demo.json",
                                  ROOT.parent / "shared/data/alpaca_en_demo.json",
                                  ROOT.parent / "shared/data/identity.json"], ids=lambda p: p.name)
def test_streamed_equals_whole_file_on_real_data(path, monkeypatch):
    if not path.is_file():
        pytest.skip(f"{path} is not here (../shared holds the licensed demo data)")
    monkeypatch.setattr(records, "CHUNK", 4093)  # values straddle the cut
    assert outcome(data.read_records, path) == outcome(whole_file_records, path)
