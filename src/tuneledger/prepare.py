"""The data preparation that stats, dryrun and train share: validate, tokenize, cache.

`prepare` reads every record of a config's datasets (records.py streams them), validates them
(data.to_messages), tokenizes the valid ones in parallel and saves the sealed cache (cache.py) that
training ranks memory-map; `load_prepared` and `checked_tokenizer` add the model checks that need
only config.json and the tokenizer; `prepare_for_training` is what dryrun and train do before any
rank starts, `prepare_eval` the same for an eval_dataset.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tuneledger import cache, data_progress
from tuneledger.data import (DataError, Invalid, bad_text, cache_key, encode, file_sha256, is_chatml_name, num_proc,
                             read_records, to_messages, tokenizer_fingerprint)
from tuneledger.data_report import gate, print_invalid, summarize, with_batch, write
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


# A cache with more Arrow bytes than this (80 MB of alpaca JSON make 150 MB) is copied into place by
# datasets' spawned save workers (save_to_disk num_proc), so its pages are read in short-lived
# processes, not in this one; a smaller one is not worth their start (a few seconds).
COPY_IN_WORKERS = 64 << 20
SHARD = "256MB"
BATCH = 512  # records per call of the tokenizing function in a map worker


def _features() -> Any:
    """The tokenized records' columns: int32 ids and labels (Qwen2.5's 151,665 ids and -100 fit),
    half the bytes of the int64 that Python ints become, on disk, in the page cache, in each rank."""
    import datasets

    ids = datasets.List(datasets.Value("int32"))
    return datasets.Features({"where": datasets.Value("string"), "input_ids": ids, "labels": ids,
                              "n_tokens": datasets.Value("int32"), "n_supervised": datasets.Value("int32"),
                              "truncated": datasets.Value("bool"), "reason": datasets.Value("string"),
                              "field": datasets.Value("string")})


def _encode_batch(batch: dict, rank: int | None, tokenizer: Any, cutoff_len: int, default_system: str | None,
                  counts: str | None = None) -> dict:
    """datasets.map's function: a batch of records (messages, fields, where) -> their tokens.
    `counts`: the data_progress.Counts file this worker adds its records and tokens to."""
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
    if counts:
        data_progress.count(counts, rank or 0, len(out["n_tokens"]), sum(out["n_tokens"]))
    return out


def prepare(cfg: Any, tokenizer: Any, progress: bool = True) -> Prepared:
    """Validate, tokenize and cache `cfg.dataset` for `tokenizer`, in memory that does not grow
    with the data: records are read as a stream into an Arrow file, tokenized from it memory-
    mapped on every core (`preprocessing_num_workers`, default: all this process may use), and
    the result saved as the sealed cache without passing through this process's memory (only
    its small columns are read, by read(2); a cache over COPY_IN_WORKERS is copied by spawned
    workers). With `progress`, a phase over 5 s says records/s, tokens/s and an ETA on stderr.

    The cache key covers every data file's sha256, the tokenizer fingerprint, the template,
    default_system, cutoff_len, placeholders and max_samples; a hit loads in well under a second
    and is what training ranks read, so no rank tokenizes inside the process group. A cache is a
    hit only when its seal and ids check out (cache.check); a damaged one is named, set aside and
    built again (`Prepared.rebuilt`). Raises DataError for a file that cannot be read at all (a
    fault of one record, a JSON list that breaks included, is an Invalid in the report).
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

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # data_progress says how long the wait is, in lines a log can hold
    writer = RecordWriter(Path(cfg.cache_dir))
    try:
        total, invalid = _read(sources, cfg, writer, progress)
        ds = kept = writer.dataset()
        if len(ds):
            ds, left_out, kept = _tokenize(ds, tokenizer, cfg, key, writer.dir, progress)
            invalid += left_out
        report = summarize(kept, total, invalid, cfg)
        report.update({"cache_key": key, "data_files": hashes, "tokenizer_fingerprint": tok_fp[:16]})
        size = sum(os.path.getsize(f["filename"]) for f in ds.cache_files)
        workers = min(4, num_proc(cfg.preprocessing_num_workers)) if size > COPY_IN_WORKERS else None
        cache.save(ds, path, report, [i.as_dict() for i in invalid], workers=workers, shard=SHARD)
    finally:  # the batches and the tokenizer's map files under it, however this ends
        writer.remove()
        if bars:
            datasets.enable_progress_bars()
    return Prepared(path, with_batch(report, cfg), invalid, False, rebuilt)


def _read(sources: list, cfg: Any, writer: Any, progress: bool) -> tuple[int, list[Invalid]]:
    """Read and validate every record of `sources` into `writer`; (records read, the invalid ones)."""
    files = [f for src in sources for f in src.files]
    size = sum(f.stat().st_size for f in files)
    meter = data_progress.Meter(f"reading {len(files)} file{'s' if len(files) != 1 else ''}", size, "MB", progress)
    seen = {"bytes": 0}
    invalid: list[Invalid] = []
    total = passed = 0
    for src in sources:
        taken = 0  # max_samples caps each dataset, as in LLaMA-Factory
        for where, obj in (rec for f in src.files for rec in read_records(f, seen)):
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
            meter.update(seen["bytes"], total)
        # A source cut short by max_samples leaves bytes unread: count them as passed, for the ETA.
        passed += sum(f.stat().st_size for f in src.files)
        seen["bytes"] = passed
    meter.last = (size, total, None)
    meter.close(total)
    return total, invalid


