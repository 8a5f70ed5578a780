"""`tuneledger export`: merge a LoRA adapter into its base in bf16, prove the merge, write it atomically.

    tuneledger export --adapter runs/<run>[/checkpoint-N] [--out DIR] [--base DIR] [--dtype bf16|fp32]
    tuneledger export lf_merge.yaml [key=value ...]   # LLaMA-Factory's merge yaml, or a training config

A config (usecfg) gives adapter_name_or_path (--adapter; a training config: its run),
model_name_or_path (--base), export_dir (--out), export_size (GB per shard) and export_device
(cpu or auto); options on the command line win. LLaMA-Factory's INT4 keys (export_quantization_*)
are refused, naming `tuneledger quantize`, the step that makes INT4 here.

The base is reloaded in bf16 (never 4-bit: merging into quantized weights rounds the LoRA update
into the 4-bit grid and wrecks the model); a base whose config.json carries a quantization_config
is refused. The export holds sharded safetensors, a config with no quantization section, the
tokenizer with its chat template, and a generation config whose eos includes the end-of-turn
token (`<|im_end|>`), so the served model stops.

The merge is computed in fp32 (the bf16 base upcast exactly, the fp32 adapter added) and rounded
to the export dtype once, rather than adding a rounded update to rounded weights.

Verification, before anything is kept, in three parts (`verify` in the ledger):
1. The merge, in fp32: base + unmerged adapter (the reference) against the merged model in
   memory, before any rounding, on a fixed set of prompts plus chat samples rendered from the
   run's own training data. Max |logit difference| must be <= 1e-3 x max |reference logit| (fp32
   arithmetic in another order). The adapter's own effect (reference against the base with the
   adapter disabled) is reported beside it, so a merge that lost the update (a lost scaling, a
   merge into 4-bit weights) shows as an error the size of that effect.
2. The files: the export reloaded from what was written must hold exactly the merged weights
   rounded to the export dtype, tensor by tensor (torch.equal). A missing shard, a wrong dtype or
   a dropped tensor fails here.
3. What the user gets: the reloaded export (upcast to fp32, so the only difference is the export's
   rounding) scored on the reference's greedy sequences. At every generated position its argmax
   must be the reference's token, unless the reference's top-2 margin there is within twice the
   measured logit difference (a tie the rounding may legitimately break); and max |logit
   difference| must be <= `rtol` x max |reference logit|: 0.25 for bf16, 1e-4 for fp32. The bf16
   bound is loose on purpose, as a sanity bound: rounding each weight to 8 significant bits moved
   the logits of SmolLM2-135M (trained) by 8.5e-3 of their scale and those of the random-weight
   synthetic Qwen2.5-7B by 1.0e-1 (random weights amplify it through 28 layers;
   bench/results/h200-2026-11-30-export); parts 1 and 2 are the exact checks.
Otherwise the export fails and its temporary directory is removed: nothing half-written is left.

Beside the weights, export.json is the export's ledger and its provenance: the run (source_run),
the checkpoint and its step, the base, and the verification; `tuneledger chat` names them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from tuneledger.atomicdir import atomic_dir
from tuneledger.checkpoints import FINAL, LoadError, find_checkpoint
from tuneledger.loading import checkpoint_step, run_conversations, run_dir
from tuneledger.model import PreflightError, read_model_config
from tuneledger.perms import apply_umask
from tuneledger.tokenizer_load import load_tokenizer
from tuneledger.words import count_at_least, plural

FIXED_PROMPTS = ["Who are you?", "What is 17 x 23? Answer with the number.",
                 "Give one sentence about gradient accumulation.", "用一句话介绍你自己。"]
RTOL = {"bf16": 0.25, "fp32": 1e-4}  # part 3 of the verification (module doc)
MERGE_RTOL = 1e-3  # part 1: fp32 merged against fp32 base + adapter


class ExportError(RuntimeError):
    """The export cannot be made or did not verify; nothing was kept."""


def check_base(base: str) -> dict:
    """The base's config.json; refuse a quantized base, saying why."""
    config = read_model_config(base)
    q = config.get("quantization_config")
    if q:
        raise ExportError(
            f"the base {base} is quantized ({q.get('quant_method', q.get('load_in_4bit') and 'bitsandbytes 4-bit') or q}): "
            "merging a LoRA into quantized weights rounds the update into the quantization grid and wrecks the model. "
            "Point --base at the bf16 model the adapter was trained on (the QLoRA run quantized it on load; the "
            "files on disk are bf16).")
    return config


