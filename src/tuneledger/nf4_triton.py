"""The Triton kernel of nf4_kernel, in a module of its own: Triton reads `tl` from the kernel's
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
def nf4_dequant(w_ptr, absmax_ptr, code_ptr, out_ptr, n_blocks, HALF: tl.constexpr, ROWS: tl.constexpr,
                OUT_BF16: tl.constexpr):
    """out[2j], out[2j+1] = code[w[j] >> 4], code[w[j] & 15] x absmax[block], rounded once to out's
    dtype. A program takes a [ROWS, HALF] tile of packed bytes, one quantization block a row: the
    row's scale is loaded once and broadcast."""
    out_ty = out_ptr.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < n_blocks
    scale = tl.load(absmax_ptr + rows, mask=live, other=0.0)[:, None]
    offs = rows[:, None] * HALF + tl.arange(0, HALF)[None, :]
    q = tl.load(w_ptr + offs, mask=live[:, None], other=0)
    hi = _round(tl.load(code_ptr + (q >> 4).to(tl.int32)) * scale, OUT_BF16, out_ty)
    lo = _round(tl.load(code_ptr + (q & 15).to(tl.int32)) * scale, OUT_BF16, out_ty)
    # tl.interleave's own steps (join, then reshape), which Triton 3.1's interpreter runs too.
    vals = tl.reshape(tl.join(hi, lo), (ROWS, 2 * HALF))
    out = rows[:, None] * (2 * HALF) + tl.arange(0, 2 * HALF)[None, :]
    tl.store(out_ptr + out, vals, mask=live[:, None])
