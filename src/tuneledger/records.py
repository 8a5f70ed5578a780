"""Records read as a stream: a JSONL file line by line and a JSON list value by value, so reading
a dataset holds one record (and one chunk of the file) in memory, not the file and all of its
parsed objects (an 839 MB alpaca list held about 12 GB as Python objects).

`iter_jsonl` and `iter_json_list` yield (location, parsed object or data.Invalid), with the same
locations, reasons and errors as reading the whole file did (tests/test_records.py checks both
ways agree on the demo data and on every bad-input fixture). data.read_records picks one by the
file's suffix, or by its first byte for other suffixes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Iterator

BOM = "\ufeff"
CHUNK = 1 << 20  # bytes of a JSON list read at a time
NUMBER_CHARS = set("0123456789+-.eE")
# A value's text holds one where the file's bytes were not UTF-8 (surrogateescape). A regex, not a
# loop over characters: that loop was 70% of reading an 80 MB list.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _decode(raw: bytes) -> str:
    # Bytes that are not UTF-8 become lone surrogates (U+DC80..U+DCFF), found per record later,
    # so one bad byte costs its record, not the file.
    return raw.decode("utf-8", errors="surrogateescape")


def first_char(path: Path) -> str:
    """The file's first character that is not whitespace or a byte-order mark ('' if none)."""
    with open(path, "rb") as f:
        while chunk := f.read(4096):
            text = _decode(chunk).lstrip().removeprefix(BOM).lstrip()
            if text:
                return text[0]
    return ""


def iter_jsonl(path: Path, parse_line: Callable[[str, str, bool], tuple[str, Any]],
               seen: dict | None = None) -> Iterator[tuple[str, Any]]:
    """Each non-blank line of a JSONL file through `parse_line(where, line, is_last_unterminated)`.
    A UTF-8 byte-order mark is accepted at the start of the file and of any line. `seen["bytes"]`,
    if given, grows by the bytes read (for a progress line)."""
    with open(path, "rb") as f:
        lineno = 0
        for raw in f:
            lineno += 1
            if seen is not None:
                seen["bytes"] += len(raw)
            last = not raw.endswith(b"\n")
            line = _decode(raw.rstrip(b"\n")).removeprefix(BOM)
            if lineno == 1:
                line = line.removeprefix(BOM)
            if line.strip():
                yield parse_line(f"{path}:{lineno}", line, last)


class Broken:
    """A stretch of a JSON list that is not a record: `where` is "record" (one element that does not
    parse; reading went on after it unless `to_end`), "unclosed" (the file ends inside the list,
    with no ']'), or "extra" (text after the list's ']'). `msg` is json's message at 1-based
    `line`:`col`; `to_end`: from there to the file's end nothing could be read, `skipped` characters."""

    def __init__(self, where: str, msg: str, line: int, col: int, to_end: bool = False, skipped: int = 0):
        # json's messages that name a position end in " at" ("Unterminated string starting at"): the
        # position is said after it.
        self.where, self.msg, self.line, self.col = where, msg.removesuffix(" at"), line, col
        self.to_end, self.skipped = to_end, skipped


# Where a value ends, outside strings and inside them (the scan past a value that does not parse).
_STRUCTURE = re.compile(r'["{}\[\],]')
_IN_STRING = re.compile(r'["\\]')


class ListError(ValueError):
    """The JSON list does not parse: `message` with 1-based line and column."""

    def __init__(self, msg: str, line: int, col: int):
        super().__init__(f"{line}:{col}: {msg}")
        self.msg, self.line, self.col = msg, line, col


