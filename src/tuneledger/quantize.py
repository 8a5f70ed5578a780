"""`tuneledger quantize`: an INT4 weight-only (W4A16) model for vLLM, made from a verified bf16 export.

    tuneledger quantize --merged runs/<run>/export [--scheme awq|gptq] [--out DIR] [--samples 64] [--seq-len 512]

Runs in its own environment (.venv-quant or the image of Dockerfile.quant): vLLM's llm-compressor
needs torch >= 2.10, which the trainer's torch 2.5.1 image cannot hold.

- Input: the directory `tuneledger export` wrote, and nothing else. A model whose config.json has a
  quantization_config (a 4-bit base, an earlier INT4 output) is refused: rounding a rounded model
  compounds the error. A directory without export.json, or whose export.json says the merge did not
  verify, is refused too.
- Schemes (compressed-tensors presets, what vLLM loads): `awq` is llm-compressor's AWQModifier
  (activation-aware scales) then W4A16 asymmetric (a zero point per group), as the field report's
  AWQ INT4; `gptq` is GPTQModifier, W4A16 symmetric. Both quantize every Linear but lm_head, in
  groups of `group_size` (128) input columns; a layer whose input width is not a multiple of it is
  refused, naming the layer; left unset, a model whose widths 128 does not divide gets the largest
  of 64, 32, 16 that does (SmolLM2-135M's 576: 64), said on the terminal.
- Calibration: `samples` records of the run's own training data (the dataset and placeholders in
  the run's job.json), rendered by the tokenizer's chat template with their replies, truncated to
  `seq_len` tokens. `heldout` other records, never seen in calibration, make the quality check.
- Quality, INT4 against the bf16 export, both reloaded from their files, in bf16:
  greedy agreement: the bf16 model's greedy continuation of each held-out prompt (up to
  `max_new_tokens`, stopping at eos) is teacher-forced through the INT4 model; token agreement is
  the fraction of those positions where INT4's argmax is bf16's token, exact match the fraction of
  prompts whose own free-running INT4 continuation equals bf16's. Perplexity: exp(mean next-token
  NLL) over every token of the held-out conversations (prompt and reply, <= seq_len each).
- Output: compressed-tensors safetensors, a config.json with its quantization_config, and the bf16
  export's tokenizer, chat template and generation config (eos includes <|im_end|>) copied as they
  are; `quant.json` (the ledger) inside. Written to `<out>.partial` and renamed at the end: a failure
  leaves nothing half-written, and an earlier output stays as it was.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from tuneledger.atomicdir import atomic_dir
from tuneledger.loading import run_conversations
from tuneledger.perms import apply_umask
from tuneledger.words import count_at_least

SCHEMES = {"awq": {"symmetric": False, "method": "AWQModifier + QuantizationModifier"},
           "gptq": {"symmetric": True, "method": "GPTQModifier"}}
# Files of the bf16 export that the quantized model takes as they are (everything but weights, config, ledger).
NOT_COPIED = ("config.json", "export.json", "model.safetensors.index.json")


class QuantizeError(RuntimeError):
    """The INT4 model cannot be made from this input; nothing was kept. The message names the file and field."""


def check_export(merged: Path) -> dict:
    """The export ledger (export.json) of `merged`, after refusing anything but a verified, unquantized export.

    Raises QuantizeError naming the file and field: no config.json, a config.json with a
    quantization_config, no export.json, or export.json's verification.passed not true.
    """
    cfg_path, led_path = merged / "config.json", merged / "export.json"
    if not cfg_path.is_file():
        raise QuantizeError(f"{cfg_path} not found: --merged must be the directory `tuneledger export` wrote "
                            "(runs/<run>/export)")
    q = json.loads(cfg_path.read_text()).get("quantization_config")
    if q:
        method = q.get("quant_method") or ("bitsandbytes" if q.get("load_in_4bit") else "unknown")
        raise QuantizeError(f"{cfg_path}: field 'quantization_config' (quant_method {method!r}) says this model is "
                            "already quantized. Quantize the bf16 merge `tuneledger export` wrote (runs/<run>/export): "
                            "rounding rounded weights again compounds the error.")
    if not led_path.is_file():
        raise QuantizeError(f"{led_path} not found: only a merge verified by `tuneledger export` is quantized "
                            "(run `make export RUN=<run>` first)")
    led = json.loads(led_path.read_text())
    passed = (led.get("verification") or {}).get("passed")
    if passed is not True:
        raise QuantizeError(f"{led_path}: field 'verification.passed' is {passed!r}, not true: the merge was not "
                            "verified; export it again")
    return led


def training_conversations(led: dict, led_path: Path, dataset: list[str] | None = None) -> tuple[list[list[dict]], dict]:
    """The valid conversations (lists of {role, content}) of the run's training data, and their source files.

    The data files, placeholders and default system prompt come from job.json in the run directory
    of export.json's 'checkpoint' (what `tuneledger train` resolved), unless `dataset` names files.
    Raises QuantizeError when neither is there, or no record is valid.
    """
    from tuneledger.data import DataError

    job = Path(str(led.get("checkpoint", ""))).parent / "job.json"
    cfg = json.loads(job.read_text())["config"] if job.is_file() else {}
    files = dataset or cfg.get("dataset") or []
    if not files:
        raise QuantizeError(f"{led_path}: field 'checkpoint' ({led.get('checkpoint')}) has no job.json beside it "
                            f"({job}), so the run's training data is unknown; pass --dataset FILE[,FILE]")
    try:
        convs = run_conversations(cfg, files)
    except DataError as e:
        raise QuantizeError(f"{job if not dataset else '--dataset'}: field 'dataset': {e}") from None
    if not convs:
        raise QuantizeError(f"no valid record in {', '.join(map(str, files))}")
    return convs, {"files": [str(f) for f in files], "job": str(job) if cfg else None}


def split(n: int, heldout: int, samples: int, seed: int) -> tuple[list[int], list[int]]:
    """(held-out indices, calibration indices): disjoint, from one shuffle of range(n) by `seed`."""
    if n < 2 or heldout < 1:
        raise QuantizeError(f"{n} valid records: need at least 2 (one held out, one to calibrate) and --heldout >= 1")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    heldout = min(heldout, n // 2)
    return order[:heldout], order[heldout:heldout + samples]


def recipe(scheme: str, group_size: int, n_grid: int) -> list:
    """The llm-compressor modifiers for `scheme`: 4-bit integer weights in groups, every Linear but lm_head."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    weights = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=group_size,
                               symmetric=SCHEMES[scheme]["symmetric"], dynamic=False)
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
    if scheme == "awq":
        return [AWQModifier(n_grid=n_grid), QuantizationModifier(config_groups=groups, ignore=["lm_head"])]
    return [GPTQModifier(config_groups=groups, ignore=["lm_head"])]


