"""The speed levers, in one place: attention for packed rows, Liger Kernel, the fused LoRA
projection and regional compilation. Each is a config key with a default that
../shared/notes/h200-profile.md and bench/results measured; model.load_model records the line
each one returns (`levers` in the ledger), so that every number says how it was made.

- Attention (`flash_attn`). A packed micro-batch is one row of ~5k tokens. transformers' SDPA
  path attends over the whole row under a dense block-diagonal mask (391 ms of a 1.39 s step on an
  H200, 12.6x Unsloth's attention: ../shared/notes/h200-profile.md). `auto` picks flash-attn 2
  where it is installed (the pinned image; padded rows are unpadded by transformers); else, for
  packed rows, torch's own varlen flash kernel (`torch.nn.attention.varlen`, torch >= 2.9), else
  flex attention with a document mask (compiles on first use), else SDPA with a warning. Padded
  rows otherwise take SDPA (per-sequence kernels).
- Liger Kernel (`enable_liger_kernel`): fused RMSNorm, RoPE, SwiGLU and linear + cross-entropy
  (the logits are never materialised: 68 -> 38 GiB on preset D).
- Fused LoRA (`fused_lora`): fused_lora.py; the grouped projections (`grouped_lora`): grouped.py;
  the MLP's recomputed SwiGLU (`swiglu_recompute`): swiglu.py.
- Regional compile (`torch_compile`): compiled.py.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch

from tuneledger import env_levers
from tuneledger.compiled import checkpoint_inside_planned

VARLEN = "tuneledger_varlen"  # our attention function's name in transformers' AttentionInterface


def warn(msg: str) -> None:
    print(f"WARNING: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ attention
def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _has_flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _has_flex() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def pick_attention(requested: str, packing: bool, device_type: str) -> tuple[str, str]:
    """(attn_implementation for transformers, why) for `flash_attn` = auto|fa2|varlen|flex|sdpa|eager.

    A packed row never pays the dense-mask SDPA path without a warning that says so. Raises
    ValueError when an explicit choice cannot run here (fa2 without flash-attn, varlen or flex
    without the torch that has them, or off CUDA).
    """
    cuda = device_type == "cuda"
    if requested == "eager":
        return "eager", "eager (asked for)"
    if requested == "fa2" or (requested == "auto" and cuda and _has_flash_attn()):
        if not _has_flash_attn() or not cuda:
            raise ValueError("flash_attn=fa2 needs flash-attn and a CUDA GPU (the pinned image has both); "
                             "set flash_attn=auto")
        return "flash_attention_2", "flash-attn 2 (varlen kernel: packed rows per sample, padded rows unpadded)"
    if requested == "varlen" and not packing:
        return "sdpa", "sdpa (flash_attn=varlen applies to packed rows; these are padded)"
    if requested == "varlen" or (requested == "auto" and cuda and packing and _torch_varlen()):
        register_varlen()
        if not cuda:
            return VARLEN, "varlen attention, CPU reference kernel (one SDPA per packed sample; for tests)"
        if not _torch_varlen():
            raise ValueError(f"flash_attn=varlen needs torch >= 2.9 (torch.nn.attention.varlen); this is torch "
                             f"{torch.__version__}. Set flash_attn=auto")
        return VARLEN, "torch varlen flash attention (packed samples attend only to themselves, no mask)"
    if requested == "flex" or (requested == "auto" and cuda and packing and _has_flex()):
        if not _has_flex() or not cuda:
            raise ValueError("flash_attn=flex needs torch >= 2.5 with flex_attention and a CUDA GPU; set flash_attn=auto")
        return "flex_attention", "flex attention with a document mask (compiles on first use: start-up, not steps)"
    cudnn = env_levers.value("TUNELEDGER_CUDNN_SDPA") == "1"
    if cuda and hasattr(torch.backends.cuda, "enable_cudnn_sdp") and not cudnn:
        # torch >= 2.9 prefers cuDNN's SDPA on Hopper; it builds an execution plan per new shape,
        # ~3 ms of host per call with padded rows (a profiled C step: 1.3 of 4.0 s in
        # _cudnn_attention_forward/backward, bench/results/h200-2026-12-01-compile). The memory-
        # efficient and flash SDPA kernels take masks or none without that cost. Unsloth's C runs
        # cuDNN's, causal and unmasked as drop_padding_mask makes ours: 38 against our flash's 54 ms
        # a step (bench/results/h100-2026-12-06b-call3); TUNELEDGER_CUDNN_SDPA=1 (make bench's
        # *cudnn rows) keeps it on, to measure that again.
        torch.backends.cuda.enable_cudnn_sdp(False)
    if packing and cuda:
        warn("packing with SDPA: each packed row attends under a dense block-diagonal mask (12x the attention "
             "time of per-sample kernels on an H200). Install flash-attn (the pinned image has it) or torch >= 2.9, "
             "or set packing=false")
        return "sdpa", "sdpa with a dense packed mask (slow: no varlen kernel here)"
    return "sdpa", "sdpa" + (" (packed rows under a block-diagonal mask)" if packing else "") + (
        (" (cuDNN's kernels allowed: TUNELEDGER_CUDNN_SDPA=1)" if cudnn else
         " (flash / memory-efficient kernels; cuDNN's off: host cost per shape)") if cuda else "")


def _reference_varlen(q, k, v, cu, max_len, scale):
    """One causal SDPA per packed sample: the CPU stand-in for the varlen kernel (tests)."""
    out = torch.empty_like(q)
    rep = q.shape[1] // k.shape[1]
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1)
    return out


def _varlen_kernel(q, k, v, cu, max_len: int, scale: float | None):
    """[T, Hq, D] causal attention within each sample of cu (int32 [N+1] offsets)."""
    if q.device.type != "cuda":
        return _reference_varlen(q, k, v, cu, max_len, scale)
    fn = _torch_varlen()
    params = inspect.signature(fn).parameters
    kw: dict[str, Any] = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "scale" in params:
        kw["scale"] = scale
    return fn(q, k, v, cu, cu, max_len, max_len, **kw)


def varlen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs):
    """transformers attention function for packed rows: query [1, Hq, T, D], key/value
    [1, Hkv, T, D] -> ([1, T, Hq, D], None). Sample bounds come from the collator's
    `cu_seq_lens_q` / `max_length_q` (DataCollatorWithFlattening(return_flash_attn_kwargs=True)),
    so no sync is needed to find them. Without them (a padded batch) it is SDPA."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if dropout:
        raise ValueError("varlen attention has no attention dropout; the model's attention_dropout must be 0")
    q, k, v = (t.transpose(1, 2)[0] for t in (query, key, value))
    out = _varlen_kernel(q, k, v, cu.to(torch.int32), int(kwargs["max_length_q"]), scaling)
    return out.unsqueeze(0), None