def iter_json_list(path: Path, seen: dict | None = None) -> Iterator[tuple[int, Any, bool, int]]:
    """(index, parsed value, its text held a lone surrogate, 1-based line its text starts on) of
    each element of a file holding one JSON list, parsed value by value (json.JSONDecoder.raw_decode
    over a sliding buffer of about CHUNK characters).

    A value that does not parse is yielded as a Broken, and reading goes on after it: the scan past
    it follows strings and brackets to the ',' or ']' that ends it, so a bad record costs that
    record (a quote or bracket that never closes costs the rest of the file, and Broken says so).
    A list the file ends inside, or text after its ']', is one Broken more. Raises ListError (line:
    column, as json.loads reports them) when the file holds no value at all, and TypeError (the
    value's type name) when its value is not a list. `seen["bytes"]`, if given, grows by the bytes read."""
    import codecs

    dec = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    # raw_bad: the buffer holds a byte that was not UTF-8 (most files hold none: then no value's
    # text needs a search of its own).
    st = {"buf": "", "pos": 0, "done": False, "base": 0, "lines": 1, "last_nl": -1, "raw_bad": False}
    # The line of each value's start, counted on from the last one (a count from the buffer's
    # start per value would scan the whole buffer for every record): `at` is an offset in the file.
    cursor = {"at": 0, "line": 1}

    def line_at(p: int) -> int:
        cursor["line"] += st["buf"].count("\n", cursor["at"] - st["base"], p)
        cursor["at"] = st["base"] + p
        return cursor["line"]

    with open(path, "rb") as f:
        def fill() -> bool:
            if st["done"]:
                return False
            raw = f.read(CHUNK)
            if seen is not None:
                seen["bytes"] += len(raw)
            if not raw:  # the end: leave the buffer where it is, so error positions still hold
                st["done"] = True
                tail = utf8.decode(b"", final=True)
                st["buf"] += tail
                st["raw_bad"] = st["raw_bad"] or bool(_SURROGATE.search(tail))
                return bool(tail)
            line_at(st["pos"])  # before what it counts from is dropped
            drop = st["buf"][:st["pos"]]
            nl = drop.count("\n")
            if nl:
                st["last_nl"] = st["base"] + drop.rfind("\n")
            st["lines"] += nl
            st["base"] += len(drop)
            st["buf"] = st["buf"][st["pos"]:] + utf8.decode(raw)
            st["pos"] = 0
            st["raw_bad"] = bool(_SURROGATE.search(st["buf"]))
            return True

        def where(p: int) -> tuple[int, int]:
            head = st["buf"][:p]
            nl = head.count("\n")
            last = st["base"] + head.rfind("\n") if nl else st["last_nl"]
            return st["lines"] + nl, st["base"] + p - last

        def peek() -> str:
            while True:
                buf, pos = st["buf"], st["pos"]
                while pos < len(buf) and (buf[pos] in " \t\r\n" or (buf[pos] == BOM and st["base"] + pos == 0)):
                    pos += 1
                st["pos"] = pos
                if pos < len(buf):
                    return buf[pos]
                if not fill():
                    return ""

        def past_value() -> bool:
            """Move pos past the value starting there to the ',' or ']' that ends it; False: the
            file ended first. The text passed is let go as the scan goes (one buffer held)."""
            depth, in_str, k = 0, False, st["pos"]
            while True:
                buf = st["buf"]
                while k < len(buf):
                    m = (_IN_STRING if in_str else _STRUCTURE).search(buf, k)
                    if m is None:
                        k = len(buf)
                        break
                    ch, k = m.group(0), m.end()
                    if in_str:
                        in_str = ch != '"'
                        k += ch == "\\"  # the escaped character (past the buffer's end: skipped after the fill)
                    elif ch == '"':
                        in_str = True
                    elif ch in "{[":
                        depth += 1
                    elif depth == 0 and ch in ",]":
                        st["pos"] = m.start()
                        return True
                    elif ch in "}]":
                        depth = max(0, depth - 1)
                over = k - len(buf)
                st["pos"] = len(buf)
                if not fill():
                    return False
                k = st["pos"] + over

        def value() -> tuple[Any, str] | Broken:
            while True:
                try:
                    v, end = dec.raw_decode(st["buf"], st["pos"])
                except json.JSONDecodeError as e:
                    # Cut by the buffer's end (an error at its end, or a string still open there):
                    # read on and parse again. Any other error is the value's own.
                    cut = e.pos >= len(st["buf"]) - 6 or e.msg.startswith("Unterminated string")
                    if cut and fill():
                        continue
                    return broken(e.msg, e.pos)
                except (ValueError, RecursionError) as e:  # an int over Python's digit limit, nesting too deep
                    return broken(f"{type(e).__name__}: {str(e)[:200]}", st["pos"])
                if isinstance(v, (int, float)) and not st["done"] and \
                        all(ch in NUMBER_CHARS for ch in st["buf"][end:]) and fill():
                    continue  # a number (or its exponent) may go on past the buffer: parse it again when whole
                text = st["buf"][st["pos"]:end]
                st["pos"] = end
                return v, text

        def broken(msg: str, at: int, kind: str = "record") -> Broken:
            line, col = where(at)
            start = st["base"] + st["pos"]
            ended = past_value()
            return Broken(kind, msg, line, col, to_end=not ended, skipped=st["base"] + st["pos"] - start)

        fill()
        c = peek()
        if c == "":
            raise ListError("Expecting value", *where(st["pos"]))
        if c != "[":
            got = value()
            if isinstance(got, Broken):
                raise ListError(got.msg, got.line, got.col)
            raise TypeError(type(got[0]).__name__)
        st["pos"] += 1
        index, want_value = 0, peek() != "]"
        while True:
            c = peek()
            if want_value:
                line = line_at(st["pos"])
                if c == "":  # after '[' or ',': the file ends where a record should begin
                    yield index, Broken("unclosed", "Expecting value", *where(st["pos"])), False, line
                    return
                got = value()
                if isinstance(got, Broken):
                    yield index, got, False, line
                    if got.to_end:  # nothing after it could be read: it said so, the list is over
                        return
                else:
                    yield index, got[0], st["raw_bad"] and bool(_SURROGATE.search(got[1])), line
                index, want_value = index + 1, False
            elif c == ",":
                st["pos"] += 1
                want_value = True
            elif c == "]":
                st["pos"] += 1
                break
            elif c == "":
                yield index, Broken("unclosed", "Expecting ',' delimiter", *where(st["pos"])), False, line_at(st["pos"])
                return
            else:  # more text after a value, a missing ',' most likely: what follows is a record that does not parse
                line = line_at(st["pos"])
                got = broken("Expecting ',' delimiter", st["pos"])
                yield index, got, False, line
                if got.to_end:
                    return
                index += 1
        if peek() != "":
            line = line_at(st["pos"])
            msg_at = where(st["pos"])
            start = st["base"] + st["pos"]
            while fill():  # the rest is not read as records; how much of it there is, is said
                st["pos"] = len(st["buf"])
            st["pos"] = len(st["buf"])
            yield index, Broken("extra", "Extra data", *msg_at, to_end=True, skipped=st["base"] + st["pos"] - start), False, line