def training_prompts(checkpoint: Path, tokenizer: Any, n: int = 4) -> list[str]:
    """Chat samples from the run's own data: the prompt part of the first `n` valid records."""
    job = checkpoint.parent / "job.json"
    if not job.is_file():
        return []
    cfg = json.loads(job.read_text())["config"]
    files = [f for f in cfg.get("dataset", []) if Path(f).is_file()]
    return [tokenizer.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True)
            for msgs in run_conversations(cfg, files, limit=n)]


def _greedy_and_logits(model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int,
                       reference: list[dict] | None = None) -> list[dict]:
    """Greedy continuation of each prompt, and the logits over the reference's sequence (or its own),
    so both models are scored on the same tokens even where their continuations part."""
    import torch

    out = []
    for i, text in enumerate(prompts):
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"].to(model.device)
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
            seq = reference[i]["sequence"] if reference else gen
            logits = model(input_ids=seq).logits.float()
        out.append({"tokens": gen[0, ids.shape[1]:].tolist(), "sequence": seq, "logits": logits})
    return out


def _logits_on(model: Any, reference: list[dict]) -> list[dict]:
    """`model`'s fp32 logits over each reference sequence (the same tokens, another model)."""
    import torch

    with torch.no_grad():
        return [{"logits": model(input_ids=r["sequence"]).logits.float()} for r in reference]


def _max_rel(ref: list[dict], got: list[dict]) -> float:
    """Max over prompts of max |got - ref| / max |ref|, on the logits of the same sequences."""
    return max((g["logits"] - r["logits"]).abs().max().item() / max(r["logits"].abs().max().item(), 1e-6)
               for r, g in zip(ref, got))


def _same_weights(a: Any, b: Any) -> dict:
    """Tensor-by-tensor equality of two models' state dicts, compared in b's dtype."""
    sa, sb = a.state_dict(), b.state_dict()
    missing = sorted(set(sb) ^ set(sa))
    differ = [k for k in sb if k in sa and not sa[k].to(sb[k].dtype).equal(sb[k])]
    return {"tensors": len(sb), "missing": missing[:10], "differ": differ[:10], "passed": not missing and not differ}


def _compare(ref: list[dict], got: list[dict], prompt_lens: list[int], rtol: float) -> dict:
    worst, identical, positions, ties, broken = _max_rel(ref, got), 0, 0, 0, []
    for i, (r, g) in enumerate(zip(ref, got)):
        diff = (g["logits"] - r["logits"]).abs()
        identical += r["tokens"] == g["tokens"]
        # Teacher-forced on the reference sequence: logits at t predict token t + 1.
        seq = r["sequence"][0]
        for t in range(prompt_lens[i] - 1, seq.shape[0] - 1):
            positions += 1
            want = seq[t + 1].item()
            if g["logits"][0, t].argmax().item() == want:
                continue
            top2 = r["logits"][0, t].topk(2).values
            if (top2[0] - top2[1]).item() <= 2 * diff[0, t].max().item():
                ties += 1
            else:
                broken.append({"prompt": i, "position": t})
    return {"prompts": len(ref), "greedy_identical": identical, "positions": positions, "tie_flips": ties,
            "mismatches": broken[:10], "max_rel_logit_diff": worst, "rtol": rtol,
            "passed": not broken and worst <= rtol}


def instead_of_final(adapter: Path, ckpt: Path) -> str | None:
    """When `ckpt` is not the run's final adapter (its final checkpoint and the copy at its root both
    failed to verify, so find_checkpoint fell back to an earlier one): the final one's name, for the
    export ledger; else None."""
    try:
        named = json.loads((Path(adapter) / FINAL).read_text()).get("checkpoint")
    except (OSError, ValueError, AttributeError):
        return None
    return named if named and Path(ckpt).resolve() not in (Path(adapter).resolve(), (Path(adapter) / named).resolve()) \
        else None


