"""`tuneledger preflight`: the checks that run before any weights load, each failing in seconds.

- the logging backend asked for imports (a missing tensorboard crashed the field report's run
  only after the 7B model had loaded);
- bitsandbytes' CUDA library loads when quantization is on;
- the output filesystem has room for the checkpoints to keep;
- the model's config.json is read first and is a text causal LM (a VL variant is refused before
  15 GB are downloaded).
"""

from __future__ import annotations

import argparse
import importlib
import shutil
from pathlib import Path
from typing import Any

from tuneledger.config import JobConfig, add_preset_option, from_cli
from tuneledger.model import PreflightError, check_text_causal_lm, is_synthetic, read_model_config


def check_logging(cfg: JobConfig) -> str:
    if cfg.report_to == "tensorboard":
        try:
            importlib.import_module("tensorboard")
        except ImportError:
            raise PreflightError("report_to=tensorboard but tensorboard is not installed. Fix: pip install tensorboard "
                                 "(it is in requirements.txt), or set report_to=none") from None
    return f"logging: {cfg.report_to}"


def check_bitsandbytes(cfg: JobConfig, cuda: bool) -> str:
    if not cfg.quantization_bit:
        return "quantization: off (LoRA on the unquantized base)"
    if not cuda:
        raise PreflightError("quantization_bit=4 needs a CUDA GPU; none is visible. On a CPU set quantization_bit=null")
    try:
        import bitsandbytes as bnb
        from bitsandbytes.cextension import CudaBNBNativeLibrary, lib
    except Exception as e:
        raise PreflightError(f"bitsandbytes does not import ({type(e).__name__}: {e}). Fix: pip install "
                             "bitsandbytes==0.50.2 (requirements.txt), matching your CUDA") from None
    if not isinstance(lib, CudaBNBNativeLibrary):
        raise PreflightError("bitsandbytes loaded without its CUDA library. Fix: reinstall bitsandbytes for this "
                             "CUDA, or run `python -m bitsandbytes` to see what it looked for")
    return f"quantization: bitsandbytes {bnb.__version__} CUDA library loaded"


def checkpoint_bytes(cfg: JobConfig, config: dict) -> int:
    """Upper estimate of one checkpoint: LoRA weights in fp32 plus AdamW's two moments (12 B/param)."""
    h, n_layers = config.get("hidden_size", 0), config.get("num_hidden_layers", 0)
    inter = config.get("intermediate_size", 0)
    kv = h // max(1, config.get("num_attention_heads", 1)) * config.get("num_key_value_heads", config.get("num_attention_heads", 1))
    # q, k, v, o, gate, up, down: r * (in + out) each
    per_layer = cfg.lora_rank * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + inter) + (inter + h))
    return per_layer * n_layers * 12


def check_disk(cfg: JobConfig, config: dict) -> str:
    need = checkpoint_bytes(cfg, config) * (cfg.save_total_limit or 10) * 1.1
    out = cfg.out_dir
    probe = next((p for p in [out, *out.parents] if p.exists()), Path("."))
    free = shutil.disk_usage(probe).free
    if free < need:
        raise PreflightError(f"{probe} has {free / 1e9:.1f} GB free; {cfg.save_total_limit or 10} checkpoints need "
                             f"~{need / 1e9:.1f} GB. Free space, lower save_total_limit, or set output_dir elsewhere")
    return f"disk: {free / 1e9:.0f} GB free at {probe}, checkpoints need ~{need / 1e9:.2g} GB"


def run_checks(cfg: JobConfig, cuda: bool | None = None) -> list[str]:
    """Run every check; return one line per check. Raises PreflightError on the first failure."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    config = read_model_config(cfg.model_name_or_path)
    check_text_causal_lm(config, cfg.model_name_or_path)
    arch = ", ".join(config.get("architectures") or [config.get("model_type", "?")])
    lines = [f"model: {cfg.model_name_or_path} ({arch}){' SYNTHETIC (random weights)' if is_synthetic(config) else ''}"]
    lines += [check_logging(cfg), check_bitsandbytes(cfg, cuda), check_disk(cfg, config)]
    return lines


def run(args: argparse.Namespace) -> int:
    cfg = from_cli(args.items)
    try:
        for line in run_checks(cfg, None if not args.cpu else False):
            print(f"ok  {line}")
    except PreflightError as e:
        print(f"FAIL {e}")
        return 1
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("preflight", help="check logging, bitsandbytes, disk and the model variant before loading weights")
    p.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]")
    add_preset_option(p)
    p.add_argument("--cpu", action="store_true", help="check as for a CPU run")
    p.set_defaults(func=run)