def register_varlen() -> None:
    """Make VARLEN a valid attn_implementation. It has no mask function on purpose: transformers
    then builds no mask and skips its packed-row detection (a host sync on every forward)."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_attention_forward)


# --------------------------------------------------------------------------------------- Liger
def apply_liger(model: Any, wanted: bool | None, device_type: str, compiled: bool = False) -> str:
    """Patch `model` (before LoRA wraps it) with Liger's kernels for its architecture. `wanted`:
    True (required: raises ValueError when it cannot), None (where it can: CUDA, liger-kernel
    importable, the architecture covered) or False. With `compiled` decoder layers only the fused
    linear cross-entropy is applied (it runs outside the layers): inductor fuses the norms, RoPE
    and SwiGLU itself, and tracing Liger's in-place Triton kernels gave wrong gradients on an
    H200 (the loss stopped falling: bench/results/h200-2026-12-01-levers). The fused linear
    cross-entropy's backward scales without asking the GPU whether its gradient is 1.0
    (liger_backward.py: two host syncs a micro-batch less). Returns the ledger's line."""
    if wanted is False:
        return "off"
    why = None
    if device_type != "cuda":
        why = "needs a CUDA GPU: Triton kernels"
    else:
        try:
            from liger_kernel.transformers import _apply_liger_kernel_to_instance
            from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
        except ImportError as e:
            why = f"liger-kernel does not import ({e})"
        else:
            if model.config.model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
                why = f"no Liger kernels for model_type {model.config.model_type!r}"
    if why:
        if wanted:
            raise ValueError(f"enable_liger_kernel: true, but Liger {why}; leave it unset (on where it applies) or "
                             "set enable_liger_kernel=false")
        return f"off ({why})"
    from tuneledger import liger_backward

    kept = liger_backward.install()
    backward = f"; its backward as Liger's: {kept}" if kept else "; its backward without host syncs"
    if compiled:
        _apply_liger_kernel_to_instance(model=model, rope=False, rms_norm=False, swiglu=False)
        return f"on (fused linear cross-entropy{backward}; the compiled layers fuse the rest)"
    _apply_liger_kernel_to_instance(model=model)
    return f"on (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy{backward})"


