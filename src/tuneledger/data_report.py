"""What preparing the data reports, the same for stats, dryrun and train: its numbers (`summarize`,
`with_batch`), the gate that refuses data not fit to train on, the invalid records printed (the
first SHOW_INVALID) and written (all of them), and stats.json, in the run directory that owns this
data or beside it.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tuneledger.files import write_text_atomic
from tuneledger.words import plural

if TYPE_CHECKING:  # prepare.Prepared and data.Invalid are named as strings: prepare and data import this module
    from tuneledger.config import JobConfig

SHOW_INVALID = 10  # printed; all of them go to invalid.jsonl


def _length_summary(lengths: np.ndarray) -> dict:
    if not len(lengths):
        return {"mean": 0, "median": 0, "p95": 0, "max": 0}
    # Percentiles are data values: the smallest at or above the interpolated rank (numpy "higher").
    return {"mean": round(float(lengths.mean()), 1), "median": int(np.percentile(lengths, 50, method="higher")),
            "p95": int(np.percentile(lengths, 95, method="higher")), "max": int(lengths.max())}


def summarize(ds: Any, total: int, invalid: list["Invalid"], cfg: Any) -> dict:
    """The stats of a prepared dataset. Token counts are of the rendered conversation.

    Keys: records {total, valid, invalid, invalid_by_reason}; tokens {total (before cutoff),
    trained (after cutoff), supervised (after cutoff)}; length {mean, median, p95, max} in tokens
    before cutoff; over_cutoff (records truncated); zero_supervised. `with_batch` adds the steps.
    """
    n_tokens = np.asarray(ds["n_tokens"] if len(ds) else [], dtype=np.int64)
    n_sup = np.asarray(ds["n_supervised"] if len(ds) else [], dtype=np.int64)
    trained = np.minimum(n_tokens, cfg.cutoff_len)
    valid = len(ds)
    by_reason = Counter(i.kind for i in invalid)
    return {
        "records": {"total": total, "valid": valid, "invalid": len(invalid), "invalid_by_reason": dict(by_reason.most_common())},
        "tokens": {"total": int(n_tokens.sum()), "trained": int(trained.sum()), "supervised": int(n_sup.sum())},
        "length": _length_summary(n_tokens),
        "over_cutoff": int((n_tokens > cfg.cutoff_len).sum()),
        "zero_supervised": by_reason.get("0 supervised tokens left after cutoff_len", 0) + by_reason.get("0 supervised tokens", 0),
        "cutoff_len": cfg.cutoff_len,
    }


def holdout_count(n: int, val_size: float) -> int:
    """Records held out for evaluation from `n`: ceil(val_size x n) for a fraction (< 1), val_size
    itself for a count (>= 1), as datasets' train_test_split counts them. Never more than n."""
    import math

    if not val_size:
        return 0
    return min(n, math.ceil(val_size * n) if val_size < 1 else int(val_size))


