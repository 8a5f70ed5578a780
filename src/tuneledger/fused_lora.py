"""Fused LoRA (`fused_lora`): the base projection (NF4 dequantised, or dense) and LoRA in one
autograd function, LoraProjection. The LoRA term is added by the second GEMM's epilogue (addmm
alpha=scale), so the scale, add and cast passes over every projection's output (87 ms per preset D
step on an H200: ../shared/notes/h200-profile.md) go away. The LoRA arithmetic (lora_forward,
lora_backward) and the 4-bit dequantization (_dequantize) are shared with grouped.py and swiglu.py.
"""

from __future__ import annotations

from typing import Any

import torch

from tuneledger import env_levers, nf4_kernel
from tuneledger.compiled import dequant_in_graph

# The LoRA term, and backward's dx, are added into the first GEMM's fresh output in place (the
# default since 2026-12-06; TUNELEDGER_ADDMM=copy, the A/B, adds out of place). Out of place, a
# compiled layer's aten::addmm first copies that output: a device-to-device copy per projection,
# 1,792 a preset C step, 36 ms of 1.18 s on an H100 (bench/results/h100-2026-12-06d-call1; Unsloth
# adds in place). In place: C +3.0%, D +3.6% tokens/s on one H100, the same losses
# (bench/results/h100-2026-12-06e-call1, -call2). In a compiled graph in place needs an op the
# compiler cannot turn back into a copy: tuneledger::addmm_, which mutates `out` (inductor's
# reinplacing keeps it in place).
ADDMM_INPLACE = env_levers.value("TUNELEDGER_ADDMM") != "copy"
addmm_calls = [0]  # the op's calls in this process (tests: the compiled graph kept it)