def levers_line(levers: dict) -> str:
    """One ledger line of what load_model recorded: `key value; key value`."""
    return "; ".join(f"{k} {v}" for k, v in levers.items())


def check_levers(cfg: Any, device_type: str) -> str:
    """Preflight: the levers a config asks for explicitly, checked before any process starts.

    Returns the attention line. Raises ValueError naming the key and the fix for an attention
    backend that cannot run here, enable_liger_kernel: true off a GPU or without liger-kernel,
    nf4_kernel: true off a GPU or without Triton,
    and use_unsloth's own checks (unsloth_backend.check). Levers that contradict each other
    whatever the machine (grouped_lora with dropout, compile_cpp_wrapper without compile, ...)
    are refused as the config loads (config.JobConfig._levers_agree); grouped_lora with
    checkpointing inside compiled layers per preset (check_preset_levers)."""
    _, attention = pick_attention(cfg.flash_attn, cfg.packing, device_type)
    if cfg.use_unsloth:
        from tuneledger import unsloth_backend

        unsloth_backend.check(cfg, device_type)
        return "Unsloth's own (use_unsloth)"
    if cfg.enable_liger_kernel:
        if device_type != "cuda":
            raise ValueError("enable_liger_kernel: true needs a CUDA GPU (Triton kernels); unset it or set it to false")
        try:
            import liger_kernel  # noqa: F401
        except ImportError as e:
            raise ValueError(f"enable_liger_kernel: true, but liger-kernel does not import ({e}); pip install "
                             "liger-kernel, or set enable_liger_kernel=false") from None
    if cfg.nf4_kernel:  # the kernel's own check against bitsandbytes runs in each rank (nf4_kernel.use)
        if device_type != "cuda":
            raise ValueError("nf4_kernel: true needs a CUDA GPU (a Triton kernel); unset it or set it to false")
        from tuneledger import nf4_kernel

        why = nf4_kernel.triton_missing()
        if why:
            raise ValueError(f"nf4_kernel: true, but {why}; unset nf4_kernel or set it to false")
    return attention


# grouped_lora (grouped.py) and checkpointing inside compiled layers:
# Dynamo does not trace the group's kept outputs inside a checkpoint region: it breaks the graph
# there and runs the checkpointed layer eagerly (seen on CPU, torch 2.5.1: "HigherOrderOperator:
# Mutating a variable not in the current scope"), so the compile would be lost.
GROUPED_NEEDS_NO_COMPILED_CHECKPOINT = (
    "grouped_lora: true cannot run with gradient checkpointing inside compiled layers: torch.compile would break "
    "the graph at the group's kept outputs and run each checkpointed layer eagerly. Set grouped_lora=false, "
    "gradient_checkpointing=false or torch_compile=false")


def check_preset_levers(cfg: Any, device_type: str, name: str | None = None) -> None:
    """The lever rules that depend on a preset's own settings, checked on each resolved preset
    config before its ranks start (dryrun.plan, train, tune's lever variants): grouped_lora with
    gradient checkpointing inside compiled layers. Raises ConfigError naming the keys (and preset `name`)."""
    if cfg.grouped_lora and checkpoint_inside_planned(cfg, device_type):
        from tuneledger.config import ConfigError

        raise ConfigError((f"preset {name}: " if name else "") + GROUPED_NEEDS_NO_COMPILED_CHECKPOINT)
