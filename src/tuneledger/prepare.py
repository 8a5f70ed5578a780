"""The data preparation that stats, dryrun and train share: validate, tokenize, cache.

`prepare` reads every record of a config's datasets (records.py streams them), validates them
(data.to_messages), tokenizes the valid ones in parallel and saves the sealed cache (cache.py) that
training ranks memory-map; `load_prepared` and `checked_tokenizer` add the model checks that need
only config.json and the tokenizer; `prepare_for_training` is what dryrun and train do before any
rank starts, `prepare_eval` the same for an eval_dataset.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tuneledger import cache
from tuneledger.data import (DataError, Invalid, bad_text, cache_key, encode, file_sha256, is_chatml_name, num_proc,
                             read_records, summarize, to_messages, tokenizer_fingerprint, with_batch)
from tuneledger.data_report import gate, print_invalid, write
from tuneledger.model import check_embedding_rows, check_remote_code, check_text_causal_lm, read_model_config
from tuneledger.tokenizer_load import load_tokenizer

if TYPE_CHECKING:
    from tuneledger.config import JobConfig


@dataclass
class Prepared:
    """A tokenized, validated dataset on disk and what was found on the way.

    `path` holds a `datasets.Dataset` (columns input_ids, labels, n_tokens, n_supervised,
    truncated, where) with only trainable records; `report` is the stats (see `summarize`);
    `invalid` lists every record left out, with its reason. `rebuilt` says what was damaged in
    the cache found at `path` (set aside and built again), "" when nothing was.
    """

    path: Path
    report: dict
    invalid: list[Invalid]
    from_cache: bool
    rebuilt: str = ""


def _encode_batch(batch: dict, tokenizer: Any, cutoff_len: int, default_system: str | None) -> dict:
    out: dict[str, list] = {k: [] for k in ("input_ids", "labels", "n_tokens", "n_supervised", "truncated", "reason")}
    out["field"] = []
    for messages, fields in zip(batch["messages"], batch["fields"]):
        try:
            enc = encode(messages, tokenizer, cutoff_len, default_system)
        except Exception as e:  # a template or tokenizer fault of one record costs that record only
            enc = {"input_ids": [], "labels": [], "n_tokens": 0, "n_supervised": 0, "truncated": False,
                   "reason": f"cannot be rendered or tokenized: {type(e).__name__}: {str(e)[:200]}", "turn": -1}
        turn = enc.pop("turn", -1)
        out["field"].append(fields[turn] if 0 <= turn < len(fields) else "<record>")
        for k, v in enc.items():
            out[k].append(v)
    return out


def prepare(cfg: Any, tokenizer: Any, progress: bool = True) -> Prepared:
    """Validate, tokenize (in parallel) and cache `cfg.dataset` for `tokenizer`.

    The cache key covers every data file's sha256, the tokenizer fingerprint, the template,
    default_system, cutoff_len, placeholders and max_samples; a hit loads in well under a second
    and is what training ranks read, so no rank tokenizes inside the process group. A cache is a
    hit only when its seal and ids check out (cache.check); a damaged one is named, set aside and
    built again (`Prepared.rebuilt`). Raises DataError for unreadable files.
    """
    import datasets

    from tuneledger.dataset_info import resolve_sources

    sources = resolve_sources(cfg.dataset, cfg.dataset_dir, cfg.cache_dir)
    if is_chatml_name(cfg.template) and "<|im_start|>" not in (tokenizer.chat_template or ""):
        raise DataError(f"template: {cfg.template} expects a ChatML chat template (<|im_start|>...<|im_end|>), and the "
                        f"tokenizer of {cfg.model_name_or_path} has another; set template=tokenizer to render with it as it is")
    hashes = {str(f): file_sha256(f) for s in sources for f in s.files}
    tok_fp = tokenizer_fingerprint(tokenizer)
    key = cache_key(list(hashes.values()), tok_fp, "chatml" if is_chatml_name(cfg.template) else "tokenizer", cfg.cutoff_len,
                    {"system": cfg.default_system, "placeholders": cfg.placeholders, "max_samples": cfg.max_samples,
                     "sources": [s.spec() for s in sources],
                     # The paths too: the cached report and invalid records name them, and a resume
                     # compares them (the same bytes at another path must not pass for the first file).
                     "files": list(hashes)})
    if cfg.default_system and bad_text(cfg.default_system):
        raise DataError(f"default_system: {bad_text(cfg.default_system)}")
    path = Path(cfg.cache_dir) / key
    rebuilt = ""
    if path.exists():  # a hit only once its seal and its ids check out (cache.check)
        saved, rebuilt = cache.check(path, len(tokenizer))
        if saved is not None:
            return Prepared(path, with_batch(saved["report"], cfg), [Invalid(**d) for d in saved["invalid"]], True)
        print(f"cache damaged: {rebuilt}; set aside as {cache.set_aside(path)}, rebuilding {path}", flush=True)

    # Valid records go to an Arrow file in batches as they are read (records.RecordWriter), so
    # memory holds one batch, not the dataset; tokenizing then reads that file memory-mapped.
    from tuneledger.records import RecordWriter

    invalid: list[Invalid] = []
    total = 0
    writer = RecordWriter(Path(cfg.cache_dir))
    try:
        for src in sources:
            taken = 0  # max_samples caps each dataset, as in LLaMA-Factory
            for where, obj in (rec for f in src.files for rec in read_records(f)):
                if cfg.max_samples is not None and taken >= cfg.max_samples:
                    break
                total += 1
                taken += 1
                fields: list[str] = []
                msgs = to_messages(src.convert(obj, where), where, cfg.placeholders, fields)
                if isinstance(msgs, Invalid):
                    msgs.field = src.field_name(msgs.field)
                    invalid.append(msgs)
                else:
                    writer.add({"messages": msgs, "where": where, "fields": [src.field_name(f) for f in fields]})
        ds = writer.dataset()
        if len(ds):
            if not progress:
                datasets.disable_progress_bars()
            ds = ds.map(
                _encode_batch, batched=True, batch_size=64, remove_columns=["messages", "fields"],
                num_proc=min(num_proc(cfg.preprocessing_num_workers), max(1, len(ds) // 64)),
                fn_kwargs={"tokenizer": tokenizer, "cutoff_len": cfg.cutoff_len, "default_system": cfg.default_system},
                desc=f"tokenizing {len(ds)} records",
            )
            # The tokenizing bar says how long the wait is; the filter's and the save's (under a second) say nothing.
            datasets.disable_progress_bars()
            for where, field, reason in zip(ds["where"], ds["field"], ds["reason"]):
                if reason:  # named by the record's own field: `output`, `conversations[1].value`, ...
                    invalid.append(Invalid(where, field, reason, reason.split(":", 1)[0]))
            ds = ds.filter(lambda r: not r, input_columns="reason").remove_columns(["reason", "field"])
        report = summarize(ds, total, invalid, cfg)
        report.update({"cache_key": key, "data_files": hashes, "tokenizer_fingerprint": tok_fp[:16]})
        cache.save(ds, path, report, [i.as_dict() for i in invalid])
    finally:  # the batches and the tokenizer's map files under it, however this ends
        writer.remove()
    if progress:
        datasets.enable_progress_bars()
    return Prepared(path, with_batch(report, cfg), invalid, False, rebuilt)


def load_prepared(cfg: JobConfig, progress: bool = True, model_checked: bool = False) -> Prepared:
    """The model checks that need only config.json and the tokenizer (the same for stats, dryrun
    and train: a VL variant, a tokenizer past the embedding rows), then the prepared data.
    `model_checked`: preflight_checks.run_checks already did the config.json checks. Raises
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

    from tuneledger.preflight_checks import run_checks

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