@torch.library.custom_op("tuneledger::addmm_", mutates_args=("out",))
def _addmm_op(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> None:
    addmm_calls[0] += 1
    out.addmm_(a, b, alpha=alpha)


@_addmm_op.register_fake
def _(out, a, b, alpha):
    return None


def add_product(y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """y + alpha (a @ b): y [T, n], a [T, k], b [k, n]. y itself is updated and returned (y must be
    a fresh GEMM output that nothing else holds); under TUNELEDGER_ADDMM=copy, and in layers
    compiled with inductor's C++ wrapper (compile_cpp_wrapper), a new tensor."""
    if not ADDMM_INPLACE:
        return torch.addmm(y, a, b, alpha=alpha)
    if torch.compiler.is_compiling():
        import torch._inductor.config as inductor_config

        if inductor_config.cpp_wrapper:  # its generated C++ cannot call an op that returns nothing (torch 2.5.1's g++ error)
            return torch.addmm(y, a, b, alpha=alpha)
        torch.ops.tuneledger.addmm_(y, a, b, alpha)
        return y
    return y.addmm_(a, b, alpha=alpha)


def base_weight_inputs(base: Any) -> tuple:
    """The frozen base weight as plain tensors and constants, for LoraProjection.apply:
    (w, absmax, absmax2, code2, offset, code, meta). Dense: (W [out, in], None x 5, None).
    4-bit: the packed uint8 weight, its absmax (uint8 under double quantization), the nested
    absmax and code (or None), the nested offset, the 4-bit code table [16] (NF4's values) and
    meta = (blocksize, nested blocksize, quant_type, shape, dtype). Tensors go in as arguments and never ride on ctx: a compiled layer
    traces backward once for all 28 layers, and what backward reads off an object instead of its
    inputs is baked in from the layer it was traced on."""
    w = base.weight
    qs = getattr(w, "quant_state", None)
    if qs is None:
        return w, None, None, None, None, None, None
    meta = (qs.blocksize, qs.state2.blocksize if qs.nested else 0, qs.quant_type, tuple(qs.shape), qs.dtype)
    if qs.nested:
        return w, qs.absmax, qs.state2.absmax, qs.state2.code, qs.offset, qs.code, meta
    return w, qs.absmax, None, None, None, qs.code, meta


def dequantize_in_graph(w, absmax, absmax2, code2, offset, code, meta) -> torch.Tensor:
    """bitsandbytes' 4-bit dequantization written in torch ops, for inside a compiled layer
    (TUNELEDGER_DEQUANT=graph, compiled.dequant_in_graph): the compiler fuses it (double
    quantization's absmax included) into one kernel per weight, where bitsandbytes' torch.library
    ops are two opaque calls each, 4 per projection and micro-batch. Not faster on an H200 (preset
    C 7,952 against 8,177 tokens/s), so opt-in. The arithmetic is bitsandbytes' own (its `default`
    backend, backends/default/ops.py, and the CUDA kernel): each byte holds two codes, high nibble
    first; value = code[q] x absmax[block] in fp32, then the compute dtype; nested absmax =
    code2[a] x absmax2[block2] + offset. Shapes: w packed [n/2, 1] uint8 -> [out, in]."""
    blocksize, blocksize2, _, shape, dtype = meta
    n = shape[0] * shape[1]
    if absmax2 is not None:
        blocks = torch.arange(absmax.numel(), device=w.device) // blocksize2
        absmax = code2[absmax.long()] * absmax2[blocks] + offset
    b = w.view(torch.uint8).reshape(-1)
    q = torch.stack((b >> 4, b & 0xF), dim=-1).reshape(-1)[:n]
    values = code[q.long()] * absmax.float()[torch.arange(n, device=w.device) // blocksize]
    return values.to(dtype).reshape(shape)


def plain_absmax(absmax, absmax2, code2, offset, blocksize2: int) -> torch.Tensor:
    """Double quantization's 8-bit absmax [blocks] rebuilt as fp32 scales (code2[a] x absmax2 + offset),
    by bitsandbytes' own op: what bitsandbytes.functional.dequantize_4bit does at every call."""
    return torch.ops.bitsandbytes.dequantize_blockwise(absmax, absmax2, code2, blocksize2, torch.float32) + offset


def kernel_rebuilds_scales(w, meta, offset) -> bool:
    """Whether _dequantize hands this double-quantized 4-bit weight (`meta`: base_weight_inputs')
    to nf4_kernel.dequantize_nested, which rebuilds the 8-bit scales itself: one launch instead of
    three, without absmax_once's memory. Not inside a compiled layer that dequantizes in torch ops."""
    blocksize, blocksize2, quant_type, _, dtype = meta
    return (not (torch.compiler.is_compiling() and dequant_in_graph()) and nf4_kernel.applies(w, quant_type, blocksize, dtype)
            and nf4_kernel.applies_nested(blocksize2, offset))


def _dequantize(w, absmax, absmax2, code2, offset, code, meta) -> torch.Tensor:
    """The base weight [out, in] in its compute dtype: inside a compiled layer in torch ops
    (dequantize_in_graph), else by our Triton NF4 kernel where the nf4_kernel lever is on
    (nf4_kernel.applies; double quantization's scales rebuilt in the same kernel where
    applies_nested), else through bitsandbytes' torch.library ops (the same calls as
    bitsandbytes.functional.dequantize_4bit). All give the same bits."""
    if meta is None:
        return w
    if torch.compiler.is_compiling() and dequant_in_graph():
        return dequantize_in_graph(w, absmax, absmax2, code2, offset, code, meta)
    blocksize, blocksize2, quant_type, shape, dtype = meta
    if absmax2 is not None:
        if kernel_rebuilds_scales(w, meta, offset):
            return nf4_kernel.dequantize_nested(w, absmax, absmax2, code2, offset, code, blocksize, blocksize2,
                                                list(shape), dtype)
        absmax = plain_absmax(absmax, absmax2, code2, offset, blocksize2)
    if nf4_kernel.applies(w, quant_type, blocksize, dtype):
        return nf4_kernel.dequantize(w, absmax, code, blocksize, list(shape), dtype)
    return torch.ops.bitsandbytes.dequantize_4bit(w, absmax.float(), blocksize, quant_type, list(shape), dtype)


# Backward dequantizes the base weight again (as bitsandbytes does) instead of keeping it. In a
# compiled layer both dequantizations are one expression, and the compiler's common-subexpression
# pass merges them: the bf16 weights of all 196 projections (13 GiB on Qwen2.5-7B) are then kept
# from forward to backward (a compiled D step's peak rose from 33 to 46 GiB on an H200).
# compile_layers turns that pass off for the compiled layers. Measured against the other way of
# keeping them apart, an opaque op of our own for backward's dequantization, in one H200 call:
# C 6,262 vs 5,420 tokens/s (mean step), 17.6 vs 17.9 GiB (bench/results/h200-2026-12-01-session3).


class LoraProjection(torch.autograd.Function):
    """y = x W^T + b + s (drop(x) A^T) B^T for a frozen base W (dense or 4-bit) and LoRA A [r, in], B [out, r].

    Shapes: x [T, in] -> y [T, out]. The compute dtype is W's (bf16 on a GPU); A and B stay fp32
    masters and get fp32 grads. Backward: dx = dy W + drop'(s (dy B) A), dA = s (dy B)^T drop(x),
    dB = s dy^T (drop(x) A^T); W is dequantised again rather than kept (what bitsandbytes does too).
    Saved: x, drop(x) A^T and the dropout mask (peft keeps drop(x) as well: a copy per projection);
    the dropout is torch's own (the same random stream as peft's nn.Dropout), and backward remakes
    drop(x) from x and the mask.
    """

    @staticmethod
    def forward(ctx, x, A, B, bias, w, absmax, absmax2, code2, offset, code, meta, scale, p):
        wd = _dequantize(w, absmax, absmax2, code2, offset, code, meta)
        x = x.to(wd.dtype)
        y, a, mask = lora_forward(x, wd, A, B, bias, scale, p)
        # x, not drop(x): x is one tensor shared by q/k/v (and gate/up) and kept anyway, while
        # each drop(x) is a copy of its own (about 7 GiB on preset D); backward remakes it from the mask.
        ctx.save_for_backward(x, a, A, B, w, absmax, absmax2, code2, offset, code, mask)
        ctx.meta, ctx.scale, ctx.p = meta, scale, p
        return y

    @staticmethod
    def backward(ctx, dy):
        x, a, A, B, w, absmax, absmax2, code2, offset, code, mask = ctx.saved_tensors
        wd = _dequantize(w, absmax, absmax2, code2, offset, code, ctx.meta)
        dx, dA, dB = lora_backward(dy, x, a, A, B, wd, ctx.scale, ctx.p, mask)
        return dx, dA, dB, None, None, None, None, None, None, None, None, None, None


def lora_forward(x, wd, A, B, bias, scale: float, p: float) -> tuple:
    """y = x W^T + b + s (drop(x) A^T) B^T in x's dtype (W's compute dtype, dequantized: `wd`
    [out, in]). Returns (y [T, out], a = drop(x) A^T [T, r], the dropout mask or None)."""
    dt = x.dtype
    y = torch.addmm(bias.to(dt), x, wd.t()) if bias is not None else x @ wd.t()
    mask = None
    if p:
        xd, mask = torch.native_dropout(x, p, True)
    else:
        xd = x
    a = xd @ A.to(dt).t()
    return add_product(y, a, B.to(dt).t(), scale), a, mask


def lora_backward(dy, x, a, A, B, wd, scale: float, p: float, mask) -> tuple:
    """lora_forward's gradients: (dx [T, in], dA [r, in], dB [out, r]); dA and dB in the masters'
    dtype. dx = dy W + drop'(s (dy B) A), dA = s (dy B)^T drop(x), dB = s dy^T a; drop(x) is made
    again from x and the mask."""
    dt = x.dtype
    dy = dy.to(dt)
    dyb = dy @ B.to(dt)
    dlora = (dyb @ A.to(dt)).mul_(scale)
    xd = x
    if mask is not None:
        dlora = torch.ops.aten.native_dropout_backward(dlora, mask, 1.0 / (1.0 - p))
        xd = torch.ops.aten.native_dropout_backward(x, mask, 1.0 / (1.0 - p))
    dx = add_product(dlora, dy, wd)
    return dx, (dyb.t() @ xd).mul_(scale).to(A.dtype), (dy.t() @ a).mul_(scale).to(B.dtype)


def _fused_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    name = self.active_adapters[0]
    shape = x.shape
    base = self.get_base_layer()
    drop = self.lora_dropout[name]
    p = drop.p if isinstance(drop, torch.nn.Dropout) and self.training else 0.0
    y = LoraProjection.apply(x.reshape(-1, shape[-1]), self.lora_A[name].weight, self.lora_B[name].weight,
                             getattr(base, "bias", None), *base_weight_inputs(base), self.scaling[name], p)
    return y.reshape(*shape[:-1], y.shape[-1])


def fuse_lora(model: Any, wanted: bool | None) -> str:
    """Route every LoRA projection of a peft model through LoraProjection. `wanted`: True, None
    (where it applies) or False. Applies only where the function is exact: one active adapter,
    no DoRA, no LoRA bias, not merged, a plain or 4-bit bitsandbytes base. Returns the ledger's
    line; raises ValueError when True cannot apply, or for a TUNELEDGER_ADDMM other than inplace or copy."""
    if wanted is False:
        return "off"
    addmm = env_levers.value("TUNELEDGER_ADDMM")
    if addmm not in ("", "inplace", "copy"):  # the launcher refuses it first (env_levers.check); a rank started otherwise
        raise ValueError(f"TUNELEDGER_ADDMM={addmm!r}: use inplace (the default: the LoRA term added into the GEMM's "
                         "output) or copy (out of place, the A/B)")
    why = fused_lora_blocker(model)
    if why:
        if wanted:
            raise ValueError(f"fused_lora: true cannot apply: {why}. Leave fused_lora unset (on where it applies)")
        return f"off ({why})"
    import types

    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    for m in layers:
        m.forward = types.MethodType(_fused_forward, m)
    how = "LoRA added in place" if ADDMM_INPLACE else "LoRA added out of place: TUNELEDGER_ADDMM=copy"
    return f"on ({len(layers)} projections; {how})"


def fused_lora_blocker(model: Any) -> str | None:
    """Why LoraProjection cannot stand in for peft's LoRA layers of `model`, or None."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    if not layers:
        return "no LoRA layers"
    for m in layers:
        name = m.active_adapters[0] if len(m.active_adapters) == 1 else None
        if name is None:
            return "more than one active adapter"
        if not isinstance(m.lora_dropout[name], (torch.nn.Identity, torch.nn.Dropout)):
            return f"dropout module {type(m.lora_dropout[name]).__name__}"
        if m.use_dora.get(name) or m.merged or getattr(m, "lora_bias", {}).get(name):
            return "DoRA, a LoRA bias or a merged adapter"
        if type(m.get_base_layer()).__name__ not in ("Linear", "Linear4bit"):
            return f"base layer {type(m.get_base_layer()).__name__}"
    return None
