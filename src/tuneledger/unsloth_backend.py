"""`use_unsloth` (LLaMA-Factory's key): Unsloth's FastLanguageModel as the model backend, where
Unsloth is installed. A LLaMA-Factory user keeps that choice, and `make bench` measures it with
tuneledger's own dry-run beside the default levers. Unsloth is not in the lock or the pinned image:
it is optional, found at run time, and refused with the reason where it cannot run.

Unsloth patches transformers and peft as it imports, so it must come first in the rank's process:
the launcher sets TUNELEDGER_USE_UNSLOTH=1 and tuneledger.worker imports it before anything else
(import_first). The model then loads with FastLanguageModel.from_pretrained (4-bit NF4 when
`quantization_bit: 4`) and gets LoRA from FastLanguageModel.get_peft_model with the config's rank,
alpha, dropout, targets and seed; gradient checkpointing is Unsloth's own ("unsloth": offloaded to
the CPU). The rest of the run (Trainer, data, ledger) is tuneledger's. tuneledger's own model levers
(fused LoRA, grouped LoRA, compiled layers, Liger, absmax_once, swiglu_recompute) are off: Unsloth
brings its own.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

ENV = "TUNELEDGER_USE_UNSLOTH"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# tuneledger's own model levers, which Unsloth's patched model replaces.
OWN_LEVERS = ("enable_liger_kernel", "fused_lora", "grouped_lora", "absmax_once", "swiglu_recompute", "torch_compile",
              "compile_cpp_wrapper", "nf4_kernel")


def import_first() -> None:
    """In a rank's process, before transformers and peft import: import Unsloth when the launcher
    asked for it (ENV). Raises ImportError (Unsloth's own message) when it cannot import."""
    if os.environ.get(ENV) == "1":
        os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")  # no network: Unsloth's statistics call hangs offline
        import unsloth  # noqa: F401


def check(cfg: Any, device_type: str) -> None:
    """Preflight for use_unsloth: true. Raises ValueError naming the key and the fix: Unsloth not
    installed, no CUDA GPU, preset F (FSDP2), packing (its padding-free path is not measured here),
    or one of tuneledger's own model levers set to true beside it."""
    if not cfg.use_unsloth:
        return
    installed = importlib.util.find_spec("unsloth") is not None
    if device_type != "cuda":  # both problems at once: a user who fixes one should not meet the other next
        raise ValueError("use_unsloth: true needs a CUDA GPU (Unsloth's Triton kernels)"
                         f"{'' if installed else ', and unsloth is not installed here (pip install unsloth)'}; "
                         "set use_unsloth=false")
    if not installed:
        raise ValueError("use_unsloth: true, but unsloth is not installed here (it is optional, not in the pinned "
                         "image): pip install unsloth, or set use_unsloth=false (tuneledger's own levers)")
    # Unsloth loads 4-bit as NF4 with double quantization and picks its own attention: a config that
    # says otherwise would be ignored and then mis-reported in the ledger.
    if cfg.quantization_bit not in (None, 4) or (cfg.quantization_bit == 4 and (
            cfg.quantization_type != "nf4" or not cfg.double_quantization)):
        raise ValueError("use_unsloth: true loads 4-bit weights as NF4 with double quantization only: set "
                         "quantization_bit=4 (or null), quantization_type=nf4 and double_quantization=true, "
                         "or set use_unsloth=false")
    if cfg.flash_attn != "auto":
        raise ValueError(f"use_unsloth: true picks its own attention, but flash_attn is {cfg.flash_attn}: unset "
                         "flash_attn, or set use_unsloth=false")
    if cfg.sharded:
        raise ValueError("use_unsloth: true cannot run as preset F (FSDP2): Unsloth loads one whole copy per rank; "
                         "use preset A-D, or set use_unsloth=false")
    if cfg.packing:
        raise ValueError("use_unsloth: true runs padded micro-batches here (Unsloth's padding-free path is not "
                         "measured): set packing=false (preset D packs), or set use_unsloth=false")
    asked = [k for k in OWN_LEVERS if getattr(cfg, k, None)]
    if asked:
        raise ValueError(f"use_unsloth: true replaces tuneledger's own model levers, but {', '.join(asked)} "
                         f"{'is' if len(asked) == 1 else 'are'} set to true: unset {'it' if len(asked) == 1 else 'them'}, "
                         "or set use_unsloth=false")


def check_preset(cfg: Any, device_type: str, name: str | None = None) -> None:
    """check() on one resolved preset (dryrun.plan, train): preset D packs and F shards, which the
    base config does not show. Raises ConfigError naming the preset."""
    try:
        check(cfg, device_type)
    except ValueError as e:
        from tuneledger.config import ConfigError

        raise ConfigError((f"preset {name}: " if name else "") + str(e)) from None


def load(cfg: Any, device: Any, dtype: Any) -> tuple[Any, dict]:
    """The model through Unsloth: (peft model, levers). Shapes and types as model.load_model's."""
    from unsloth import FastLanguageModel

    model, _ = FastLanguageModel.from_pretrained(
        model_name=cfg.model_name_or_path, max_seq_length=cfg.cutoff_len, dtype=dtype,
        load_in_4bit=cfg.quantization_bit == 4, local_files_only=os.path.isdir(cfg.model_name_or_path),
        # the model named, never one of Unsloth's pre-quantized repos in its place
        use_exact_model_name=True, device_map={"": device.index if device.type == "cuda" else "cpu"})
    target = TARGETS if cfg.lora_target == "all" else [t.strip() for t in cfg.lora_target.split(",")]
    model = FastLanguageModel.get_peft_model(
        model, r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, target_modules=target,
        bias="none", use_gradient_checkpointing="unsloth" if cfg.gradient_checkpointing else False,
        random_state=cfg.seed)
    # Passed again: older Unsloth releases' for_training turned checkpointing on by default.
    FastLanguageModel.for_training(model, use_gradient_checkpointing="unsloth" if cfg.gradient_checkpointing else False)
    model.config.use_cache = False
    import unsloth

    version = getattr(unsloth, "__version__", "?")
    levers = {"unsloth": f"on (Unsloth {version}: its own kernels and LoRA"
                         f"{'; its own gradient checkpointing' if cfg.gradient_checkpointing else ''})"}
    levers.update({k: "off (use_unsloth)" for k in ("liger", "fused_lora", "compile")})
    return model, levers