def _tokenize(ds: Any, tokenizer: Any, cfg: Any, key: str, work: Path, progress: bool) -> tuple[Any, list[Invalid], Any]:
    """Tokenize the records in `ds` on every core (datasets' map, num_proc; results in Arrow files
    under `work`). Returns (the trainable records, memory-mapped; the invalid ones; their
    n_tokens and n_supervised as an Arrow table, for the report)."""
    procs = min(num_proc(cfg.preprocessing_num_workers), max(1, len(ds) // 64))
    counts = data_progress.Counts(work / "progress.bin", procs)
    asked = cfg.preprocessing_num_workers
    cores = num_proc(None)
    capped = f" (preprocessing_num_workers={asked}, capped at the {cores} CPU cores this process may use)" \
        if asked and asked > cores and procs == cores else ""
    meter = data_progress.Meter(f"tokenizing {len(ds):,} records on {procs} process{'es' if procs > 1 else ''}{capped}",
                                len(ds), "records", progress)
    with meter.watch(counts):
        # A batch is one Arrow record batch of the output (datasets writes each as it comes), and this
        # process maps a page around each batch's header as it opens the output (fault-around): 64
        # rows a batch made 0.25 GB of it at 800 MB, 512 make 1/8 of that.
        ds = ds.map(
            _encode_batch, batched=True, batch_size=BATCH, with_rank=True, remove_columns=["messages", "fields"],
            num_proc=procs if procs > 1 else None, features=_features(), cache_file_name=str(work / "tokens.arrow"),
            # Fingerprints from the cache key: hashing the tokenizer in fn_kwargs is slower and says no more.
            new_fingerprint=f"{key}-tokens",
            fn_kwargs={"tokenizer": tokenizer, "cutoff_len": cfg.cutoff_len, "default_system": cfg.default_system,
                       "counts": str(counts.path)})
    invalid, bad_rows, kept = _scan([f["filename"] for f in ds.cache_files])
    if bad_rows:  # an indices mapping: no row is read or copied here
        bad = set(bad_rows)
        ds = ds.select([i for i in range(len(ds)) if i not in bad], indices_cache_file_name=str(work / "kept.arrow"),
                       new_fingerprint=f"{key}-kept")
    return ds.remove_columns(["reason", "field"]), invalid, kept


def _scan(files: list[str]) -> tuple[list[Invalid], list[int], Any]:
    """One pass over the map's Arrow files in order, read(2) batch by batch: (the records the
    tokenizer refused, named by their own field; their row numbers; n_tokens and n_supervised of
    the others, an Arrow table). Not through the memory map: a column of every batch read there
    maps the pages around each read too (fault-around), 0.25 GB per column scan at 800 MB."""
    import pyarrow as pa
    import pyarrow.compute as pc

    invalid: list[Invalid] = []
    rows: list[int] = []
    small = []
    at = 0
    for name in files:
        with pa.OSFile(name) as source:
            for batch in pa.ipc.open_stream(source):
                t = pa.Table.from_batches([batch])
                bad = pc.not_equal(t.column("reason"), "")
                if pc.any(bad).as_py():
                    rows += [at + i for i, b in enumerate(bad.to_pylist()) if b]
                    invalid += [Invalid(r["where"], r["field"], r["reason"], r["reason"].split(":", 1)[0])
                                for r in t.select(["where", "field", "reason"]).filter(bad).to_pylist()]
                small.append(t.select(["n_tokens", "n_supervised"]).filter(pc.invert(bad)))
                at += len(t)
    return invalid, rows, pa.concat_tables(small) if small else pa.table({"n_tokens": [], "n_supervised": []})


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


def prepare_for_training(cfg: JobConfig, cpu: bool, timings: dict | None = None, world: int = 1,
                         dryrun: bool = False, ranks_here: int | None = None, jobs: list[JobConfig] | None = None) -> Prepared:
    """What dry-run and train do before any rank starts: the preflight checks (printed), the
    tokenized data (from the cache, or made now, in this process), and the data gate.
    `timings`, if given, gets preflight_s and data_s (seconds, for the ETA); `dryrun`: the disk
    check counts the dry-run's saves, not the run's; `ranks_here`: the ranks this host starts (nproc);
    `jobs`: the configs that will run (a dry-run's presets; preflight_checks.run_checks).

    Raises PreflightError, DataError, or DataError with the gate's reason.
    """
    import time

    from tuneledger.preflight_checks import run_checks

    t0 = time.perf_counter()
    for line in run_checks(cfg, cuda=not cpu, dryrun=dryrun, ranks_here=ranks_here, jobs=jobs):
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
