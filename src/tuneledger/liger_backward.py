"""Liger's fused linear cross-entropy backward without its host syncs.

Liger's backward (liger_kernel.ops.fused_linear_cross_entropy.fused_linear_cross_entropy_backward)
skips one multiply when the incoming gradient is exactly 1.0, and finds out by asking the GPU:
`torch.equal(grad_output, torch.tensor(1.0, device=...))` copies 1.0 from the host and reads the
answer back, two host syncs per micro-batch, 16 of a preset C step's 24 on an H100
(bench/results/h100-2026-12-06e-call3/profile-Cinplace.md). In training it is never 1.0 anyway:
transformers divides the summed loss by the step's token count. The replacement always runs
Liger's own scaling kernel (element_mul_kernel: the gradient times grad_output in fp32, rounded
back to the gradient's dtype), which is what Liger runs whenever the gradient is not 1.0, and
exact when it is (x * 1.0 = x). The forward's `.item()` (the non-ignored token count, a kernel
argument) stays: one sync per micro-batch.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

from tuneledger import env_levers

# The sha256 of the source of the backward this replaces, liger-kernel 0.8.5's (the lock's, the
# image's and the device wheel's): any other is left alone, since it may do more than scale.
KNOWN_SOURCE_SHA256 = "6aace1b3231eb98e36e5e894ad6b3ffc8bc5450d2e558869b688663c8cb1fc1e"


def install() -> str | None:
    """Put `scale_without_sync` in place of Liger's backward in its module (the autograd function
    calls it by that module's global name). Idempotent. Returns None when it is in place, or why
    Liger's own was left (liger-kernel missing, or a version whose backward's source is not the one
    this replaces, or that lacks what the replacement calls). TUNELEDGER_LIGER_BACKWARD=liger
    (make bench's `*ligerbwd` rows, the A/B) keeps Liger's own."""
    if env_levers.value("TUNELEDGER_LIGER_BACKWARD") == "liger":
        return "TUNELEDGER_LIGER_BACKWARD=liger"
    try:
        import liger_kernel.ops.fused_linear_cross_entropy as flce
    except ImportError as e:
        return f"liger-kernel does not import ({e})"
    current = getattr(flce, "fused_linear_cross_entropy_backward", None)
    if getattr(current, "_tuneledger", False):
        return None
    missing = [n for n in ("fused_linear_cross_entropy_backward", "element_mul_kernel", "MAX_FUSED_SIZE", "is_hip")
               if not hasattr(flce, n)]
    if missing:
        return f"this liger-kernel has no {', '.join(missing)}"
    try:
        source = inspect.getsource(current)
    except (OSError, TypeError):
        return "its backward's source cannot be read to check it"
    if hashlib.sha256(source.encode()).hexdigest() != KNOWN_SOURCE_SHA256:
        return "its backward is not liger-kernel 0.8.5's, the one this replaces (its source differs)"
    scale_without_sync._liger_original = current
    flce.fused_linear_cross_entropy_backward = scale_without_sync
    return None


def scale_without_sync(grad_output: Any, grad_input: Any, grad_weight: Any, grad_bias: Any) -> tuple:
    """Liger's fused_linear_cross_entropy_backward less its `torch.equal` check: each gradient
    (grad_input [BT, H], grad_weight [V, H] or None, grad_bias [V] or None) is multiplied in place
    by grad_output (a 0-dim tensor on the GPU) with Liger's element_mul_kernel, one program per row,
    launched as Liger launches it. Returns the three."""
    import triton

    import liger_kernel.ops.fused_linear_cross_entropy as flce

    warps = 16 if flce.is_hip() else 32
    block = min(flce.MAX_FUSED_SIZE, triton.next_power_of_2(grad_input.shape[-1]))
    flce.element_mul_kernel[(grad_input.shape[0],)](grad_input, grad_input.stride(-2), grad_output, grad_input.shape[-1],
                                                     BLOCK_SIZE=block, X_col_stride=grad_input.stride(-1), num_warps=warps)
    if grad_weight is not None:
        flce.element_mul_kernel[(grad_weight.shape[0],)](grad_weight, grad_weight.stride(-2), grad_output,
                                                          grad_weight.shape[-1], BLOCK_SIZE=block,
                                                          X_col_stride=grad_weight.stride(-1), num_warps=warps)
    if grad_bias is not None:
        flce.element_mul_kernel[(grad_bias.shape[0],)](grad_bias, grad_bias.stride(-1), grad_output, 1,
                                                        BLOCK_SIZE=block, num_warps=warps)
    return grad_input, grad_weight, grad_bias


scale_without_sync._tuneledger = True