def export(adapter: Path, out: Path, base: str | None = None, dtype: str = "bf16", max_new_tokens: int = 32,
           device: str | None = None, shard_gb: int = 2, asked_template: str | None = None) -> dict:
    """Merge, verify and write `out` (safetensors shards of at most `shard_gb` GB); returns the
    export ledger. Raises ExportError (nothing kept), LoadError when the adapter is not found."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, GenerationConfig

    t0 = time.perf_counter()
    ckpt = find_checkpoint(adapter)
    adapter_cfg = json.loads((ckpt / "adapter_config.json").read_text())
    base = base or adapter_cfg.get("base_model_name_or_path")
    if not base:
        raise ExportError(f"{ckpt}/adapter_config.json names no base model; pass --base")
    check_base(base)
    tok_src = ckpt if (ckpt / "tokenizer_config.json").is_file() else base
    tokenizer = load_tokenizer(str(tok_src))
    from tuneledger.loading import run_config
    from tuneledger.templateinfo import template_line

    print(template_line(asked_template or run_config(ckpt).get("template"), tokenizer.chat_template, str(tok_src)),
          flush=True)
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")

    # fp32 for the reference and the merge (see the module doc); the export is rounded once, on save.
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, device_map={"": device})
    model = PeftModel.from_pretrained(model, str(ckpt)).eval()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
               for p in FIXED_PROMPTS] + training_prompts(ckpt, tokenizer)
    reference = _greedy_and_logits(model, tokenizer, prompts, max_new_tokens)
    with model.disable_adapter():
        plain = _logits_on(model, reference)
    merged = model.merge_and_unload()
    in_memory = _logits_on(merged, reference)
    effect, error = _max_rel(reference, plain), _max_rel(reference, in_memory)
    merge_check = {"adapter_effect_rel": effect, "merge_error_rel": error, "rtol": MERGE_RTOL,
                   "passed": error <= MERGE_RTOL}
    del plain, in_memory

    with atomic_dir(out) as tmp:
        merged.config.use_cache = True
        if hasattr(merged.config, "quantization_config"):
            del merged.config.quantization_config
        merged.to(torch_dtype).save_pretrained(tmp, max_shard_size=f"{shard_gb}GB", safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        eot = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        gen = merged.generation_config if merged.generation_config is not None else GenerationConfig()
        eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id] if gen.eos_token_id is not None else []
        gen.eos_token_id = [eot] + [e for e in eos if e != eot]
        gen.pad_token_id = tokenizer.pad_token_id
        gen.save_pretrained(tmp)
        del model
        # Check the files, not the object in memory: reload what was written.
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, device_map={"": device}).eval()
        files = _same_weights(reloaded, merged)
        del merged
        got = _greedy_and_logits(reloaded, tokenizer, prompts, max_new_tokens, reference)
        lens = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
        check = _compare(reference, got, lens, RTOL[dtype])
        check = {**check, "merge_fp32": merge_check, "files": files,
                 "passed": check["passed"] and merge_check["passed"] and files["passed"]}
        if not check["passed"]:
            (out.parent / f"{out.name}.failed.json").write_text(json.dumps(check, indent=1))
            why = []
            if not merge_check["passed"]:
                why.append(f"the fp32 merge is {error:.2e} of the logit scale off base + adapter (tolerance "
                           f"{MERGE_RTOL:.0e}; the adapter itself moves the logits by {effect:.2e})")
            if not files["passed"]:
                why.append(f"the written files do not hold the merged weights (missing {files['missing']}, "
                           f"different {files['differ']})")
            why.append(f"{len(check['mismatches'])} greedy tokens differ beyond ties (of {check['positions']}), max "
                       f"relative logit difference {check['max_rel_logit_diff']:.2e} (tolerance {check['rtol']:g})")
            raise ExportError(f"merged model differs from base + adapter: {'; '.join(why)}; see {out.name}.failed.json")
        saved_cfg = json.loads((tmp / "config.json").read_text())
        if "quantization_config" in saved_cfg:
            raise ExportError("the saved config still has a quantization_config")
        size = sum(f.stat().st_size for f in tmp.glob("*.safetensors"))
        ledger = {
            # Provenance: what `tuneledger chat` on the export names (the run, the checkpoint, its step, the base).
            # A run's root is the final adapter's verified copy (its checkpoint was damaged): the run is itself.
            "source_run": str(ckpt if (ckpt / FINAL).is_file() else ckpt.parent), "checkpoint": str(ckpt),
            "step": checkpoint_step(ckpt), "base": base,
            "dtype": dtype, "out": str(out), "instead_of_final": instead_of_final(adapter, ckpt),
            "safetensors_bytes": size, "shards": len(list(tmp.glob("*.safetensors"))), "eos_token_ids": gen.eos_token_id,
            "verification": check, "seconds": round(time.perf_counter() - t0, 1),
            "samples": [tokenizer.decode(g["tokens"], skip_special_tokens=False) for g in got[:2]],
            "synthetic": "tuneledger_synthetic" in saved_cfg,  # random weights: its answers are noise
        }
        (tmp / "export.json").write_text(json.dumps(ledger, indent=1, ensure_ascii=False))
        apply_umask(tmp)  # safetensors wrote model.safetensors 0600
    return ledger


def run(args: argparse.Namespace) -> int:
    from tuneledger.config import ConfigError
    from tuneledger.usecfg import resolve_use

    items = list(args.items)
    if args.adapter and all("=" in i for i in items):
        items = [args.adapter] + items
    if not items:
        raise ConfigError("what to export: --adapter RUN_OR_CHECKPOINT, or a config (a LLaMA-Factory merge yaml with "
                          "adapter_name_or_path, or a training config)")
    use = resolve_use("export", items)
    adapter = args.adapter or use.run
    if adapter is None:
        raise ConfigError(f"{use.where}: export merges an adapter, and adapter_name_or_path is not set; a model without "
                          "an adapter needs no merge (INT4 of it: tuneledger quantize --merged MODEL)")
    device = args.device or {"cpu": "cpu", "auto": None}[use.get("export_device", "auto")]
    try:
        # A run name is a folder under runs/, as for chat and eval; a path is itself.
        adapter = run_dir(str(adapter)) / (f"checkpoint-{args.checkpoint}" if args.checkpoint else "")
        ckpt = find_checkpoint(adapter)
        out = Path(args.out or use.get("export_dir") or (ckpt if (ckpt / "job.json").is_file() else ckpt.parent) / "export")
        led = export(adapter, out, args.base or use.base, args.dtype, args.max_new_tokens, device,
                     int(use.get("export_size", 2)), use.get("template"))
    except (ExportError, LoadError, PreflightError) as e:
        print(f"tuneledger export: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 1)
    v = led["verification"]
    m = v["merge_fp32"]
    step = f" (step {led['step']})" if led.get("step") is not None else ""
    print(f"exported {led['checkpoint']}{step} + {led['base']} -> {led['out']}: {led['safetensors_bytes'] / 1e9:.2f} GB in "
          f"{plural(led['shards'], 'shard')}, {led['dtype']}, {led['seconds']} s; eos ids {led['eos_token_ids']}\n"
          f"verified on {v['prompts']} prompts: fp32 merge {m['merge_error_rel']:.1e} of the logit scale off base + "
          f"adapter (tolerance {m['rtol']:.0e}; the adapter moves them {m['adapter_effect_rel']:.1e}); files hold the "
          f"merged weights exactly ({v['files']['tensors']} tensors); after rounding to {led['dtype']}: "
          f"{v['positions'] - v['tie_flips']}/{v['positions']} greedy tokens identical ({plural(v['tie_flips'], 'tie')}), "
          f"{v['greedy_identical']}/{v['prompts']} continuations identical, max relative logit difference "
          f"{v['max_rel_logit_diff']:.1e} (tolerance {v['rtol']:g})")
    if led["synthetic"]:
        print(f"SYNTHETIC base (random weights): {led['out']} is verified, but what it says is noise", flush=True)
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("export", help="merge the LoRA into a bf16 base, verify it against base+adapter, save it")
    p.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]",
                   help="a LLaMA-Factory merge yaml (model_name_or_path, adapter_name_or_path, export_dir, export_size, "
                   "export_device) or a training config (its run)")
    p.add_argument("--adapter", help="a checkpoint-N directory, or a run directory (its last checkpoint); default: the "
                   "config's adapter_name_or_path, or its run")
    p.add_argument("--checkpoint", help="N or best: that checkpoint of the run (default: the newest)")
    p.add_argument("--out", help="output directory (default: the config's export_dir, else <run>/export)")
    p.add_argument("--base", help="the unquantized base model (default: the config's model_name_or_path, else the "
                   "adapter's base_model_name_or_path)")
    p.add_argument("--dtype", choices=sorted(RTOL), default="bf16")
    p.add_argument("--max-new-tokens", type=count_at_least(1), default=32, help="greedy tokens compared per prompt")
    p.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    p.set_defaults(func=run)
