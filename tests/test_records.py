"""The streamed readers (records.py) agree with reading the whole file (the reader they replaced,
kept here as the reference): the same locations, objects, invalid reasons and errors, on the demo
data, the licensed demo sets where present, and bad input, with buffers cut at every few
characters so that values, escapes and multi-byte characters straddle the cut."""

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
    "bad-syntax.json": b'[\n {"a": 1},\n {"a": 2,,}\n]',
    "extra.json": b"[1] [2]",
    "unterminated.json": b'[{"a": "no end',
    "cut-list.json": b'[{"a": 1}, {"a": 2}',
    "blank.json": b"   ",
    "deep.json": b"[" + b"[" * 100000 + b"]" * 100000 + b"]",
    "lines.jsonl": b"".join(json.dumps(REC, ensure_ascii=False).encode() + b"\n" for _ in range(30)),
    "cut.jsonl": json.dumps(REC).encode() + b'\n{"instruction": "x", "out',
    "bad-line.jsonl": b'{"a": 1}\n{not json}\n\n\xef\xbb\xbf{"b": 2}\r\n{"c": "caf\xe9"}\n',
    "bom.jsonl": BOM.encode() + b'{"a": 1}\n',
    "noext.txt": b'  [{"a": 1}]',
    "noext2.data": b'{"a": 1}\n{"b": 2}',
}


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1 << 20])
@pytest.mark.parametrize("name", sorted(CASES))
def test_streamed_equals_whole_file(tmp_path, monkeypatch, name, chunk):
    monkeypatch.setattr(records, "CHUNK", chunk)
    path = tmp_path / name
    path.write_bytes(CASES[name])
    if name == "deep.json" and chunk < 64:
        pytest.skip("100k nested lists re-parsed per byte: slow, and the same code path as chunk 64")
    assert outcome(data.read_records, path) == outcome(whole_file_records, path)


@pytest.mark.parametrize("path", [ROOT / "src/tuneledger/data/demo.jsonl",
                                  ROOT.parent / "shared/data/alpaca_zh_demo.json",
                                  ROOT.parent / "shared/data/alpaca_en_demo.json",
                                  ROOT.parent / "shared/data/identity.json"], ids=lambda p: p.name)
def test_streamed_equals_whole_file_on_real_data(path, monkeypatch):
    if not path.is_file():
        pytest.skip(f"{path} is not here (../shared holds the licensed demo data)")
    monkeypatch.setattr(records, "CHUNK", 4093)  # values straddle the cut
    assert outcome(data.read_records, path) == outcome(whole_file_records, path)
