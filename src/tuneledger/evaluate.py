"""`tuneledger eval RUN --dataset x.json`: loss and perplexity of a trained run on a held-out file.

    tuneledger eval RUN --dataset heldout.json [--checkpoint N|best] [--out result.json]

The records are read, validated and tokenized exactly as the run's training data was (its template,
cutoff_len, default system prompt and placeholders; `--dataset` takes files or dataset_info.json
names, as `dataset` does). The model is the one `tuneledger chat` loads (the export, or base +
adapter).

    loss = sum of -log p(token) over every supervised token (assistant replies and their end-of-turn
           token, after cutoff_len) / the number of those tokens       (nats per token)
    perplexity = exp(loss)

This is the token-weighted mean, the one transformers' Trainer reports as eval loss for a
micro-batch; records left out as invalid are counted in the report and not scored. Prints one line
and writes the JSON (default: <run>/eval-<dataset>.json).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from tuneledger.chat import ChatError, load


def score(model: Any, tokenizer: Any, ds: Any, batch_size: int = 4) -> dict:
    """Summed NLL and count of supervised tokens of a tokenized dataset (input_ids, labels)."""
    import torch
    from transformers import DataCollatorForSeq2Seq

    collate = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    nll, n = 0.0, 0
    rows = ds.select_columns(["input_ids", "labels"])
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = collate([rows[i] for i in range(start, min(start + batch_size, len(rows)))])
            batch = {k: v.to(model.device) for k, v in batch.items()}
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
            # Token t is predicted from the logits at t - 1.
            labels = batch["labels"][:, 1:]
            lp = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                   ignore_index=-100, reduction="sum")
            nll += float(lp)
            n += int((labels != -100).sum())
    return {"nll_sum": nll, "supervised_tokens": n}


def run(args: argparse.Namespace) -> int:
    from tuneledger.config import JobConfig
    from tuneledger.data import DataError, prepare

    try:
        loaded = load(args.run, args.checkpoint, args.base, args.device)
    except ChatError as e:
        print(f"tuneledger eval: {e}", file=sys.stderr)
        return 1
    saved = dict(loaded.config)
    if not saved:
        print(f"tuneledger eval: {args.run} has no job.json, so its template, cutoff_len and placeholders are unknown; "
              "using the defaults", file=sys.stderr)
    saved.update({"dataset": args.dataset, "model_name_or_path": saved.get("model_name_or_path") or "(export)",
                  "max_samples": args.max_samples, "val_size": 0, "eval_dataset": None})
    cfg = JobConfig(**{k: v for k, v in saved.items() if k in JobConfig.model_fields})
    try:
        prep = prepare(cfg, loaded.tokenizer, progress=False)
    except DataError as e:
        print(f"tuneledger eval: {e}", file=sys.stderr)
        return 1
    import datasets

    ds = datasets.load_from_disk(str(prep.path))
    rec = prep.report["records"]
    if not len(ds):
        print(f"tuneledger eval: no valid record in {args.dataset} ({rec['invalid']} invalid)", file=sys.stderr)
        return 1
    s = score(loaded.model, loaded.tokenizer, ds, args.batch_size)
    loss = s["nll_sum"] / s["supervised_tokens"]
    result = {
        "model": loaded.source, "checkpoint": str(loaded.checkpoint) if loaded.checkpoint else None,
        "dataset": args.dataset, "records": rec["total"], "scored": len(ds), "invalid": rec["invalid"],
        "invalid_by_reason": rec["invalid_by_reason"], "truncated": prep.report["over_cutoff"],
        "cutoff_len": cfg.cutoff_len, "supervised_tokens": s["supervised_tokens"], "loss": loss,
        "perplexity": math.exp(loss), "method": "sum of -log p over supervised tokens / their count; perplexity = exp(loss)",
    }
    out = Path(args.out) if args.out else _default_out(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, ensure_ascii=False))
    print(f"eval {loaded.source} on {','.join(args.dataset)}: {len(ds):,} records ({rec['invalid']:,} invalid, not "
          f"scored), {s['supervised_tokens']:,} supervised tokens: loss {loss:.4f}, perplexity {math.exp(loss):.3f}; "
          f"wrote {out}")
    return 0


def _default_out(args: argparse.Namespace) -> Path:
    from tuneledger.chat import run_dir

    root = run_dir(args.run)
    if root.name.startswith("checkpoint-") or root.name == "export":
        root = root.parent
    stem = "+".join(Path(d).stem for d in args.dataset)
    return root / f"eval-{stem}.json"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("eval", help="loss and perplexity of a trained run on a held-out file (one line + JSON)")
    p.add_argument("run", help="run name (runs/RUN), run folder, checkpoint-N folder or export folder")
    p.add_argument("--dataset", required=True, type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                   help="files (.json/.jsonl) or dataset_info.json names, comma-separated")
    p.add_argument("--checkpoint", help="N or best (default: the export if there is one, else the newest checkpoint)")
    p.add_argument("--base", help="the base model (default: the run's model_name_or_path)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-samples", type=int, help="score at most this many records of each dataset")
    p.add_argument("--out", help="the JSON's path (default: <run>/eval-<dataset>.json)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda when there is one)")
    p.set_defaults(func=run)
