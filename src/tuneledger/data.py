"""Instruction data: read, validate, render through the chat template, tokenize, label, cache.

Formats, detected per record:
  alpaca    {"instruction", "input"?, "output", "system"?, "history"?: [[user, assistant], ...]}
  sharegpt  {"conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...], "system"?}
  messages  {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
Files are a JSON list (`.json`) or one JSON object per line (`.jsonl`).

An alpaca record becomes one user turn, `instruction + "\\n" + input` (input only when non-empty),
and one assistant turn, after its history turns; this is LLaMA-Factory's convention.

Labels: every token gets -100 except the assistant replies and the end-of-turn token
(`<|im_end|>` for Qwen) that closes each of them, so the model learns to stop. The newline the
template puts after `<|im_end|>` belongs to the next header and is not supervised.

Bad records are never dropped silently: each gets an `Invalid(where, field, reason, kind)` and counts
under its reason in the stats.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from tuneledger.data_report import holdout_count, summarize, with_batch  # noqa: F401  (trainer.py, tests)
from tuneledger.tokens import IGNORE_INDEX, encode  # noqa: F401  (encode is part of this module's API)

CACHE_VERSION = "4"  # bump when encode() or the records' names change, so stale caches are not reused
SHOW_BROKEN = 10  # places a JSON list breaks, said on stderr per file (all of them are invalid records)
PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")
ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


class DataError(ValueError):
    """A data file cannot be read at all (missing, not JSON). The message names file and line."""


@dataclass
class Invalid:
    """A record that cannot be trained on.

    `where` is file:line (JSONL) or file:line (record N) (JSON list, N from 1), `field` the offending field, `reason`
    the detail and `kind` the short class it is counted under in the stats.
    """

    where: str
    field: str
    reason: str
    kind: str = ""

    def __post_init__(self) -> None:
        self.kind = self.kind or self.reason
        # A field name or path can hold the very bytes that are not UTF-8; escape them, so the
        # record can still be printed and written to invalid.jsonl.
        for name in ("where", "field", "reason", "kind"):
            setattr(self, name, getattr(self, name).encode("utf-8", "backslashreplace").decode("utf-8"))

    def __str__(self) -> str:
        if self.field in ("<line>", "<record>"):  # the whole line or record, not one of its fields
            return f"{self.where}: the {self.field.strip('<>')}: {self.reason}"
        return f"{self.where}: field '{self.field}': {self.reason}"

    def as_dict(self) -> dict:
        return {"where": self.where, "field": self.field, "reason": self.reason, "kind": self.kind}


# ---------------------------------------------------------------------------------------- reading
def read_records(path: str | Path, seen: dict | None = None) -> Iterator[tuple[str, Any]]:
    """Yield (location, parsed object or Invalid) for every record of a .json or .jsonl file.

    Every fault of one record is yielded as an Invalid and the rest of the file still counts: a
    JSONL line that is not JSON (a file truncated mid-line included), a line or a JSON-list
    record with bytes that are not UTF-8 (see `bad_text`), JSON nested too deeply, a number
    Python refuses. A JSON list that breaks is not fatal either: each element that does not
    parse is an Invalid (the record, kind "not valid JSON", with json's line:column) and
    reading goes on after it; a list the file ends inside, or text after its ']', is one Invalid
    more (field '<file>'). Each break is also said on stderr (the first SHOW_BROKEN per file). A
    UTF-8 byte-order mark is accepted at the start of the file and, in JSONL, of any line (files
    joined with `cat`). Raises DataError when the file is missing, holds no JSON value at all or
    a value that is not a list, or is a JSONL file without a record (empty, or blank lines only). `seen["bytes"]`, if given, grows by the bytes read (a progress
    line's ETA).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"dataset file {path} not found")
    from tuneledger import records

    if path.suffix == ".jsonl" or (path.suffix != ".json" and records.first_char(path) != "["):
        n = 0
        for item in records.iter_jsonl(path, _parse_line, seen):
            n += 1
            yield item
        if not n:  # as an empty .json is: said before any count or file is written
            raise DataError(f"{path}: holds no record (the file is empty or only blank lines)")
        return
    told = 0
    try:
        for i, obj, raw_surrogates, line in records.iter_json_list(path, seen):
            if isinstance(obj, records.Broken):
                where, field, reason, said = _broken(path, i, line, obj)
                if told < SHOW_BROKEN:  # loud, not fatal: also in the invalid records, like any other
                    print(f"{path}:{obj.line}:{obj.col}: not valid JSON: {obj.msg}; {said}", file=sys.stderr, flush=True)
                told += 1
                yield where, Invalid(where, field, reason, "not valid JSON")
                continue
            where = f"{path}:{line} (record {i + 1})"  # like JSONL's file:line; a record number for a one-line list
            field, bad = _first_bad_text(obj, escaped=not raw_surrogates)
            yield where, Invalid(where, field, bad, "not UTF-8") if bad else obj
    except records.ListError as e:
        raise DataError(f"{path}:{e.line}:{e.col}: not valid JSON: {e.msg}") from None
    except TypeError as e:
        raise DataError(f"{path}: a .json dataset must be a list of records, got {e}") from None
    if told > SHOW_BROKEN:
        print(f"{path}: {told - SHOW_BROKEN} more places where the list does not parse (all in the invalid records)",
              file=sys.stderr, flush=True)


def _broken(path: Path, i: int, line: int, b: Any) -> tuple[str, str, str, str]:
    """(where, field, reason, what it cost) of a records.Broken stretch of a JSON list."""
    at = f"not valid JSON: {b.msg} at line {b.line} column {b.col}"
    if b.where == "unclosed":
        return (f"{path}:{b.line}", "<file>", f"{at}: the file ends inside the list, with no ']' (was it cut short?)",
                "the file ends inside the list")
    if b.where == "extra":
        return (f"{path}:{b.line}", "<file>", f"{at}: {b.skipped:,} characters after the list's ']' are not read (a .json "
                "file holds one list)", "the text after the list is not read")
    where = f"{path}:{line} (record {i + 1})"
    if b.to_end:
        return (where, "<record>", f"{at}; the file ends before this record does, {b.skipped:,} characters after its start "
                "(was the file cut short, or does a quote or bracket in it not close?)",
                f"record {i + 1} and the rest of the file left out")
    return where, "<record>", at, f"record {i + 1} left out, the records after it read"


def _parse_line(where: str, line: str, last: bool) -> tuple[str, Any]:
    """One JSONL line -> (where, object or Invalid); `last`: the file's last line, unterminated."""
    bad = bad_text(line)
    if bad:
        return where, Invalid(where, "<line>", f"{bad} at column {bad_column(line) + 1}", "not UTF-8")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        cut = " (the last line, with no newline after it: was the file cut short?)" if last else ""
        return where, Invalid(where, "<line>", f"not valid JSON: {e.msg.removesuffix(' at')} at column {e.colno}{cut}", "not valid JSON")
    except (ValueError, RecursionError) as e:  # int over Python's digit limit, nesting too deep
        return where, Invalid(where, "<line>", f"not valid JSON: {type(e).__name__}: {str(e)[:200]}", "not valid JSON")
    # The line's bytes were UTF-8: a surrogate now comes from a JSON escape.
    field, bad = _first_bad_text(obj, escaped=True)
    return where, Invalid(where, field, bad, "not UTF-8") if bad else obj


BOM = "\ufeff"
_SURROGATE = re.compile("[\ud800-\udfff]")


def bad_text(s: str, escaped: bool = False) -> str:
    """Why `s` cannot be encoded as UTF-8 (and so cannot be tokenized or stored), or "".

    A byte that was not UTF-8 in the file shows as U+DC80..U+DCFF (surrogateescape); a JSON
    escape such as "\\udc80" gives a lone surrogate too (`escaped`: the file's bytes were all UTF-8).
    """
    m = _SURROGATE.search(s)
    if not m:
        return ""
    c = ord(m.group(0))
    if 0xDC80 <= c <= 0xDCFF and not escaped:
        return f"not UTF-8: byte 0x{c - 0xDC00:02x}"
    return f"not UTF-8: lone surrogate \\u{c:04x} (a JSON escape that encodes no character)"


def bad_column(s: str) -> int:
    m = _SURROGATE.search(s)
    return m.start() if m else -1


def _first_bad_text(obj: Any, escaped: bool = False) -> tuple[str, str]:
    """(field, reason) of the first string in a parsed record (keys included) that is not
    UTF-8, or ("", ""). Iterative, so a record nested as deep as json allows cannot overflow."""
    stack = [("<record>", obj)]
    while stack:
        field, value = stack.pop()
        if isinstance(value, str):
            if bad_text(value):
                return field, bad_text(value, escaped)
        elif isinstance(value, dict):
            for k, v in reversed(value.items()):
                sub = k if field == "<record>" else f"{field}.{k}"
                if bad_text(k):
                    return sub, bad_text(k, escaped) + " (in a key)"
                stack.append((sub, v))
        elif isinstance(value, list):
            stack.extend((f"{'' if field == '<record>' else field}[{j}]", v) for j, v in reversed(list(enumerate(value))))
    return "", ""


def _text(obj: dict, field: str, where: str, required: bool = True) -> str | Invalid:
    value = obj.get(field)
    if value is None:
        return Invalid(where, field, "missing", "missing field") if required else ""
    if not isinstance(value, str):
        return Invalid(where, field, f"must be a string, got {type(value).__name__}", "wrong type")
    return value


def to_messages(obj: Any, where: str, placeholders: dict[str, str] | None = None,
                fields: list[str] | None = None) -> list[dict] | Invalid:
    """Normalise one record of any supported format to [{"role", "content"}, ...] or Invalid.

    The conversation must be: optional system, then user/assistant alternating, ending with a
    non-empty assistant reply; a record that does not is refused whole (turns are never merged
    or dropped), and the error lists its roles as written. `{{key}}` placeholders are filled from
    `placeholders`; one left unfilled makes the record invalid, since training on a literal
    `{{name}}` is never wanted. Errors name the record's own field (`output`, `messages[3].role`,
    `conversations[1].value`); an unknown format lists the keys the record has. `fields`, if
    given, gets the content field of each message returned (for errors found later, in encode).
    """
    if isinstance(obj, Invalid):
        return obj
    if not isinstance(obj, dict):
        return Invalid(where, "<record>", f"must be an object, got {type(obj).__name__}", "wrong type")
    chat = [k for k in ("messages", "conversations") if k in obj]
    alpaca = [k for k in ("instruction", "output") if k in obj]
    if len(chat) + bool(alpaca) > 1:
        return Invalid(where, "<record>", f"holds more than one format ({', '.join(chat + alpaca)}); keep one",
                       "ambiguous format")
    turns: list[tuple[str, str, str, str]] = []  # (role, content, role field, content field)
    written: list[str] = []  # the chat roles as the record spells them, for errors
    if chat:
        key = chat[0]
        role_key, content_key = ("role", "content") if key == "messages" else ("from", "value")
        raw = obj[key]
        if not isinstance(raw, list) or not raw:
            return Invalid(where, key, "must be a non-empty list of turns", "wrong type")
        if obj.get("system") is not None:
            system = _text(obj, "system", where)
            if isinstance(system, Invalid):
                return system
            turns.append(("system", system, "system", "system"))
        for j, turn in enumerate(raw):
            field = f"{key}[{j}]"
            if not isinstance(turn, dict):
                return Invalid(where, field, "must be an object", "wrong type")
            raw_role = turn.get(role_key)
            role = ROLE_ALIASES.get(raw_role) if isinstance(raw_role, str) else None
            if role is None:
                return Invalid(where, f"{field}.{role_key}", f"unsupported role {raw_role!r}", "unsupported role")
            content = _text(turn, content_key, where)
            if isinstance(content, Invalid):
                content.field = f"{field}.{content_key}"
                return content
            turns.append((role, content, f"{field}.{role_key}", f"{field}.{content_key}"))
            written.append(raw_role)
    elif alpaca:
        parts = {f: _text(obj, f, where, required=f in ("instruction", "output")) for f in ("instruction", "input", "output", "system")}
        for value in parts.values():
            if isinstance(value, Invalid):
                return value
        if parts["system"]:
            turns.append(("system", parts["system"], "system", "system"))
        history = obj.get("history") or []
        if not isinstance(history, list):
            return Invalid(where, "history", "must be a list of [user, assistant] pairs", "wrong type")
        for j, pair in enumerate(history):
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
                return Invalid(where, f"history[{j}]", "must be a [user, assistant] pair of strings", "wrong type")
            turns += [("user", pair[0], f"history[{j}]", f"history[{j}][0]"),
                      ("assistant", pair[1], f"history[{j}]", f"history[{j}][1]")]
        prompt = parts["instruction"] + ("\n" + parts["input"] if parts["input"] else "")
        if not prompt.strip():
            return Invalid(where, "instruction", "instruction and input are both empty", "empty prompt")
        turns += [("user", prompt, "instruction", "instruction" if not parts["input"] else "instruction/input"),
                  ("assistant", parts["output"], "output", "output")]
    else:
        keys = ", ".join(repr(k) for k in list(obj)[:12]) + (f" and {len(obj) - 12} more" if len(obj) > 12 else "")
        return Invalid(where, "<record>", "unknown format: expected instruction/output, messages or conversations; "
                       f"the record has {f'keys {keys}' if obj else 'no key'}", "unknown format")

    # Structure: [system] user assistant (user assistant)*
    body = turns[1:] if turns and turns[0][0] == "system" else turns
    seq = ", ".join(written or [t[0] for t in turns])
    policy = (f"roles are {seq}; turns must be [system,] user, assistant, user, assistant, ..., and a record "
              "that is not is refused whole (no turn is merged or dropped)")
    for j, (role, _, role_field, _) in enumerate(body):
        expected = "user" if j % 2 == 0 else "assistant"
        if role != expected:
            return Invalid(where, role_field, f"turn {j + 1} is '{role}', expected '{expected}': {policy}",
                           "turns out of order")
    if not body or body[-1][0] != "assistant":
        return Invalid(where, body[-1][2] if body else "<record>", f"conversation must end with an assistant turn: "
                       f"{policy}", "turns out of order")
    for role, content, _, content_field in body:
        if role == "assistant" and not content.strip():
            return Invalid(where, content_field, "empty assistant reply", "empty assistant reply")
    msgs = []
    for role, content, _, content_field in turns:
        if placeholders:
            content = PLACEHOLDER.sub(lambda g: placeholders.get(g.group(1), g.group(0)), content)
        bad = bad_text(content)
        if bad:  # read_records finds these in files; this guards every other caller (and placeholders)
            return Invalid(where, content_field, bad, "not UTF-8")
        left = PLACEHOLDER.search(content)
        if left:
            return Invalid(where, content_field, f"unfilled placeholder {left.group(0)}: set placeholders: "
                           f"{{{left.group(1)}: ...}} (or placeholders.{left.group(1)}=... on the command line)",
                           "unfilled placeholder")
        msgs.append({"role": role, "content": content})
        if fields is not None:
            fields.append(content_field)
    return msgs


# ---------------------------------------------------------------------------------------- cache
# LLaMA-Factory template names whose format is ChatML (<|im_start|>role ... <|im_end|>).
CHATML_TEMPLATES = ("qwen", "qwen2", "qwen3", "qwen3_nothink", "qwen2_vl", "qwen2_audio", "qwen2_omni", "qwen3_vl",
                    "chatml", "chatml_de", "smollm", "smollm2")


def is_chatml_name(template: str) -> bool:
    """True for a template name that promises ChatML (checked against the tokenizer's template).
    Every template renders with the tokenizer's own chat template; "tokenizer" and other names
    (llama3, mistral, ...) take it without a check."""
    return template in CHATML_TEMPLATES


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 over the vocabulary, special tokens and chat template: what decides the ids."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode())
    h.update(json.dumps([tokenizer.eos_token, tokenizer.pad_token, tokenizer.chat_template or ""]).encode())
    return h.hexdigest()


def cache_key(data_hashes: list[str], tok_fp: str, template: str, cutoff_len: int, extra: dict) -> str:
    blob = json.dumps([CACHE_VERSION, data_hashes, tok_fp, template, cutoff_len, extra], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def num_proc(requested: int | None) -> int:
    """Tokenizing processes: `requested` (preprocessing_num_workers), else every core this process
    may run on (its CPU affinity: a container's cpuset, taskset), not a fixed cap; never more than
    those cores (an LF yaml's 16 on 2 cores: more processes only share the same cores)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(requested or cores, cores))
