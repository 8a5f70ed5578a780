"""`tuneledger stats`: how many tokens the data holds, what is invalid, and how many steps it makes.

Prints a table, writes runs/<run_name>/stats.json (and invalid.jsonl with every record left out)
and leaves the tokenized dataset in the cache that train and dry-run read.
Exit codes: 0 ok; 2 bad input (the config, a data file that cannot be read, no valid record, or the
invalid share above max_invalid_ratio); 1 a check of the model failed.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tuneledger.config import JobConfig
from tuneledger.config_load import add_preset_option, from_cli
from tuneledger.data_report import gate, print_invalid, run_data_hash, write  # noqa: F401  (stats' API too)
from tuneledger.model_location import PreflightError
from tuneledger.prepare import Prepared, checked_tokenizer, prepare
from tuneledger.words import count_at_least


def render(prep: Prepared, cfg: JobConfig, tokenizer: Any = None) -> None:
    from rich.table import Table

    from tuneledger.tables import print_table

    r = prep.report
    t = Table(title=f"tuneledger stats: {', '.join(cfg.dataset)}", show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value", justify="right")
    rec, tok, ln = r["records"], r["tokens"], r["length"]
    t.add_row("model", cfg.model_name_or_path)
    named = (f"{tokenizer.name_or_path} ({type(tokenizer).__name__}, {len(tokenizer):,} tokens), " if tokenizer is not None else "")
    t.add_row("tokenizer", f"{named}fingerprint {r['tokenizer_fingerprint']}")
    t.add_row("data hash (cache key)", r["cache_key"])
    t.add_row("records (total / valid / invalid)", f"{rec['total']:,} / {rec['valid']:,} / {rec['invalid']:,}")
    for reason, n in rec["invalid_by_reason"].items():
        t.add_row(f"  invalid: {reason}", f"{n:,}")
    t.add_row("tokens (total, before cutoff)", f"{tok['total']:,}")
    t.add_row(f"tokens trained (after cutoff_len {r['cutoff_len']})", f"{tok['trained']:,}")
    t.add_row("supervised tokens (assistant replies + <end of turn>)", f"{tok['supervised']:,}")
    t.add_row("length mean / median / p95 / max", f"{ln['mean']:,} / {ln['median']:,.0f} / {ln['p95']:,.0f} / {ln['max']:,}")
    t.add_row(f"records over cutoff_len ({r['cutoff_len']}, truncated)", f"{r['over_cutoff']:,}")
    t.add_row("records with 0 supervised tokens (left out)", f"{r['zero_supervised']:,}")
    if r.get("eval_records"):
        t.add_row(f"held out for evaluation (val_size={cfg.val_size:g}, seed {cfg.seed})", f"{r['eval_records']:,}")
    t.add_row(f"steps per epoch (global batch {r['global_batch_size']})", f"{r['steps_per_epoch']:,}")
    t.add_row("mean tokens per step", f"{r['tokens_per_step']:,.0f}")
    t.add_row("cache", f"{prep.path}{' (hit)' if prep.from_cache else ''}")
    if prep.rebuilt:  # the damaged cache found there, set aside; this one was built again
        t.add_row("cache rebuilt (1 damaged)", prep.rebuilt)
    print_table(t, width=120)
    print_invalid(prep, cfg)


def run(args: argparse.Namespace) -> int:
    cfg = from_cli(args.items)
    from tuneledger.launch import processes

    world = processes(args.cpu, args.nproc)[1]
    if cfg.batch_from_accumulation:
        # Its global batch is a multiple of the world size: count the ranks as train will, or
        # steps per epoch is off by that factor.
        from tuneledger.config import resolve

        cfg = resolve(cfg, world)
        print(f"global batch {cfg.global_batch_size} = micro-batch {cfg.per_device_train_batch_size} x gradient "
              f"accumulation {cfg.gradient_accumulation_steps} x world size {world} (--nproc / NPROC to change)")
    try:
        tokenizer = checked_tokenizer(cfg)  # the same model checks as dryrun and train
        prep = prepare(cfg, tokenizer)
    except PreflightError as e:  # a DataError is bad input: cli.main says it and exits 2
        print(f"tuneledger stats: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 1)
    render(prep, cfg, tokenizer)
    problem = gate(prep, cfg, world)
    path = write(prep, cfg, gate_passed=not problem)
    print(f"wrote {path}")
    if problem:
        print(f"tuneledger stats: {problem}", file=sys.stderr)
        return 2  # refused data is bad input, as a refused key is (cli.BAD_INPUT)
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("stats", help="count tokens, validate records, estimate steps; fills the tokenized cache")
    p.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]")
    add_preset_option(p)
    # Only a config that gives gradient_accumulation_steps instead of global_batch_size needs these.
    p.add_argument("--nproc", type=count_at_least(1), help="ranks train will run, for a global batch given as accumulation "
                   "(default: every visible GPU; 2 on a CPU)")
    p.add_argument("--cpu", action="store_true", help="count the ranks of a CPU run (2 unless --nproc)")
    p.set_defaults(func=run)