def with_batch(report: dict, cfg: Any) -> dict:
    """The report plus what depends on the batch and the held-out share, not on the data (so not
    cached with it): train_records = valid - held out (val_size), steps_per_epoch =
    ceil(train_records / global batch), and the mean trained tokens per step."""
    valid, gb = report["records"]["valid"], cfg.global_batch_size
    held = holdout_count(valid, getattr(cfg, "val_size", 0))
    train = valid - held
    steps = -(-train // gb) if train else 0
    return {**report, "global_batch_size": gb, "steps_per_epoch": steps, "eval_records": held, "train_records": train,
            "tokens_per_step": round(report["tokens"]["trained"] * train / valid / steps, 1) if steps else 0.0}


def gate(prep: "Prepared", cfg: JobConfig, world: int = 1) -> str | None:
    """Why this dataset must not be trained on, or None. Shared by stats, dryrun and train;
    `world` (ranks) makes the advice for too few records a global batch that works."""
    rec = prep.report["records"]
    if rec["total"] == 0:
        return f"no record in {', '.join(cfg.dataset)}: the data files hold no record"
    if rec["valid"] == 0:
        kinds = "; ".join(f"{kind}: {n:,}" for kind, n in rec["invalid_by_reason"].items())
        example = f"; the first: {prep.invalid[0]}" if prep.invalid else ""
        return f"no valid record in {', '.join(cfg.dataset)}: all {rec['invalid']:,} are invalid ({kinds}){example}"
    if cfg.val_size and prep.report.get("train_records", 1) <= 0:
        return (f"val_size={cfg.val_size:g} holds out all {rec['valid']} valid records of {', '.join(cfg.dataset)}: "
                "nothing is left to train on; lower val_size")
    if rec["total"] and rec["invalid"] / rec["total"] > cfg.max_invalid_ratio:
        fix = "fix the data"
        # LLaMA-Factory's identity set ships {{name}}/{{author}}: the fix is an override, not an edit.
        keys = sorted({m.group(1) for inv in prep.invalid if inv.kind == "unfilled placeholder"
                       for m in [re.search(r"\{\{(\w+)\}\}", inv.reason)] if m})
        if keys:
            fix = "fill the placeholders: " + " ".join(f"placeholders.{k}=..." for k in keys) + ", or fix the data"
        return (f"{rec['invalid']:,} of {rec['total']:,} records are invalid ({rec['invalid'] / rec['total']:.1%}), above "
                f"max_invalid_ratio={cfg.max_invalid_ratio}; {fix}, or raise it: max_invalid_ratio="
                f"{math.ceil(round(rec['invalid'] * 100 / rec['total'], 9)) / 100:g}")  # the smallest that passes (the check is >)
    train = prep.report.get("train_records", rec["valid"])
    if train < cfg.global_batch_size:
        held = f" ({rec['valid']:,} valid, {rec['valid'] - train:,} held out by val_size={cfg.val_size:g})" if cfg.val_size else ""
        verb = "is" if train == 1 else "are"
        head = (f"{plural(train, 'training record')}{held} in {', '.join(cfg.dataset)} {verb} fewer than one global batch "
                f"(global_batch_size={cfg.global_batch_size}): not one full step. ")
        if train < world:
            most = "1 rank" if train == 1 else f"{train} ranks or fewer"
            return head + f"{'It is' if train == 1 else 'They are'} fewer than the {world} ranks too: add data, or run on {most}"
        fits = train // world * world  # micro-batch 1 x accumulation fits/world makes any multiple of the ranks
        return head + (f"The largest global batch that works on {plural(world, 'rank')} is {fits}: global_batch_size={fits}"
                       + (" per_device_train_batch_size=1" if world > 1 else "") + ", or add data")
    return None


def print_invalid(prep: "Prepared", cfg: JobConfig, training: bool = False, gate_passed: bool = True) -> None:
    """The first SHOW_INVALID records left out, as plain lines (never wrapped, so they grep), and
    the file `write` puts all of them in (invalid.jsonl, or invalid-<hash>.jsonl beside another
    run's data)."""
    path = cfg.out_dir / f"invalid{_suffix(prep, cfg, training and gate_passed)}.jsonl"
    for inv in prep.invalid[:SHOW_INVALID]:
        print(f"invalid {inv}")
    if len(prep.invalid) > SHOW_INVALID:
        print(f"... and {len(prep.invalid) - SHOW_INVALID} more in {path}")
    elif prep.invalid:
        print(f"(all of them in {path})")


def _suffix(prep: "Prepared", cfg: JobConfig, training: bool) -> str:
    """'' when the run directory is this data's (or new), else '-<cache key>' (see write)."""
    owner = run_data_hash(cfg.out_dir, training_only=training)
    key = prep.report["cache_key"]
    return f"-{key}" if owner and owner[0] != key else ""


def run_data_hash(out_dir: Path, training_only: bool = False) -> tuple[str, str] | None:
    """(data hash, the file that says so) of the run in `out_dir`, or None for a new run.

    A run directory belongs to one data hash: the tokenized cache's key (data files' sha256,
    tokenizer, template, cutoff_len, ...), the `data_hash` of the ledgers. The training run's
    job.json decides first, then the dry-run ledger, then stats.json; `training_only` reads job.json alone.
    """
    sources = [("job.json", lambda d: Path(d["data_path"]).name)]
    if not training_only:
        # Stats whose data failed the gate claim nothing: the user fixes the data and counts again.
        sources += [("dryrun.json", lambda d: d["data_hash"]),
                    ("stats.json", lambda d: d["cache_key"] if d.get("gate_passed", True) else None)]
    for name, read in sources:
        try:
            key = read(json.loads((out_dir / name).read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if key:
            return key, str(out_dir / name)
    return None


def write(prep: "Prepared", cfg: JobConfig, gate_passed: bool = True, training: bool = False) -> Path:
    """Write stats.json and invalid.jsonl into the run directory, or, when that run belongs to
    other data, stats-<hash>.json and invalid-<hash>.jsonl beside them. Returns the stats path.

    `gate_passed`: whether the data passed `gate` (stats that failed it claim no run directory).
    `training`: written by dryrun or train: only a training's job.json sends these stats beside the
    run's, and quietly (the resume check refuses changed data, naming both hashes); a refused
    start (not `gate_passed`) goes beside whatever data the run already holds."""
    out_dir, key = cfg.out_dir, prep.report["cache_key"]
    # A start the gate refused claims nothing: it must not rewrite the stats of the run's own data.
    owner = run_data_hash(out_dir, training_only=training and gate_passed)
    suffix = f"-{key}" if owner and owner[0] != key else ""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = dict(prep.report, dataset=cfg.dataset, model=cfg.model_name_or_path, template=cfg.template,
               gate_passed=gate_passed)
    path = out_dir / f"stats{suffix}.json"
    write_text_atomic(path, json.dumps(out, indent=1, ensure_ascii=False))
    with open(out_dir / f"invalid{suffix}.jsonl", "w", encoding="utf-8") as f:
        for inv in prep.invalid:
            f.write(json.dumps(inv.as_dict(), ensure_ascii=False) + "\n")
    if suffix and not training:  # train and dryrun say themselves whether the data change stops them
        print(f"{out_dir} belongs to data {owner[0]} ({owner[1]}); these stats are of other data ({key}), so they went "
              f"to {path.name}, leaving the run's own stats.json as it was. To train on this data, give it a run of "
              f"its own: RUN=<name> (run_name=<name>).")
    return path