class RecordWriter:
    """Normalised records ({"messages": [{"role", "content"}...], "where", "fields"}) written to
    an Arrow stream file in batches of BATCH under a temporary folder of `parent`, then opened
    memory-mapped as a datasets.Dataset (`dataset()`); `remove()` deletes the folder."""

    BATCH = 2048

    def __init__(self, parent: Path):
        import tempfile

        import pyarrow as pa

        parent.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(dir=parent, prefix=".records-"))
        turn = pa.struct([("role", pa.string()), ("content", pa.string())])
        self.schema = pa.schema([("messages", pa.list_(turn)), ("where", pa.string()), ("fields", pa.list_(pa.string()))])
        self.path = self.dir / "records.arrow"
        self.rows: list[dict] = []
        self.n = 0
        self._sink = pa.OSFile(str(self.path), "wb")
        self._writer = pa.ipc.new_stream(self._sink, self.schema)

    def add(self, row: dict) -> None:
        self.rows.append(row)
        if len(self.rows) >= self.BATCH:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self.rows:
            self._writer.write_batch(pa.RecordBatch.from_pylist(self.rows, schema=self.schema))
            self.n += len(self.rows)
            self.rows = []

    def dataset(self) -> Any:
        """The records as a memory-mapped datasets.Dataset (columns messages, where, fields)."""
        import datasets

        self._flush()
        self._writer.close()
        self._sink.close()
        return datasets.Dataset.from_file(str(self.path), in_memory=False)

    def remove(self) -> None:
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)
