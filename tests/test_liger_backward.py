"""liger_backward: Liger's fused linear cross-entropy backward without its `torch.equal` check
gives Liger's gradients bit for bit, with the incoming gradient 1.0 and not, with and without a
trainable weight, and never calls torch.equal (two host syncs per micro-batch on a GPU). Liger's
kernels run on CPU through Triton's interpreter, in a subprocess with numpy 1.26 first on its path
for Triton 3.1 (as tests/test_nf4_kernel.py does); on a GPU the device call runs this file too."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from test_nf4_kernel import INTERP_NUMPY, needs_triton

RUN = r'''
import torch
from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
from tuneledger import liger_backward

device = "cuda" if torch.cuda.is_available() else "cpu"
equal_calls = [0]
real_equal = torch.equal
def counting_equal(*a, **k):
    equal_calls[0] += 1
    return real_equal(*a, **k)
torch.equal = counting_equal

def grads(weight_grad, scale):
    torch.manual_seed(0)
    x = torch.randn(16, 32, dtype=torch.bfloat16, device=device, requires_grad=True)
    w = torch.randn(64, 32, dtype=torch.bfloat16, device=device, requires_grad=weight_grad)
    t = torch.randint(0, 64, (16,), device=device)
    t[:3] = -100
    loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")(w, x, t)
    (loss * scale).backward()  # scale 1/13: as transformers divides the summed loss by the token count
    return [x.grad.clone()] + ([w.grad.clone()] if weight_grad else [])

cases = [(wg, s) for wg in (False, True) for s in (1.0, 1 / 13)]
liger = [grads(*c) for c in cases]
liger_equal_calls = equal_calls[0]
assert liger_backward.install() is None
assert liger_backward.install() is None  # idempotent
equal_calls[0] = 0
ours = [grads(*c) for c in cases]
assert liger_equal_calls == len(cases), liger_equal_calls  # Liger's own asks once a backward
assert equal_calls[0] == 0, equal_calls[0]
for c, a, b in zip(cases, liger, ours):
    assert len(a) == len(b) == (2 if c[0] else 1), c
    for ga, gb in zip(a, b):
        assert real_equal(ga.view(torch.int16), gb.view(torch.int16)), (c, (ga.float() - gb.float()).abs().max())
        assert ga.abs().sum() > 0, c
print("ok", len(cases))
'''


@needs_triton
def test_same_gradients_as_liger_bit_for_bit_and_no_equality_check():
    import torch

    env = dict(os.environ)
    if not torch.cuda.is_available():  # on a GPU Liger's kernels run compiled, on a CPU interpreted
        env["TRITON_INTERPRET"] = "1"
    if (INTERP_NUMPY / "numpy").is_dir():
        env["PYTHONPATH"] = os.pathsep.join([str(INTERP_NUMPY)] + [p for p in [env.get("PYTHONPATH")] if p])
    p = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "ok 4" in p.stdout


def test_a_liger_whose_backward_differs_is_left_alone_and_said(monkeypatch):
    """Another liger-kernel's backward (other arguments, no equality check, or the same check and
    arguments doing more than scaling) is not replaced, nor one missing what the replacement calls:
    the lever line says why, and Liger's own runs."""
    pytest.importorskip("liger_kernel")
    import liger_kernel.ops.fused_linear_cross_entropy as flce

    from tuneledger import liger_backward

    def other_args(grad_output, grad_input):
        return grad_input

    def no_check(grad_output, grad_input, grad_weight, grad_bias):
        return grad_input, grad_weight, grad_bias

    def check_and_clamp(grad_output, grad_input, grad_weight, grad_bias):
        if not torch.equal(grad_output, torch.tensor(1.0, device=grad_output.device)):  # noqa: F821
            grad_input = grad_input.clamp(-1, 1)
        return grad_input, grad_weight, grad_bias

    real = flce.fused_linear_cross_entropy_backward
    assert not getattr(real, "_tuneledger", False)  # this process's Liger: the known one
    for fn in (other_args, no_check, check_and_clamp):
        monkeypatch.setattr(flce, "fused_linear_cross_entropy_backward", fn)
        assert liger_backward.install() == "its backward is not liger-kernel 0.8.5's, the one this replaces (its source differs)"
        assert flce.fused_linear_cross_entropy_backward is fn
    monkeypatch.setattr(flce, "fused_linear_cross_entropy_backward", real)
    monkeypatch.delattr(flce, "MAX_FUSED_SIZE")
    assert liger_backward.install() == "this liger-kernel has no MAX_FUSED_SIZE"
    assert flce.fused_linear_cross_entropy_backward is real
    monkeypatch.setenv("TUNELEDGER_LIGER_BACKWARD", "liger")  # make bench's A/B keeps Liger's own
    assert liger_backward.install() == "TUNELEDGER_LIGER_BACKWARD=liger"
    monkeypatch.delenv("TUNELEDGER_LIGER_BACKWARD")
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.fused_linear_cross_entropy", None)
    assert liger_backward.install().startswith("liger-kernel does not import")


def test_the_lever_line_says_whether_liger_s_backward_was_replaced(monkeypatch):
    """speed.apply_liger's line names the backward that runs: without host syncs, or Liger's own
    and why. (CUDA is pretended: only the line and the calls are checked, no kernel runs.)"""
    pytest.importorskip("liger_kernel")
    import liger_kernel.transformers as lt

    from tuneledger import liger_backward, speed

    applied = []
    monkeypatch.setattr(lt, "_apply_liger_kernel_to_instance", lambda **kw: applied.append(kw))
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="qwen2"))
    monkeypatch.setattr(liger_backward, "install", lambda: None)
    assert speed.apply_liger(model, None, "cuda", compiled=True) == (
        "on (fused linear cross-entropy; its backward without host syncs; the compiled layers fuse the rest)")
    monkeypatch.setattr(liger_backward, "install", lambda: "its backward has no check")
    assert speed.apply_liger(model, None, "cuda") == (
        "on (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy; its backward as Liger's: its backward has no check)")
    assert len(applied) == 2 and applied[0]["rope"] is False
