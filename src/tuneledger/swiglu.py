"""`swiglu_recompute`: the MLP's down-projection input h = silu(gate) x up is remade in backward
from gate and up instead of being kept from forward (what Unsloth's LoRA MLP does).

Why: without gradient checkpointing (presets C and D) every decoder layer keeps, for backward,
its MLP input x, gate's output e and up's output g (for silu x up's own gradient) and h (for
down_proj's LoRA-A gradient, dA = s (dy B)^T h). h is as big as e and g: T x 18,944 bf16 values on
Qwen2.5-7B, 28 layers of it: about 1.5 GiB at preset C's ~1,400 tokens per micro-batch, 5.6 GiB at
D's ~5,300. Preset C's peak was 1.6 GiB above Unsloth's C (docs/measurements.md). Backward
needs e and g anyway, so remaking h there costs one elementwise pass and no matmul.

Exactness: the same ops as the plain path (F.silu, the product, aten.silu_backward for its
gradient) in the same order and dtypes; h is recomputed bit for bit, so loss and gradients equal
the fused projections' (LoraProjection) on CPU (tests/test_swiglu.py). Dropout on down_proj is
kept (the mask is drawn on h as peft draws it).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F

from tuneledger.fused_lora import _dequantize, base_weight_inputs, lora_backward, lora_forward


class SwiGLUDownProjection(torch.autograd.Function):
    """y = h W^T + b + s (drop(h) A^T) B^T with h = silu(e) * g made inside: a SwiGLU MLP's
    down_proj, for a frozen base W (dense or 4-bit) and LoRA A [r, inter], B [hidden, r].

    Shapes: e, g [T, inter] -> y [T, hidden]. Backward remakes h from e and g, then as
    LoraProjection: dh = dy W + drop'(s (dy B) A), dA = s (dy B)^T drop(h), dB = s dy^T (drop(h)
    A^T); de = silu'(e) (dh g), dg = dh silu(e). Saved: e, g, drop(h) A^T [T, r] and the dropout
    mask; not h (T x inter values per layer)."""

    @staticmethod
    def forward(ctx, e, g, A, B, bias, w, absmax, absmax2, code2, offset, code, meta, scale, p):
        wd = _dequantize(w, absmax, absmax2, code2, offset, code, meta)
        e, g = e.to(wd.dtype), g.to(wd.dtype)
        y, a, mask = lora_forward(F.silu(e) * g, wd, A, B, bias, scale, p)
        ctx.save_for_backward(e, g, a, A, B, w, absmax, absmax2, code2, offset, code, mask)
        ctx.meta, ctx.scale, ctx.p = meta, scale, p
        return y

    @staticmethod
    def backward(ctx, dy):
        e, g, a, A, B, w, absmax, absmax2, code2, offset, code, mask = ctx.saved_tensors
        se = F.silu(e)
        wd = _dequantize(w, absmax, absmax2, code2, offset, code, ctx.meta)
        dh, dA, dB = lora_backward(dy, se * g, a, A, B, wd, ctx.scale, ctx.p, mask)
        de = torch.ops.aten.silu_backward(dh * g, e)
        dg = dh * se
        return de, dg, dA, dB, None, None, None, None, None, None, None, None, None, None


def _recomputing_forward(self, x: torch.Tensor) -> torch.Tensor:
    down = self.down_proj
    name = down.active_adapters[0]
    base = down.get_base_layer()
    drop = down.lora_dropout[name]
    p = drop.p if isinstance(drop, torch.nn.Dropout) and down.training else 0.0
    e, g = self.gate_proj(x), self.up_proj(x)  # gate first: grouped_lora's group computes both at gate's call
    shape = e.shape
    y = SwiGLUDownProjection.apply(e.reshape(-1, shape[-1]), g.reshape(-1, shape[-1]), down.lora_A[name].weight,
                                   down.lora_B[name].weight, getattr(base, "bias", None), *base_weight_inputs(base),
                                   down.scaling[name], p)
    return y.reshape(*shape[:-1], y.shape[-1])


def _is_silu(act: Any) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")


def swiglu_mlps(model: Any) -> list:
    """The SwiGLU MLP modules of `model`: gate_proj, up_proj and down_proj children and a SiLU act_fn."""
    return [m for m in model.modules()
            if all(hasattr(m, k) for k in ("gate_proj", "up_proj", "down_proj")) and _is_silu(getattr(m, "act_fn", None))]


def recompute_swiglu(model: Any, wanted: bool | None, fused: bool, checkpointing: bool = False) -> str:
    """Route every SwiGLU MLP of a peft model through SwiGLUDownProjection. `wanted`: the config's
    swiglu_recompute, True, False or None (on where it applies, and not under gradient
    checkpointing, which remakes the layer's activations anyway: `checkpointing`). `fused`: whether
    the fused LoRA projection (fused_lora.fuse_lora) ran, which this builds on. Returns the
    ledger's line; raises ValueError when True cannot apply (load_model makes that a PreflightError)."""
    if wanted is False:
        return "off"
    mlps = swiglu_mlps(model)
    from peft.tuners.lora import LoraLayer

    if not fused:
        why = "it needs the fused LoRA projection, which is off here"
    elif not mlps:
        why = "the model has no SwiGLU MLP (gate_proj, up_proj, down_proj and a SiLU act_fn)"
    elif not all(isinstance(m.down_proj, LoraLayer) for m in mlps):
        why = "it needs LoRA on down_proj (lora_target all, or naming down_proj)"
    else:
        why = None
    if why and wanted:
        raise ValueError(f"swiglu_recompute: true, but {why}; set swiglu_recompute=false (or unset it: on where it applies)")
    if why:
        return f"off ({why})"
    if wanted is None and checkpointing:
        return "off (gradient checkpointing remakes the MLP's activations anyway)"
    for m in mlps:
        m.forward = types.MethodType(_recomputing_forward, m)
    return f"on ({len(mlps)} MLPs: h = silu(gate) x up remade in backward, not kept)"
