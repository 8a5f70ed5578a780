"""`nf4_kernel`: NF4 weights dequantized by one Triton kernel of ours instead of bitsandbytes'
kDequantizeBlockwise. Why: with the launch levers on, preset C's step on an H100 spends 123 ms in
bitsandbytes' kernel against 93 ms for the same bytes in Unsloth's Triton one
(bench/results/h100-2026-12-06b-call3, both engines profiled in one call). Dequantization is
memory-bound: each call reads 0.5 B and writes 2 B (bf16) per weight, so the floor is the bytes
over the card's bandwidth, which a kernel that keeps whole quantization blocks in one tile gets
close to (one scale load per block, wide contiguous stores).

The arithmetic is bitsandbytes' (csrc/kernels.cu, kDequantizeBlockwise for NF4): each byte holds
two codes, high nibble first; value = code[q] x absmax[block] in fp32, rounded once to the
output dtype (round to nearest even, both). One multiply and no add, so no fused multiply-add can
change a bit: the result is bitsandbytes' weight bit for bit (tests/test_nf4_kernel.py, on CPU
through Triton's interpreter and on a GPU against bitsandbytes' own op).

Double quantization (the default: each block's absmax stored in 8 bits, one fp32 scale per 256
of them, plus an offset): bitsandbytes rebuilds all the fp32 absmax first, a dequantize_blockwise
kernel and an add, two more launches per dequantization. absmax_once does that once at load, for
+332 MiB on Qwen2.5-7B. Without it, `dequantize_nested` rebuilds each block's absmax inside the
same kernel, with bitsandbytes' two roundings (the multiply, then the add, never one fma): one
launch and no memory added (self-checked at start like the plain one). Measured on one H200, preset B:
+18% over absmax_once (bench/results/h200-2026-12-07-call1); on grouped projections (C) 0.82x of it
(bench/results/h100-2026-12-07c-call2), so model.py keeps absmax_once there.

Scope: NF4, a blocksize (and double quantization's) that is a power of two, a CUDA tensor.
Anything else goes to bitsandbytes' op. On torch >= 2.6 the op is a torch.library triton_op: a
compiled decoder layer launches the kernel itself, with no Python op in between (bitsandbytes'
op is one, 1,792 calls per preset C step); on older torch (the image's 2.5.1) a custom op, opaque
to the compiler as bitsandbytes' own. At start the kernel checks itself against bitsandbytes on a
small weight (self_check): where it fails, the lever stays off and says why.

Measured on one H100 (bench/results/h100-2026-12-06c-call1): preset C 8,921 tokens/s against
7,498 with bitsandbytes' kernel in the same call (one pair), D unchanged.
"""

from __future__ import annotations

import importlib.util
import os
from typing import List

import torch

from tuneledger import versions
from tuneledger.config import NF4_NESTED_LINE

_ON = False  # set once per process by use(): the model's nf4_kernel lever
_NESTED = False  # and whether dequantize_nested passed its check too (use())


def why_not() -> str | None:
    """Why the Triton kernel cannot run in this process (no CUDA GPU, no Triton), or None.
    TRITON_INTERPRET=1 (Triton's CPU interpreter, for tests) counts as able."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        return "no CUDA GPU"
    return triton_missing()


def triton_missing() -> str | None:
    """Why Triton cannot build the kernel in this environment (not installed, too old), or None.
    Touches no GPU: preflight (speed.check_levers) asks it in the launcher."""
    try:
        import triton.language as tl
    except ImportError as e:
        return f"Triton does not import ({e})"
    if not hasattr(tl, "join"):
        return "Triton too old (no tl.join)"
    return None


def use(wanted: bool | None, quantized: bool, fused: bool = True) -> str:
    """Turn the kernel on for this process unless `wanted` is False (None: where it can run; True:
    the same, refused where it cannot). `quantized`: the base is NF4; `fused`: the fused LoRA
    projection runs (fused_lora), the only caller: bitsandbytes' own Linear4bit calls its own
    kernel. Returns the ledger's line; raises ValueError for True where it cannot apply."""
    global _ON, _NESTED
    _ON = _NESTED = False
    if wanted is False:
        return "off"
    why = ("no NF4 base weights" if not quantized else
           "needs the fused LoRA projection (fused_lora unset or true)" if not fused else why_not() or self_check())
    if why:
        if wanted:
            raise ValueError(f"nf4_kernel: true cannot apply: {why}. Set nf4_kernel=false")
        return f"off ({why})"
    _ON = True
    nested_why = self_check(nested=True)
    _NESTED = nested_why is None
    tail = (NF4_NESTED_LINE if _NESTED else
            f"double quantization's scales by bitsandbytes: {nested_why}")
    return f"on (Triton NF4 dequantization, bitsandbytes' bits; {tail})"


