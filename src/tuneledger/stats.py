"""`tuneledger stats`: how many tokens the data holds, what is invalid, and how many steps it makes.

Prints a table, writes runs/<run_name>/stats.json (and invalid.jsonl with every record left out)
and leaves the tokenized dataset in the cache that train and dry-run read.
Exit codes: 0 ok; 1 no valid record, or the invalid share is above max_invalid_ratio; 2 config.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from tuneledger.config import JobConfig
from tuneledger.config_load import add_preset_option, from_cli
from tuneledger.data import DataError, Prepared, prepare
from tuneledger.model import (PreflightError, check_embedding_rows, check_remote_code, check_text_causal_lm, load_tokenizer,
                              read_model_config)

SHOW_INVALID = 10  # printed; all of them go to invalid.jsonl


def gate(prep: Prepared, cfg: JobConfig, world: int = 1) -> str | None:
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
        return (f"{rec['invalid']} of {rec['total']} records are invalid ({rec['invalid'] / rec['total']:.1%}), above "
                f"max_invalid_ratio={cfg.max_invalid_ratio}; {fix}, or raise it: max_invalid_ratio="
                f"{min(1.0, round(rec['invalid'] / rec['total'] + 0.005, 2)):g}")
    train = prep.report.get("train_records", rec["valid"])
    if train < cfg.global_batch_size:
        held = f" ({rec['valid']:,} valid, {rec['valid'] - train:,} held out by val_size={cfg.val_size:g})" if cfg.val_size else ""
        head = (f"{train:,} training record(s){held} in {', '.join(cfg.dataset)} are fewer than one global batch "
                f"(global_batch_size={cfg.global_batch_size}): not one full step. ")
        if train < world:
            return head + f"They are fewer than the {world} ranks too: add data, or run on {train} rank(s) or fewer"
        fits = train // world * world  # micro-batch 1 x accumulation fits/world makes any multiple of the ranks
        return head + (f"The largest global batch that works on {world} rank(s) is {fits}: global_batch_size={fits}"
                       + (" per_device_train_batch_size=1" if world > 1 else "") + ", or add data")
    return None


def load_prepared(cfg: JobConfig, progress: bool = True, model_checked: bool = False) -> Prepared:
    """The model checks that need only config.json and the tokenizer (the same for stats, dryrun
    and train: a VL variant, a tokenizer past the embedding rows), then the prepared data.
    `model_checked`: preflight.run_checks already did the config.json checks. Raises
    PreflightError or DataError."""
    return prepare(cfg, checked_tokenizer(cfg, model_checked), progress=progress)


def checked_tokenizer(cfg: JobConfig, model_checked: bool = False) -> Any:
    """The model's tokenizer, after the checks that need only config.json and the tokenizer: a VL
    variant, code shipped with the model (both skipped when `model_checked`: preflight did them),
    ids past the embedding rows. Raises PreflightError."""
    config = read_model_config(cfg.model_name_or_path)
    if not model_checked:
        check_text_causal_lm(config, cfg.model_name_or_path)
        check_remote_code(config, cfg.model_name_or_path, cfg.trust_remote_code)
    tokenizer = load_tokenizer(cfg.model_name_or_path)
    check_embedding_rows(tokenizer, config, cfg.model_name_or_path)
    return tokenizer


def prepare_for_training(cfg: JobConfig, cpu: bool, timings: dict | None = None, world: int = 1) -> Prepared:
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
    prep = load_prepared(cfg, model_checked=True)
    # What was left out is reported here exactly as `stats` reports it, and written beside the run.
    rec = prep.report["records"]
    print(f"records: {rec['total']:,} total, {rec['valid']:,} valid, {rec['invalid']:,} invalid"
          + "".join(f"\n  invalid: {kind}: {n:,}" for kind, n in rec["invalid_by_reason"].items()))
    problem = gate(prep, cfg, world)
    print_invalid(prep, cfg, training=True, gate_passed=not problem)
    write(prep, cfg, gate_passed=not problem, training=True)
    if timings is not None:
        timings.update(preflight_s=t1 - t0, data_s=time.perf_counter() - t1)
    if problem:
        raise DataError(problem)
    return prep


def prepare_eval(cfg: JobConfig) -> Prepared | None:
    """The tokenized eval_dataset (same template, cutoff and placeholders as the training data), or
    None without one. Raises DataError when it has no valid record."""
    if not cfg.eval_dataset or cfg.eval_strategy == "no":
        return None
    ev = cfg.model_copy(update={"dataset": cfg.eval_dataset, "eval_dataset": None})
    prep = load_prepared(ev, model_checked=True)  # after prepare_for_training: same model
    if not prep.report["records"]["valid"]:
        raise DataError(f"eval_dataset {', '.join(cfg.eval_dataset)}: no valid record ({prep.report['records']['invalid']} invalid)")
    print(f"eval data: {prep.report['records']['valid']:,} records of {', '.join(cfg.eval_dataset)}")
    return prep


def render(prep: Prepared, cfg: JobConfig, tokenizer: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    r = prep.report
    console = Console(width=None if sys.stdout.isatty() else 120)
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
    console.print(t)
    print_invalid(prep, cfg)


def print_invalid(prep: Prepared, cfg: JobConfig, training: bool = False, gate_passed: bool = True) -> None:
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


def _suffix(prep: Prepared, cfg: JobConfig, training: bool) -> str:
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


def write(prep: Prepared, cfg: JobConfig, gate_passed: bool = True, training: bool = False) -> Path:
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
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False))
    with open(out_dir / f"invalid{suffix}.jsonl", "w", encoding="utf-8") as f:
        for inv in prep.invalid:
            f.write(json.dumps(inv.as_dict(), ensure_ascii=False) + "\n")
    if suffix and not training:  # train and dryrun say themselves whether the data change stops them
        print(f"{out_dir} belongs to data {owner[0]} ({owner[1]}); these stats are of other data ({key}), so they went "
              f"to {path.name}, leaving the run's own stats.json as it was. To train on this data, give it a run of "
              f"its own: RUN=<name> (run_name=<name>).")
    return path


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
        return 1
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
    p.add_argument("--nproc", type=int, help="ranks train will run, for a global batch given as accumulation "
                   "(default: every visible GPU; 2 on a CPU)")
    p.add_argument("--cpu", action="store_true", help="count the ranks of a CPU run (2 unless --nproc)")
    p.set_defaults(func=run)
