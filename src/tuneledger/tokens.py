"""One conversation -> input_ids and labels, through the tokenizer's own chat template.

Text is text. A record's text may spell a token the tokenizer adds to its vocabulary whole
(Qwen's `<|im_end|>`, `<|im_start|>`, `<|endoftext|>`, `<tool_call>`, `<|fim_prefix|>`, ...: every
entry of `tokenizer.added_tokens_decoder`, special or not). Such a spelling is tokenized as the
characters it is made of, never as the control token, so a record cannot end a turn early, open a
fake turn or supervise an end-of-text token. Only what the template itself writes is a control
token. How: every such spelling in a message is swapped for a private-use character before the
template renders, the render is split at the control tokens left (all of them the template's), and
each piece between them is tokenized with a copy of the tokenizer that has no added tokens; the
swapped characters are put back first. A spelling the template itself looks for in the content
(`'</think>' in content`, `content.split('</think>')`: a reasoning template's markers, when the
tokenizer adds them) is left to the template, which decides what it becomes.

Labels come from the template's render of the whole conversation, so a template that renders an
earlier turn differently once later turns follow (Qwen3 drops an earlier reply's `<think>...</think>`)
is labelled as it renders. A template with `{% generation %}` marks the assistant spans itself; for
any other, each reply's span runs from the end of its header (the template's generation prompt,
found after the user turn before it) to the end of the first end-of-turn token (eos) after that,
and the end of the reply's last line must lie inside it, or the record is refused. Supervised:
the reply and the end-of-turn token that closes it; the newline after it belongs to the next header.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_right
from typing import Any

import numpy as np

IGNORE_INDEX = -100
# Supplementary Private Use Area-A: one character per added token stands for its spelling in text.
_MARK0 = 0xF0000
_MARKS = re.compile("[\U000f0000-\U000ffffd]")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_cache: dict[int, tuple[Any, str, "_Kit"]] = {}


class _Kit:
    """What encode needs of one tokenizer, built once per process."""

    def __init__(self, tokenizer: Any):
        added = {int(i): t.content for i, t in tokenizer.added_tokens_decoder.items() if t.content}
        template = tokenizer.chat_template or ""
        # Tokens the template tests the content for are its own markers (Qwen3's <think> ... </think>).
        self.interpreted = {c for c in added.values()
                            if re.search(rf"""(['"]){re.escape(c)}\1\s+in\b|split\(\s*(['"]){re.escape(c)}\2""", template)}
        self.added = added
        self.ids = {c: i for i, c in added.items()}
        self.text_tokens = [c for c in sorted(added.values(), key=len, reverse=True) if c not in self.interpreted]
        self.mark = {c: chr(_MARK0 + k) for k, c in enumerate(self.text_tokens)}
        self.unmark = {m: c for c, m in self.mark.items()}
        self.text_re = re.compile("|".join(map(re.escape, self.text_tokens))) if self.text_tokens else None
        self.any_re = re.compile("|".join(map(re.escape, sorted(added.values(), key=len, reverse=True)))) if added else None
        self.generation = bool(_GENERATION.search(template))
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"{type(tokenizer).__name__} is not a fast tokenizer: tuneledger needs one (tokenizer.json)")
        import tokenizers

        spec = json.loads(backend.to_str())
        spec["added_tokens"] = []
        self.text = tokenizers.Tokenizer.from_str(json.dumps(spec))  # the same model, no token spelled whole


def kit(tokenizer: Any) -> _Kit:
    """The tokenizer's _Kit, rebuilt when its chat template changes."""
    entry = _cache.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer or entry[1] != (tokenizer.chat_template or ""):
        entry = _cache[id(tokenizer)] = (tokenizer, tokenizer.chat_template or "", _Kit(tokenizer))
    return entry[2]


def _fail(reason: str, turn: int = -1) -> dict:
    return {"input_ids": [], "labels": [], "n_tokens": 0, "n_supervised": 0, "truncated": False, "reason": reason,
            "turn": turn}


