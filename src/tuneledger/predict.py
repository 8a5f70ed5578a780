"""Greedy generation on held-out records: LLaMA-Factory's `do_predict` + `predict_with_generate`.

For each valid record (the ones eval scores), the conversation up to its last assistant reply is
rendered with the tokenizer's chat template and a generation prompt (the run's default system
prompt added as in training), cut to its last `cutoff_len` tokens, and continued greedily for at
most `max_new_tokens` tokens or until an end-of-turn token (loading.stop_ids). One record at a
time, so no padding changes an answer.

generated_predictions.jsonl, LLaMA-Factory's format, one JSON object per line:
    {"prompt": the rendered prompt, special tokens kept (as LLaMA-Factory decodes it),
     "predict": the generated reply, special tokens dropped,
     "label": the record's last assistant reply}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def conversations(cfg: Any, wheres: set[str]) -> list[list[dict]]:
    """The conversations ([{"role", "content"}, ...]) of `cfg.dataset` whose location (`file:line`,
    the tokenized dataset's "where") is in `wheres`, read as data.prepare reads them (sources,
    column mapping, placeholders, max_samples per dataset). Raises data.DataError."""
    from tuneledger.data import read_records, to_messages
    from tuneledger.dataset_info import resolve_sources

    out: list[list[dict]] = []
    for src in resolve_sources(cfg.dataset, cfg.dataset_dir, cfg.cache_dir):
        taken = 0
        for where, obj in (rec for f in src.files for rec in read_records(f)):
            if cfg.max_samples is not None and taken >= cfg.max_samples:
                break
            taken += 1
            if where in wheres:
                msgs = to_messages(src.convert(obj, where), where, cfg.placeholders)
                if isinstance(msgs, list):
                    out.append(msgs)
    return out


def generate(model: Any, tokenizer: Any, convs: list[list[dict]], max_new_tokens: int, cutoff_len: int,
             default_system: str | None = None, every_s: float = 10.0) -> tuple[list[dict], int]:
    """Greedy replies to each conversation's last user turn. Returns (rows of
    generated_predictions.jsonl, the number of prompts cut to cutoff_len tokens). Prints a progress
    line after the first reply, the last, and at most every `every_s` s between: a CPU takes
    minutes for a few records, and a silent terminal reads as a hang."""
    import time

    import torch

    from tuneledger.ledger import fmt_h
    from tuneledger.loading import stop_ids

    rows, cut, stops = [], 0, stop_ids(tokenizer)
    t0, shown, new_tokens = time.perf_counter(), 0.0, 0
    for i, msgs in enumerate(convs, 1):
        if default_system is not None and msgs[0]["role"] != "system":
            msgs = [{"role": "system", "content": default_system}] + msgs
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        text = tokenizer.apply_chat_template(msgs[:last], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > cutoff_len:
            ids, cut = ids[-cutoff_len:], cut + 1
        x = torch.tensor([ids], device=model.device)
        with torch.no_grad():
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)
        rows.append({"prompt": tokenizer.decode(ids, skip_special_tokens=False),
                     "predict": tokenizer.decode(out[0, x.shape[1]:], skip_special_tokens=True),
                     "label": msgs[last]["content"]})
        new_tokens += out.shape[1] - x.shape[1]
        now = time.perf_counter()
        if i in (1, len(convs)) or now - shown >= every_s:
            shown, per = now, (now - t0) / i
            print(f"predict: {i}/{len(convs)} replies, {new_tokens:,} new tokens in {now - t0:.1f} s"
                  + (f"; ~{fmt_h(per * (len(convs) - i))} more" if i < len(convs) else ""), flush=True)
    return rows, cut


def write_jsonl(rows: list[dict], path: Path) -> None:
    """One JSON object per line (UTF-8, not ASCII-escaped), as LLaMA-Factory writes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
