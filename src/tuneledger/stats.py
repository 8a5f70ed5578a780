"""`tuneledger stats`: how many tokens the data holds, what is invalid, and how many steps it makes.

Prints a table, writes runs/<run_name>/stats.json (and invalid.jsonl with every record left out)
and leaves the tokenized dataset in the cache that train and dry-run read.
Exit codes: 0 ok; 1 no valid record, or the invalid share is above max_invalid_ratio; 2 config.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tuneledger.config import JobConfig, add_preset_option, from_cli
from tuneledger.data import DataError, Prepared, prepare
from tuneledger.model import PreflightError, load_tokenizer

SHOW_INVALID = 10  # printed; all of them go to invalid.jsonl


def gate(prep: Prepared, cfg: JobConfig) -> str | None:
    """Why this dataset must not be trained on, or None. Shared by stats, dryrun and train."""
    rec = prep.report["records"]
    if rec["valid"] == 0:
        return f"no valid record in {', '.join(cfg.dataset)} ({rec['invalid']} invalid)"
    if rec["total"] and rec["invalid"] / rec["total"] > cfg.max_invalid_ratio:
        return (f"{rec['invalid']} of {rec['total']} records are invalid ({rec['invalid'] / rec['total']:.1%}), above "
                f"max_invalid_ratio={cfg.max_invalid_ratio}; fix the data or raise max_invalid_ratio")
    return None


def load_prepared(cfg: JobConfig, progress: bool = True) -> Prepared:
    tokenizer = load_tokenizer(cfg.model_name_or_path)
    return prepare(cfg, tokenizer, progress=progress)


def prepare_for_training(cfg: JobConfig, cpu: bool, timings: dict | None = None) -> Prepared:
    """What dry-run and train do before any rank starts: the preflight checks (printed), the
    tokenized data (from the cache, or made now, in this process), and the data gate.
    `timings`, if given, gets preflight_s and data_s (seconds, for the ETA).

    Raises PreflightError, DataError, or DataError with the gate's reason.
    """
    import time

    from tuneledger.preflight import run_checks

    t0 = time.perf_counter()
    for line in run_checks(cfg, cuda=not cpu):
        print(f"preflight ok: {line}")
    t1 = time.perf_counter()
    prep = load_prepared(cfg)
    if timings is not None:
        timings.update(preflight_s=t1 - t0, data_s=time.perf_counter() - t1)
    problem = gate(prep, cfg)
    if problem:
        raise DataError(problem)
    return prep


def render(prep: Prepared, cfg: JobConfig) -> None:
    from rich.console import Console
    from rich.table import Table

    r = prep.report
    console = Console(width=None if sys.stdout.isatty() else 120)
    t = Table(title=f"tuneledger stats: {', '.join(cfg.dataset)}", show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value", justify="right")
    rec, tok, ln = r["records"], r["tokens"], r["length"]
    t.add_row("records (total / valid / invalid)", f"{rec['total']:,} / {rec['valid']:,} / {rec['invalid']:,}")
    for reason, n in rec["invalid_by_reason"].items():
        t.add_row(f"  invalid: {reason}", f"{n:,}")
    t.add_row("tokens (total, before cutoff)", f"{tok['total']:,}")
    t.add_row(f"tokens trained (after cutoff_len {r['cutoff_len']})", f"{tok['trained']:,}")
    t.add_row("supervised tokens (assistant replies + <end of turn>)", f"{tok['supervised']:,}")
    t.add_row("length mean / median / p95 / max", f"{ln['mean']:,} / {ln['median']:,.0f} / {ln['p95']:,.0f} / {ln['max']:,}")
    t.add_row(f"records over cutoff_len ({r['cutoff_len']}, truncated)", f"{r['over_cutoff']:,}")
    t.add_row("records with 0 supervised tokens (left out)", f"{r['zero_supervised']:,}")
    t.add_row(f"steps per epoch (global batch {r['global_batch_size']})", f"{r['steps_per_epoch']:,}")
    t.add_row("mean tokens per step", f"{r['tokens_per_step']:,.0f}")
    t.add_row("cache", f"{prep.path}{' (hit)' if prep.from_cache else ''}")
    console.print(t)
    # Plain lines, never wrapped, so they grep.
    for inv in prep.invalid[:SHOW_INVALID]:
        print(f"invalid {inv}")
    if len(prep.invalid) > SHOW_INVALID:
        print(f"... and {len(prep.invalid) - SHOW_INVALID} more in {cfg.out_dir / 'invalid.jsonl'}")


def write(prep: Prepared, cfg: JobConfig) -> None:
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    out = dict(prep.report, dataset=cfg.dataset, model=cfg.model_name_or_path, template=cfg.template)
    (cfg.out_dir / "stats.json").write_text(json.dumps(out, indent=1, ensure_ascii=False))
    with open(cfg.out_dir / "invalid.jsonl", "w", encoding="utf-8") as f:
        for inv in prep.invalid:
            f.write(json.dumps(inv.as_dict(), ensure_ascii=False) + "\n")


def run(args: argparse.Namespace) -> int:
    cfg = from_cli(args.items)
    try:
        prep = load_prepared(cfg)
    except (DataError, PreflightError) as e:
        print(f"tuneledger stats: {e}", file=sys.stderr)
        return 1
    render(prep, cfg)
    write(prep, cfg)
    print(f"wrote {cfg.out_dir / 'stats.json'}")
    problem = gate(prep, cfg)
    if problem:
        print(f"tuneledger stats: {problem}", file=sys.stderr)
        return 1
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("stats", help="count tokens, validate records, estimate steps; fills the tokenized cache")
    p.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]")
    add_preset_option(p)
    p.set_defaults(func=run)
