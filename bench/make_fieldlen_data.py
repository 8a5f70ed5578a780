"""Real alpaca records, joined into multi-turn conversations whose lengths match the field report.

The field report's data (../shared/seeds/000_*) averaged 666 tokens per sample, max 1,070; the
alpaca demo sets average 155-194. Issue 6 compares against the report's numbers, so this writes
alpaca-form records (`history` + the last turn) built from whole real records: for each output
record a target length is drawn from N(666, 180) clipped to [64, 1070] (the method of
../shared/notes/h200-baseline.md), and real records are appended as turns, in a seeded shuffle,
until the next one would land further from the target than stopping short. A turn that would
pass 1,070 tokens is never added. Every token is real text; no record is cut. Lengths are measured with the Qwen2.5 chat
template (default system prompt included), the way `tuneledger stats` counts them.

    python bench/make_fieldlen_data.py --tokenizer ../shared/assets/qwen2.5-tokenizer \
        --out .carry/alpaca_fieldlen.json ../shared/data/alpaca_zh_demo.json ../shared/data/alpaca_en_demo.json

The output is derived from the demo data and shares its licence: keep it out of the repo.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from tuneledger.data import read_records, to_messages  # noqa: E402
from tuneledger.model import load_tokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", nargs="+", help="alpaca JSON/JSONL files")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--records", type=int, default=400, help="conversations to write")
    ap.add_argument("--mean", type=float, default=666.0, help="target mean length, tokens")
    ap.add_argument("--std", type=float, default=180.0)
    ap.add_argument("--min", type=int, default=64)
    ap.add_argument("--max", type=int, default=1070, help="hard cap, tokens")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    tok = load_tokenizer(a.tokenizer)
    pool, skipped = [], 0
    for path in a.data:
        for where, obj in read_records(path):
            msgs = to_messages(obj, where)
            if isinstance(msgs, list) and len(msgs) == 2:  # single-turn alpaca records only
                pool.append((msgs[0]["content"], msgs[1]["content"]))
            else:
                skipped += 1
    rng = random.Random(a.seed)
    rng.shuffle(pool)
    targets = np.clip(np.random.default_rng(a.seed).normal(a.mean, a.std, a.records), a.min, a.max)

    def length(turns: list[tuple[str, str]]) -> int:
        msgs = [{"role": r, "content": c} for u, v in turns for r, c in (("user", u), ("assistant", v))]
        return len(tok.apply_chat_template(msgs, tokenize=True, return_dict=False))

    out, lengths, i = [], [], 0
    for target in targets:
        turns: list[tuple[str, str]] = []
        n = 0
        while i < len(pool) and n < target:
            trial = turns + [pool[i]]
            m = length(trial)
            # Stop before a record that passes the cap, or that overshoots the target by more than
            # stopping short would miss it: it starts the next conversation instead.
            if turns and (m > a.max or m - target > target - n):
                break
            turns, n, i = trial, m, i + 1
        if not turns:
            break
        *history, (instruction, output) = turns
        out.append({"instruction": instruction, "input": "", "output": output, "history": [list(h) for h in history]})
        lengths.append(n)
        if i >= len(pool):
            break
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, ensure_ascii=False, indent=1), encoding="utf-8")
    L = np.asarray(lengths)
    print(f"{a.out}: {len(out)} conversations from {i} of {len(pool)} records ({skipped} multi-turn or invalid "
          f"records skipped); tokens mean {L.mean():.0f}, median {np.median(L):.0f}, p95 {np.percentile(L, 95):.0f}, "
          f"max {L.max()}, total {L.sum():,}")


if __name__ == "__main__":
    main()
