"""The Triton kernels of nf4_kernel, in a module of their own: Triton reads `tl` from the kernel's
module globals, and this module is imported only where the kernel runs (Triton is optional)."""

import triton
import triton.language as tl


@triton.jit
def _round(v, OUT_BF16: tl.constexpr, out_ty: tl.constexpr):
    """fp32 -> the output dtype, to nearest even. bf16 by hand on the bits (keep the high 16,
    adding half an ulp less one, plus the kept lsb): what CUDA's __float2bfloat16 does, on every
    Triton version (Triton 3.1's CPU interpreter truncates instead); finite inputs only."""
    if OUT_BF16:
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(out_ty)


@triton.jit
def _blocks(w_ptr, code_ptr, out_ptr, rows, live, scale, HALF: tl.constexpr, ROWS: tl.constexpr,
            OUT_BF16: tl.constexpr):
    """Write the weights of the quantization blocks `rows` [ROWS] (one block a row, `scale` [ROWS, 1]
    their fp32 absmax): out[2j], out[2j+1] = code[w[j] >> 4], code[w[j] & 15] x scale, rounded once."""
    out_ty = out_ptr.dtype.element_ty
    offs = rows[:, None] * HALF + tl.arange(0, HALF)[None, :]
    q = tl.load(w_ptr + offs, mask=live[:, None], other=0)
    hi = _round(tl.load(code_ptr + (q >> 4).to(tl.int32)) * scale, OUT_BF16, out_ty)
    lo = _round(tl.load(code_ptr + (q & 15).to(tl.int32)) * scale, OUT_BF16, out_ty)
    # tl.interleave's own steps (join, then reshape), which Triton 3.1's interpreter runs too.
    vals = tl.reshape(tl.join(hi, lo), (ROWS, 2 * HALF))
    out = rows[:, None] * (2 * HALF) + tl.arange(0, 2 * HALF)[None, :]
    tl.store(out_ptr + out, vals, mask=live[:, None])


@triton.jit
def nf4_dequant(w_ptr, absmax_ptr, code_ptr, out_ptr, n_blocks, HALF: tl.constexpr, ROWS: tl.constexpr,
                OUT_BF16: tl.constexpr):
    """out[2j], out[2j+1] = code[w[j] >> 4], code[w[j] & 15] x absmax[block], rounded once to out's
    dtype. A program takes a [ROWS, HALF] tile of packed bytes, one quantization block a row: the
    row's scale is loaded once and broadcast."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < n_blocks
    scale = tl.load(absmax_ptr + rows, mask=live, other=0.0)[:, None]
    _blocks(w_ptr, code_ptr, out_ptr, rows, live, scale, HALF, ROWS, OUT_BF16)


@triton.jit
def nf4_dequant_nested(w_ptr, qabsmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr, n_blocks,
                       HALF: tl.constexpr, ROWS: tl.constexpr, OUT_BF16: tl.constexpr, BLOCKS2: tl.constexpr,
                       OFFSET_PER_BLOCK2: tl.constexpr, EXACT_ADD: tl.constexpr):
    """nf4_dequant under double quantization: each block's absmax is rebuilt here from its 8-bit
    code, as bitsandbytes rebuilds all of them first (dequantize_blockwise, then + offset):
    absmax = code2[qabsmax[block]] x absmax2[block // BLOCKS2] + offset, in fp32, the multiply and
    the add each rounded (offset: one, or one per BLOCKS2 blocks under OFFSET_PER_BLOCK2). On a GPU
    the add is PTX's add.rn (EXACT_ADD): an add with a rounding mode is never fused with the
    multiply into one fma, which would round once and could give another scale."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < n_blocks
    q = tl.load(qabsmax_ptr + rows, mask=live, other=0).to(tl.int32)
    b2 = rows // BLOCKS2
    t = tl.load(code2_ptr + q) * tl.load(absmax2_ptr + b2, mask=live, other=0.0)
    if OFFSET_PER_BLOCK2:
        off = tl.load(offset_ptr + b2, mask=live, other=0.0)
    else:
        off = tl.broadcast_to(tl.load(offset_ptr), (ROWS,))
    if EXACT_ADD:
        absmax = tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [t, off], dtype=tl.float32,
                                           is_pure=True, pack=1)
    else:
        absmax = t + off
    _blocks(w_ptr, code_ptr, out_ptr, rows, live, absmax[:, None], HALF, ROWS, OUT_BF16)