def self_check(device: str | None = None, nested: bool = False) -> str | None:
    """Run the kernel once on a small random NF4 weight (64 x 1024 in bf16 on `device`: the current
    CUDA device by default; `nested`: double-quantized, through dequantize_nested) and compare it
    with bitsandbytes' own dequantization, bit for bit. Returns why it cannot be used here (it
    failed to build or run, or gave other bits: a Triton or GPU this was never run on), or None.
    About a second, once per process: a training run must never be where a new Triton finds out."""
    try:
        import bitsandbytes.functional as bf

        dev = device or ("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else f"cuda:{torch.cuda.current_device()}")
        g = torch.Generator().manual_seed(0)
        # Scales over six decades: the nested absmax's multiply and add round in many ways.
        w = (torch.randn(64, 1024, generator=g) * torch.logspace(-3, 3, 1024)).to(device=dev, dtype=torch.bfloat16)
        packed, qs = bf.quantize_4bit(w, quant_type="nf4", compress_statistics=nested, blocksize=64)
        want = bf.dequantize_4bit(packed, qs)
        if nested:
            got = _launch_nested(packed, qs.absmax, qs.state2.absmax, qs.state2.code, qs.offset, qs.code, 64,
                                 qs.state2.blocksize, [64, 1024], torch.bfloat16, None)
        else:
            got = _launch(packed, qs.absmax, qs.code, 64, [64, 1024], torch.bfloat16, None)
    except Exception as e:  # noqa: BLE001  (any failure means: use bitsandbytes' kernel, and say why)
        return f"the Triton kernel failed its check here: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
        return "the Triton kernel's check gave other bits than bitsandbytes' here"
    return None


def is_on() -> bool:
    """Whether use() turned the kernel on in this process."""
    return _ON


def rebuilds_nested_scales() -> bool:
    """Whether use() turned on the nested kernel too: double-quantized weights then dequantize in
    one launch without absmax_once (nf4.absmax_once's default reads this)."""
    return _ON and _NESTED


def applies(w: torch.Tensor, quant_type: str, blocksize: int, dtype: torch.dtype) -> bool:
    """Whether dequantize() takes this weight (else bitsandbytes' op does)."""
    return (_ON and quant_type == "nf4" and blocksize >= 2 and blocksize & (blocksize - 1) == 0
            and dtype in (torch.bfloat16, torch.float16, torch.float32)
            and (w.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"))


def applies_nested(blocksize2: int, offset) -> bool:
    """Whether dequantize_nested() takes a weight that applies() takes, under double quantization
    of blocksize `blocksize2` with this `offset` (a tensor: one, or one per blocksize2 blocks)."""
    return (_NESTED and blocksize2 >= 1 and blocksize2 & (blocksize2 - 1) == 0
            and isinstance(offset, torch.Tensor) and offset.dtype == torch.float32)


_kernels: tuple | None = None


def _build(nested: bool = False):
    """The Triton kernel (nf4_triton; `nested`: the double-quantized one), imported on first use:
    Triton is imported only where it runs. TRITON_INTERPRET=1 must be set before this, as Triton
    reads it when the kernel is defined."""
    global _kernels
    if _kernels is None:
        from tuneledger.nf4_triton import nf4_dequant, nf4_dequant_nested

        _kernels = (nf4_dequant, nf4_dequant_nested)
    return _kernels[nested]


# Bytes of packed weight per program: 2 KiB (64 blocks of 64 weights) with 4 warps. Not tuned: the
# one shape measured (H100, 2026-12-06); every shape gives the same bits.
TILE_BYTES, WARPS = 2048, 4


def _tiled(n_blocks: int, blocksize: int, nested: bool, wrap) -> tuple:
    """(the kernel to launch, its grid, HALF, ROWS) for `n_blocks` quantization blocks of
    `blocksize` weights: one block a row, TILE_BYTES of packed weight a program. `wrap`:
    torch.library.wrap_triton under triton_op, else None; Triton's interpreter (tests) has no JIT
    function for wrap_triton to take, so it launches the kernel directly."""
    half = blocksize // 2
    rows = max(1, TILE_BYTES // half)
    kernel = _build(nested)
    if wrap and os.environ.get("TRITON_INTERPRET") != "1":
        kernel = wrap(kernel)
    return kernel, ((n_blocks + rows - 1) // rows,), half, rows


def _launch(w, absmax, code, blocksize: int, shape: List[int], dtype: torch.dtype, wrap) -> torch.Tensor:  # noqa: UP006
    """The NF4 weight `shape` [out, in] in `dtype` from its packed bytes `w` (out x in / 2 bytes,
    high nibble first, any shape; stored as uint8, or as a float tensor under preset F's
    bnb_4bit_quant_storage), its fp32 `absmax` [out x in / blocksize] and the 4-bit `code` table
    [16] (fp32). Bit for bit bitsandbytes.functional.dequantize_4bit's result. Raises ValueError
    when the sizes disagree. `wrap`: torch.library.wrap_triton under triton_op, else None."""
    n = shape[0] * shape[1]
    nbytes = w.numel() * w.element_size()
    if nbytes * 2 != n or absmax.numel() * blocksize != n or n % blocksize:
        raise ValueError(f"dequantize_nf4: {nbytes} packed bytes, {absmax.numel()} scales of {blocksize} "
                         f"do not make a {shape[0]}x{shape[1]} weight")
    out = torch.empty(shape, dtype=dtype, device=w.device)
    kernel, grid, half, rows = _tiled(absmax.numel(), blocksize, False, wrap)
    kernel[grid](w.contiguous().reshape(-1).view(torch.uint8), absmax.float().contiguous(), code.float().contiguous(),
                 out, absmax.numel(), HALF=half, ROWS=rows, OUT_BF16=dtype == torch.bfloat16, num_warps=WARPS)
    return out


def _launch_nested(w, qabsmax, absmax2, code2, offset, code, blocksize: int, blocksize2: int, shape: List[int],  # noqa: UP006
                   dtype: torch.dtype, wrap) -> torch.Tensor:
    """_launch's weight under double quantization: `qabsmax` [blocks] uint8 codes into `code2` [256]
    (fp32), `absmax2` [ceil(blocks / blocksize2)] fp32, `offset` fp32 [] (one for all blocks, as
    bitsandbytes' QuantState keeps it) or [blocks / blocksize2] (one per nested block: a grouped
    layout of several weights). Bit for bit bitsandbytes.functional.dequantize_4bit's result.
    Raises ValueError when the sizes disagree."""
    n = shape[0] * shape[1]
    nbytes = w.numel() * w.element_size()
    blocks2 = (qabsmax.numel() + blocksize2 - 1) // blocksize2
    if (nbytes * 2 != n or qabsmax.numel() * blocksize != n or n % blocksize or absmax2.numel() != blocks2
            or offset.numel() not in (1, blocks2) or qabsmax.dtype != torch.uint8):
        raise ValueError(f"dequantize_nf4_nested: {nbytes} packed bytes, {qabsmax.numel()} {qabsmax.dtype} scales of "
                         f"{blocksize}, {absmax2.numel()} nested scales of {blocksize2} and {offset.numel()} offsets "
                         f"do not make a {shape[0]}x{shape[1]} weight")
    out = torch.empty(shape, dtype=dtype, device=w.device)
    kernel, grid, half, rows = _tiled(qabsmax.numel(), blocksize, True, wrap)
    kernel[grid](w.contiguous().reshape(-1).view(torch.uint8), qabsmax.contiguous(), absmax2.float().contiguous(),
                 code2.float().contiguous(), offset.float().reshape(-1).contiguous(), code.float().contiguous(), out,
                 qabsmax.numel(), HALF=half, ROWS=rows, OUT_BF16=dtype == torch.bfloat16, BLOCKS2=blocksize2,
                 OFFSET_PER_BLOCK2=offset.numel() > 1, EXACT_ADD=os.environ.get("TRITON_INTERPRET") != "1",
                 num_warps=WARPS)
    return out


# torch >= 2.6: a triton_op, which a compiled layer calls as a Triton kernel of its graph (launched
# by inductor's wrapper, no Python op in between); older torch (the image's 2.5.1): a custom op,
# opaque to the compiler as bitsandbytes' ops are. TUNELEDGER_NF4_OP=custom forces the second.
# Without Triton (a CPU torch) a custom op too: triton_op would warn at every import.
# The nested kernel's add is inline PTX: torch's analysis of which inputs a user kernel writes gave
# up on any inline asm before torch 2.7 (pytorch#148043 skips pure asm) and then took every input as
# written, so a compiled layer would copy the weights before each call. There it is a custom op.
_TRITON_OP = (hasattr(torch.library, "triton_op") and importlib.util.find_spec("triton") is not None
              and os.environ.get("TUNELEDGER_NF4_OP") != "custom")
_NESTED_TRITON_OP = _TRITON_OP and versions.torch_at_least((2, 7))

if _TRITON_OP:
    @torch.library.triton_op("tuneledger::dequantize_nf4", mutates_args=())
    def dequantize(w: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int,
                   shape: List[int], dtype: torch.dtype) -> torch.Tensor:  # noqa: UP006 (torch reads typing.List)
        """_launch's weight, as the op tuneledger::dequantize_nf4."""
        return _launch(w, absmax, code, blocksize, shape, dtype, torch.library.wrap_triton)
else:
    @torch.library.custom_op("tuneledger::dequantize_nf4", mutates_args=())
    def dequantize(w: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int,
                   shape: List[int], dtype: torch.dtype) -> torch.Tensor:  # noqa: UP006 (torch 2.5 reads typing.List only)
        """_launch's weight, as the op tuneledger::dequantize_nf4."""
        return _launch(w, absmax, code, blocksize, shape, dtype, None)

    @dequantize.register_fake
    def _(w, absmax, code, blocksize, shape, dtype):
        return w.new_empty(shape, dtype=dtype)

if _NESTED_TRITON_OP:
    @torch.library.triton_op("tuneledger::dequantize_nf4_nested", mutates_args=())
    def dequantize_nested(w: torch.Tensor, qabsmax: torch.Tensor, absmax2: torch.Tensor, code2: torch.Tensor,
                          offset: torch.Tensor, code: torch.Tensor, blocksize: int, blocksize2: int,
                          shape: List[int], dtype: torch.dtype) -> torch.Tensor:  # noqa: UP006
        """_launch_nested's weight, as the op tuneledger::dequantize_nf4_nested."""
        return _launch_nested(w, qabsmax, absmax2, code2, offset, code, blocksize, blocksize2, shape, dtype,
                              torch.library.wrap_triton)
else:
    @torch.library.custom_op("tuneledger::dequantize_nf4_nested", mutates_args=())
    def dequantize_nested(w: torch.Tensor, qabsmax: torch.Tensor, absmax2: torch.Tensor, code2: torch.Tensor,
                          offset: torch.Tensor, code: torch.Tensor, blocksize: int, blocksize2: int,
                          shape: List[int], dtype: torch.dtype) -> torch.Tensor:  # noqa: UP006
        """_launch_nested's weight, as the op tuneledger::dequantize_nf4_nested."""
        return _launch_nested(w, qabsmax, absmax2, code2, offset, code, blocksize, blocksize2, shape, dtype, None)

    @dequantize_nested.register_fake
    def _(w, qabsmax, absmax2, code2, offset, code, blocksize, blocksize2, shape, dtype):
        return w.new_empty(shape, dtype=dtype)