def check_group_size(merged: Path, group_size: int | None) -> int:
    """The group size to use. An explicit one that does not divide the input width of every
    quantized Linear (all but lm_head) is refused, naming the widths and a size that fits
    (llm-compressor would fail deep inside). None (the default) means 128, or else the largest of
    64, 32, 16 that fits every layer, said on the terminal: a tiny model's 64-wide layers take 64."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # shapes only, no weights
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(merged))
    widths: dict[int, str] = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.split(".")[-1] != "lm_head":
            widths.setdefault(m.in_features, name)
    fit = next((g for g in (128, 64, 32, 16) if all(w % g == 0 for w in widths)), None)
    if group_size is None and fit:
        if fit != 128:
            print(f"quantize: group size {fit}, not 128: input widths {sorted(widths)} are not all multiples of 128",
                  flush=True)
        return fit
    group_size = group_size or 128
    bad = {w: n for w, n in widths.items() if w % group_size}
    if bad:
        raise QuantizeError(f"{merged / 'config.json'}: input widths " + ", ".join(f"{w} ({n})" for w, n in bad.items())
                            + f" are not multiples of --group-size {group_size}"
                            + (f"; --group-size {fit} divides every layer's" if fit else ""))
    return group_size


def evaluate(path: Path, tokenizer: Any, prompts: list[str], texts: list[str], seq_len: int, max_new_tokens: int,
             device: str, reference: list[list[int]] | None = None) -> dict:
    """Greedy continuations of `prompts` and perplexity over `texts`, of the model at `path` in bf16.

    With `reference` (bf16's continuations, token ids), also the teacher-forced token agreement and
    the exact-match count against it. Returns {"continuations": [[id, ...], ...], "ppl": float,
    "nll_tokens": int, and with a reference "agree", "positions", "exact"}.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map={"": device}).eval()
    out: dict = {"continuations": [], "agree": 0, "positions": 0, "exact": 0}
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ids = tokenizer(p, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            cont = gen[0, ids.shape[1]:].tolist()
            out["continuations"].append(cont)
            if reference is not None and reference[i]:
                seq = torch.tensor([ids[0].tolist() + reference[i]], device=device)
                pred = model(input_ids=seq).logits[0, ids.shape[1] - 1:-1].argmax(-1)
                out["agree"] += int((pred == seq[0, ids.shape[1]:]).sum())
                out["positions"] += len(reference[i])
                out["exact"] += cont == reference[i]
        nll, count = 0.0, 0
        for t in texts:
            ids = tokenizer(t, return_tensors="pt", add_special_tokens=False, truncation=True,
                            max_length=seq_len)["input_ids"].to(device)
            if ids.shape[1] < 2:
                continue
            loss = model(input_ids=ids, labels=ids).loss.float().item()  # mean over ids.shape[1] - 1 predictions
            nll += loss * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    del model
    out["ppl"], out["nll_tokens"] = math.exp(nll / max(count, 1)), count
    return out


def _cpu_without_pinning() -> None:
    """llm-compressor 0.14's AWQ pins its cached activations (`IntermediatesCache.pin_memory`) before
    each scale search, for faster copies to the GPU; without an accelerator torch refuses to pin
    ("Cannot access accelerator device"). Pinning only speeds up host-to-GPU copies, so with no
    accelerator it is skipped (nothing else changes)."""
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if not torch.accelerator.is_available():
        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def quantize(merged: Path, out: Path, scheme: str = "awq", samples: int = 64, seq_len: int = 512, heldout: int = 16,
             group_size: int | None = None, max_new_tokens: int = 32, n_grid: int = 20, seed: int = 0,
             dataset: list[str] | None = None, device: str | None = None) -> dict:
    """Calibrate, quantize to W4A16, save in compressed-tensors format, check against the bf16 export.

    `merged`: a verified `tuneledger export` directory; `out`: the INT4 model's directory; `samples`
    calibration records of at most `seq_len` tokens; `heldout` records for the quality check;
    `group_size` input columns per scale; `n_grid`: AWQ's scale search points. Returns the ledger
    (also written to out/quant.json). Raises QuantizeError for bad input; any failure keeps nothing.
    """
    try:
        import compressed_tensors
        import llmcompressor
        import torch
        import transformers
        from llmcompressor import oneshot
    except ImportError as e:
        raise QuantizeError(f"{e.name} is not installed here: the INT4 step runs in its own environment "
                            "(`make venv-quant`, then .venv-quant/bin/tuneledger quantize; or the image of "
                            "Dockerfile.quant, `make quantize`)") from None
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from tuneledger.tokenizer_load import load_tokenizer

    if scheme not in SCHEMES:
        raise QuantizeError(f"--scheme {scheme!r}: choose one of {', '.join(SCHEMES)}")
    for name, value, least in (("--samples", samples, 1), ("--seq-len", seq_len, 2), ("--heldout", heldout, 1),
                               ("--group-size", group_size, 1), ("--max-new-tokens", max_new_tokens, 1),
                               ("--n-grid", n_grid, 3)):  # AWQ's grid search divides by n_grid - 2
        if value is not None and value < least:
            raise QuantizeError(f"{name} {value}: must be at least {least}")
    if out.resolve() == merged.resolve():
        raise QuantizeError(f"--out {out} is the bf16 export itself; the INT4 model goes in its own directory")
    t0 = time.perf_counter()
    led = check_export(merged)
    convs, data = training_conversations(led, merged / "export.json", dataset)
    held, calib = split(len(convs), heldout, samples, seed)
    tokenizer = load_tokenizer(str(merged))
    render = tokenizer.apply_chat_template
    texts = [render(convs[i], tokenize=False) for i in held]
    prompts = [render(convs[i][:-1], tokenize=False, add_generation_prompt=True) for i in held]
    enc = tokenizer([render(convs[i], tokenize=False) for i in calib], add_special_tokens=False, truncation=True,
                    max_length=seq_len)
    calib_ds = Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = json.loads((merged / "config.json").read_text())
    group_size = check_group_size(merged, group_size)

    print(f"quantize: {scheme} W4A16 group {group_size} of {merged}: {len(calib)} calibration records "
          f"({sum(map(len, enc['input_ids'])):,} tokens), {len(held)} held out, on {device}", flush=True)
    with atomic_dir(out) as tmp:
        # Loaded on the CPU: llm-compressor's sequential pipeline moves one decoder layer at a time to
        # the GPU (when there is one), so a 7B model calibrates in a few GB of GPU memory.
        model = AutoModelForCausalLM.from_pretrained(merged, dtype="auto")
        _cpu_without_pinning()
        t1 = time.perf_counter()
        oneshot(model=model, tokenizer=tokenizer, dataset=calib_ds, recipe=recipe(scheme, group_size, n_grid),
                num_calibration_samples=len(calib), max_seq_length=seq_len, shuffle_calibration_samples=False)
        calibrate_s = time.perf_counter() - t1
        print(f"quantize: calibrated on {len(calib)} records in {calibrate_s:.0f} s; saving", flush=True)
        model.save_pretrained(tmp, save_compressed=True)
        del model
        for f in merged.iterdir():
            if f.is_file() and f.name not in NOT_COPIED and not f.name.endswith(".safetensors"):
                shutil.copy2(f, tmp / f.name)
        qcfg = json.loads((tmp / "config.json").read_text()).get("quantization_config") or {}
        w = next(iter(qcfg.get("config_groups", {}).values()), {}).get("weights") or {}
        if qcfg.get("quant_method") != "compressed-tensors" or w.get("num_bits") != 4:
            raise QuantizeError(f"{tmp / 'config.json'}: field 'quantization_config' is not 4-bit compressed-tensors: {qcfg}")

        t2 = time.perf_counter()
        print(f"quantize: checking INT4 against bf16 on {len(held)} held-out records", flush=True)
        ref = evaluate(merged, tokenizer, prompts, texts, seq_len, max_new_tokens, device)
        got = evaluate(tmp, tokenizer, prompts, texts, seq_len, max_new_tokens, device, ref["continuations"])
        evaluate_s = time.perf_counter() - t2
        bf16_bytes, int4_bytes = _bytes(merged), _bytes(tmp)
        ledger = {
            "source": str(merged), "source_run": led.get("source_run"), "checkpoint": led.get("checkpoint"),
            "out": str(out), "synthetic": "tuneledger_synthetic" in config,
            "scheme": scheme, "method": SCHEMES[scheme]["method"], "format": qcfg.get("format"),
            "weights": {k: w.get(k) for k in ("num_bits", "type", "strategy", "group_size", "symmetric")},
            "ignore": qcfg.get("ignore"),
            "calibration": {"records": len(calib), "max_seq_len": seq_len, "tokens": sum(map(len, enc["input_ids"])),
                            "seed": seed, "n_grid": n_grid if scheme == "awq" else None, **data},
            "heldout": {"records": len(held), "disjoint_from_calibration": not set(held) & set(calib),
                        "records_in_data": len(convs)},
            "bytes": {"bf16": bf16_bytes, "int4": int4_bytes, "ratio": round(int4_bytes / max(bf16_bytes, 1), 4)},
            "quality": {
                "greedy_token_agreement": got["agree"] / max(got["positions"], 1), "greedy_positions": got["positions"],
                "greedy_exact_match": got["exact"] / len(prompts), "prompts": len(prompts),
                "max_new_tokens": max_new_tokens, "ppl_bf16": ref["ppl"], "ppl_int4": got["ppl"],
                "ppl_ratio": got["ppl"] / ref["ppl"], "ppl_tokens": got["nll_tokens"],
            },
            "device": device, "seconds": {"calibrate": round(calibrate_s, 1), "evaluate": round(evaluate_s, 1),
                                          "total": round(time.perf_counter() - t0, 1)},
            "versions": {"llmcompressor": llmcompressor.__version__, "compressed_tensors": compressed_tensors.__version__,
                         "torch": torch.__version__, "transformers": transformers.__version__},
            "samples": [tokenizer.decode(c) for c in got["continuations"][:2]],
        }
        (tmp / "quant.json").write_text(json.dumps(ledger, indent=1, ensure_ascii=False))
        apply_umask(tmp)  # safetensors wrote its shards 0600
    return ledger


def run(args: argparse.Namespace) -> int:
    from tuneledger.model import PreflightError

    merged = Path(args.merged)
    out = Path(args.out) if args.out else merged.with_name(f"{merged.name}-{args.scheme}")
    try:
        led = quantize(merged, out, args.scheme, args.samples, args.seq_len, args.heldout, args.group_size,
                       args.max_new_tokens, args.n_grid, args.seed, args.dataset.split(",") if args.dataset else None,
                       args.device)
    except (QuantizeError, PreflightError) as e:
        print(f"tuneledger quantize: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 1)
    q, b, w = led["quality"], led["bytes"], led["weights"]
    tag = " (SYNTHETIC weights: the quality numbers only show the pipeline runs)" if led["synthetic"] else ""
    print(f"quantized {led['source']} -> {led['out']}{tag}\n"
          f"  scheme   {led['scheme']} ({led['method']}), W{w['num_bits']}A16 {w['type']} group {w['group_size']}, "
          f"{'symmetric' if w['symmetric'] else 'asymmetric'}, format {led['format']}\n"
          f"  size     {b['int4'] / 1e9:.3f} GB (bf16 {b['bf16'] / 1e9:.3f} GB, {b['ratio']:.1%})\n"
          f"  calib    {led['calibration']['records']} records, {led['calibration']['tokens']:,} tokens "
          f"(<= {led['calibration']['max_seq_len']} each), {led['seconds']['calibrate']} s\n"
          f"  held out {led['heldout']['records']} records: greedy token agreement {q['greedy_token_agreement']:.1%} "
          f"of {q['greedy_positions']}, exact {q['greedy_exact_match']:.0%} of {q['prompts']} prompts; "
          f"ppl bf16 {q['ppl_bf16']:.3f}, int4 {q['ppl_int4']:.3f} (x{q['ppl_ratio']:.3f})\n"
          f"  total    {led['seconds']['total']} s on {led['device']}; ledger {led['out']}/quant.json")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("quantize", help="INT4 (W4A16, AWQ or GPTQ) of a verified bf16 export for vLLM, with a quality check")
    p.add_argument("--merged", required=True, help="the bf16 export directory (runs/<run>/export)")
    p.add_argument("--out", help="output directory (default: <merged>-<scheme>, e.g. runs/<run>/export-awq)")
    p.add_argument("--scheme", choices=sorted(SCHEMES), default="awq")
    p.add_argument("--samples", type=count_at_least(1), default=64, help="calibration records (default 64)")
    p.add_argument("--seq-len", type=count_at_least(1), default=512, help="tokens per calibration and perplexity record (default 512)")
    p.add_argument("--heldout", type=count_at_least(1), default=16, help="records held out for the quality check (default 16)")
    p.add_argument("--group-size", type=count_at_least(1), help="input columns per scale (default 128, or the largest of 64/32/16 "
                   "that divides every layer)")
    p.add_argument("--max-new-tokens", type=count_at_least(1), default=32, help="greedy tokens per held-out prompt (default 32)")
    p.add_argument("--n-grid", type=count_at_least(1), default=20, help="AWQ's scale search points per layer group (default 20)")
    p.add_argument("--seed", type=int, default=0, help="the shuffle that splits held-out and calibration records")
    p.add_argument("--dataset", help="data files (comma-separated) instead of the run's own (job.json)")
    p.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    p.set_defaults(func=run)
