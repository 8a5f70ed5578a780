"""`tuneledger eval RUN --dataset x.json`: loss and perplexity of a trained run on a held-out file.

    tuneledger eval RUN --dataset heldout.json [--checkpoint N|best] [--out result.json] [--predict]
    tuneledger eval lf_predict.yaml [key=value ...]   # LLaMA-Factory's predict yaml (do_predict: true)

A config (usecfg) gives the model (adapter_name_or_path on model_name_or_path, or a training
config's run), eval_dataset (--dataset), output_dir (results go there as predict_results.json),
per_device_eval_batch_size, max_samples, and the data settings (template, cutoff_len,
default_system, ...), which win over the run's. With `do_predict: true` and
`predict_with_generate: true` (or --predict) it also generates greedily, at most max_new_tokens
(default 512) per record, and writes LLaMA-Factory's generated_predictions.jsonl beside the JSON
(predict.py). A benchmark config (`task: mmlu_test`) is refused in one line naming
lm-evaluation-harness on `tuneledger export`'s output.

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

from tuneledger.checkpoints import LoadError
from tuneledger.files import write_text_atomic
from tuneledger.loading import load
from tuneledger.words import count_at_least


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
    from tuneledger.config import ConfigError, JobConfig
    from tuneledger.prepare import prepare
    from tuneledger.templateinfo import template_line
    from tuneledger.usecfg import resolve_use

    use = resolve_use("eval", list(args.items))
    dataset = args.dataset or use.get("eval_dataset")
    if isinstance(dataset, str):
        dataset = [d.strip() for d in dataset.split(",") if d.strip()]
    if not dataset:
        raise ConfigError(f"{use.where}: what to score: --dataset FILES, or eval_dataset in the config")
    predict = args.predict or bool(use.get("do_predict") and use.get("predict_with_generate"))
    try:
        loaded = load(use.run, args.checkpoint, args.base or use.base, args.device)
    except LoadError as e:
        print(f"tuneledger eval: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 1)
    saved = dict(loaded.config)
    if not saved and not use.job:
        print(f"tuneledger eval: {use.run or use.base} has no job.json, so its template, cutoff_len and placeholders "
              "are unknown; using the defaults", file=sys.stderr)
    saved.update({k: v for k, v in use.job.items() if k not in ("dataset", "eval_dataset", "max_samples")})
    saved.update({"dataset": dataset, "model_name_or_path": saved.get("model_name_or_path") or "(export)",
                  "max_samples": args.max_samples or use.get("max_samples"), "val_size": 0, "eval_dataset": None})
    try:
        cfg = JobConfig(**{k: v for k, v in saved.items() if k in JobConfig.model_fields})
    except ValueError as e:  # pydantic's ValidationError: a bad value in the config or the run's job.json
        raise ConfigError(f"{use.where}: {e}") from None
    print(template_line(cfg.template, loaded.tokenizer.chat_template, loaded.source), file=sys.stderr, flush=True)
    prep = prepare(cfg, loaded.tokenizer, progress=False)  # a DataError: cli.main says it and exits 2
    import datasets

    ds = datasets.load_from_disk(str(prep.path))
    rec = prep.report["records"]
    if not len(ds):
        print(f"tuneledger eval: no valid record in {','.join(dataset)} ({rec['invalid']} invalid)", file=sys.stderr)
        return 2  # bad data, as a DataError
    s = score(loaded.model, loaded.tokenizer, ds, args.batch_size or int(use.get("per_device_eval_batch_size", 4)))
    loss = s["nll_sum"] / s["supervised_tokens"]
    result = {
        "model": loaded.source, "checkpoint": str(loaded.checkpoint) if loaded.checkpoint else None,
        "dataset": dataset, "records": rec["total"], "scored": len(ds), "invalid": rec["invalid"],
        "invalid_by_reason": rec["invalid_by_reason"], "truncated": prep.report["over_cutoff"],
        "cutoff_len": cfg.cutoff_len, "supervised_tokens": s["supervised_tokens"], "loss": loss,
        "perplexity": math.exp(loss), "method": "sum of -log p over supervised tokens / their count; perplexity = exp(loss)",
    }
    out = Path(args.out) if args.out else _default_out(use, dataset)
    said = ""
    if predict:
        from tuneledger.predict import conversations, generate, write_jsonl

        max_new = args.max_new_tokens or int(use.get("max_new_tokens", 512))
        rows, cut = generate(loaded.model, loaded.tokenizer, conversations(cfg, set(ds["where"])), max_new,
                             cfg.cutoff_len, cfg.default_system)
        pred = out.parent / "generated_predictions.jsonl"
        write_jsonl(rows, pred)
        result.update({"predict_loss": loss, "predictions": str(pred), "predictions_count": len(rows),
                       "max_new_tokens": max_new, "prompts_cut_to_cutoff_len": cut, "generation": "greedy"})
        said = f"; {len(rows):,} greedy predictions (at most {max_new} new tokens each) in {pred}"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(result, indent=1, ensure_ascii=False))
    print(f"eval {loaded.source} on {','.join(dataset)}: {len(ds):,} records ({rec['invalid']:,} invalid, not "
          f"scored), {s['supervised_tokens']:,} supervised tokens: loss {loss:.4f}, perplexity {math.exp(loss):.3f}; "
          f"wrote {out}{said}")
    return 0


def _default_out(use: Any, dataset: list[str]) -> Path:
    """A predict config's output_dir/predict_results.json (LLaMA-Factory's name), else
    <run>/eval-<dataset>.json."""
    from tuneledger.loading import run_dir

    if use.get("output_dir") and (use.get("adapter_name_or_path") or use.run is None):
        return Path(use.get("output_dir")) / "predict_results.json"
    root = run_dir(use.run) if use.run else Path(".")
    if root.name.startswith("checkpoint-") or root.name == "export":
        root = root.parent
    stem = "+".join(Path(d).stem for d in dataset)
    return root / f"eval-{stem}.json"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("eval", help="loss and perplexity of a trained run on a held-out file (one line + JSON); "
                       "greedy predictions with --predict or a predict config")
    p.add_argument("items", nargs="+", metavar="RUN|CONFIG.yaml [key=value ...]",
                   help="run name (runs/RUN), run, checkpoint-N or export folder; or a LLaMA-Factory predict yaml "
                   "(adapter_name_or_path, eval_dataset, do_predict, predict_with_generate, output_dir, ...)")
    p.add_argument("--dataset", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                   help="files (.json/.jsonl) or dataset_info.json names, comma-separated (default: eval_dataset)")
    p.add_argument("--checkpoint", help="N or best (default: the export if there is one, else the newest checkpoint)")
    p.add_argument("--base", help="the base model (default: the config's model_name_or_path, else the run's)")
    p.add_argument("--batch-size", type=count_at_least(1), help="default: per_device_eval_batch_size, else 4")
    p.add_argument("--max-samples", type=count_at_least(1), help="score at most this many records of each dataset")
    p.add_argument("--predict", action="store_true", help="also generate greedily on each record and write "
                   "generated_predictions.jsonl beside the JSON (LLaMA-Factory's predict_with_generate)")
    p.add_argument("--max-new-tokens", type=count_at_least(1), help="tokens generated per record at most (default: max_new_tokens, "
                   "else 512)")
    p.add_argument("--out", help="the JSON's path (default: output_dir/predict_results.json for a predict config, "
                   "else <run>/eval-<dataset>.json)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda when there is one)")
    p.set_defaults(func=run)