def _render(tokenizer: Any, messages: list[dict], gen: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def _generation_spans(tokenizer: Any, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, indices = render_jinja_template(conversations=[messages], chat_template=tokenizer.chat_template,
                                              return_assistant_tokens_mask=True, **tokenizer.special_tokens_map)
    return rendered[0], [tuple(s) for s in indices[0]]


def _header_spans(tokenizer: Any, msgs: list[dict], full: str, eot: str) -> list[tuple[int, int]] | dict:
    """Each reply's span in `full`: its header's end to the end of the first eot after it."""
    spans, cursor = [], 0
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = msgs[i - 1]["content"] if i else ""
        at = full.find(before, cursor) if before else -1
        if at >= 0:
            cursor = at + len(before)
        plain, prompt = _render(tokenizer, msgs[:i]), _render(tokenizer, msgs[:i], gen=True)
        header = prompt[len(plain):] if prompt.startswith(plain) else prompt[len(_common(plain, prompt)):]
        start = -1
        while header:
            at = full.find(header, cursor)
            if at >= 0:
                start = at + len(header)
                break
            header = header[:-1]  # the template may write less of the header once the reply follows
        if start < 0:
            start = cursor
        end = full.find(eot, start)
        if end < 0:
            return _fail(f"chat template renders no end-of-turn token {eot} after assistant turn {i + 1}", i)
        tail = m["content"].rstrip().rsplit("\n", 1)[-1][-32:]  # its last line: templates re-write the rest
        if tail and tail not in full[start:end]:
            return _fail(f"chat template does not render assistant turn {i + 1} between its header and the "
                         f"end-of-turn token {eot}, so its labels cannot be placed", i)
        spans.append((start, end + len(eot)))
        cursor = end + len(eot)
    return spans


def _common(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def encode(messages: list[dict], tokenizer: Any, cutoff_len: int, default_system: str | None = None) -> dict:
    """Render one conversation with the tokenizer's chat template and build its labels.

    `messages`: [{"role": "system"|"user"|"assistant", "content": str}, ...] (data.to_messages).
    Returns {"input_ids": list[int] (<= cutoff_len tokens), "labels": list[int] (same length; -100
    or the id), "n_tokens": int (before truncation), "n_supervised": int (after truncation),
    "truncated": bool, "reason": str ("" when trainable), "turn": int (index in `messages` of the
    turn a reason is about, -1 for none)}. Never raises for a record's content; a template that
    raises does (data._encode_batch counts it against the record).
    """
    shift = 0
    if default_system is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": default_system}] + messages
        shift = 1
    first = next((j for j, m in enumerate(messages) if m["role"] == "assistant"), shift) - shift
    k = kit(tokenizer)
    for j, m in enumerate(messages):
        if _MARKS.search(m["content"]):
            return _fail(f"holds a private-use character U+{ord(_MARKS.search(m['content']).group(0)):X} "
                         "(U+F0000..U+FFFFD), which tuneledger uses to keep token spellings as text", j - shift)
    marked = [dict(m, content=k.text_re.sub(lambda g: k.mark[g.group(0)], m["content"])) if k.text_re else m
              for m in messages]
    eot = tokenizer.eos_token
    if k.generation:
        full, spans = _generation_spans(tokenizer, marked)
        # The end-of-turn token that closes a reply is supervised, as for every other template.
        spans = [(s, e + len(eot)) if full.startswith(eot, e) else (s, e) for s, e in spans]
    else:
        full = _render(tokenizer, marked)
        spans = _header_spans(tokenizer, marked, full, eot)
        if isinstance(spans, dict):
            spans["turn"] = max(-1, spans["turn"] - shift)
            return spans
    ids, offsets = _tokenize(full, k)
    if isinstance(ids, str):
        return _fail(ids, first)
    ids = np.asarray(ids, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(ids), dtype=bool)
    for start, end in (_unmarked(full, k, s) for s in spans):
        mask |= (offsets[:, 0] >= start) & (offsets[:, 1] <= end) & (offsets[:, 1] > offsets[:, 0])
    labels = np.where(mask, ids, IGNORE_INDEX)
    n_tokens = len(ids)
    ids, labels = ids[:cutoff_len], labels[:cutoff_len]
    n_sup = int((labels != IGNORE_INDEX).sum())
    reason = ""
    if not n_sup and mask.any():
        # The kind before the colon is what the stats count; the rest says by how much.
        reason = (f"0 supervised tokens left after cutoff_len: the first assistant reply starts at token "
                  f"{int(mask.argmax()) + 1} of {n_tokens}, cutoff_len is {cutoff_len}")
    elif not n_sup:
        reason = "0 supervised tokens"
    return {"input_ids": ids.tolist(), "labels": labels.tolist(), "n_tokens": n_tokens, "n_supervised": n_sup,
            "truncated": n_tokens > cutoff_len, "reason": reason, "turn": first if reason else -1}


def _unmarked(full: str, k: _Kit, span: tuple[int, int]) -> tuple[int, int]:
    """A span of the marked render in the render with every spelling put back."""
    marks = [m.start() for m in _MARKS.finditer(full)]
    if not marks:
        return span
    extra = [0]
    for p in marks:
        extra.append(extra[-1] + len(k.unmark[full[p]]) - 1)
    return tuple(p + extra[bisect_right(marks, p - 1)] for p in span)


def _tokenize(full: str, k: _Kit) -> tuple[list[int], list[tuple[int, int]]] | tuple[str, None]:
    """Ids and character offsets (in the render with spellings put back) of the marked render:
    the control tokens left in it (the template's) by id, the text between them by `k.text`.
    Returns (reason, None) if the result fails its check."""
    pieces, pos = [], 0  # (is control token, text)
    for m in (k.any_re.finditer(full) if k.any_re else ()):
        if m.start() > pos:
            pieces.append((False, full[pos:m.start()]))
        pieces.append((True, m.group(0)))
        pos = m.end()
    if pos < len(full):
        pieces.append((False, full[pos:]))
    texts = [_MARKS.sub(lambda g: k.unmark[g.group(0)], t) for c, t in pieces if not c]
    encoded = iter(zip(texts, k.text.encode_batch(texts, add_special_tokens=False) if texts else []))
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    at = 0
    for control, text in pieces:
        if control:
            ids.append(k.ids[text])
            offsets.append((at, at + len(text)))
            at += len(text)
            continue
        plain, enc = next(encoded)
        if any(i in k.added for i in enc.ids):
            return "the tokenizer's text model gives an added token's id for plain text", None
        ids.extend(enc.ids)
        offsets.extend((at + s, at + e) for s, e in enc.offsets)
        at += len(plain)
    return ids, offsets
