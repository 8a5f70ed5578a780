"""nf4_kernel: our Triton NF4 dequantization gives bitsandbytes' weight bit for bit, on CPU through
Triton's interpreter (TRITON_INTERPRET=1) and on a CUDA GPU against bitsandbytes' own kernel
(bench/h200_levers.sh runs this file there); the fused projection calls it and its loss and
gradients do not change; the lever's line says what it did and True is refused where it cannot run.

Triton 3.1 (the lock's, torch 2.5.1's) interprets on CPU only with numpy < 2, and the lock has
numpy 2.2: the interpreted kernel runs in a subprocess with numpy 1.26 put first on its path
(.cache/triton-interp-numpy, made by `make test` from tests/triton-interp-numpy.txt)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tuneledger import nf4_kernel

import test_speed as speed_tests
from test_speed import IDS, _has_bnb

ROOT = Path(__file__).resolve().parents[1]
INTERP_NUMPY = ROOT / ".cache" / "triton-interp-numpy"
needs_bnb = pytest.mark.skipif(not _has_bnb(), reason="needs bitsandbytes (>= 0.49 quantizes on a CPU)")


def _has_triton() -> bool:
    try:
        import triton.language as tl
    except ImportError:
        return False
    return hasattr(tl, "join")


needs_triton = pytest.mark.skipif(not _has_triton(), reason="needs Triton with tl.join (the lock's triton 3.1)")
CASES = [
    ((64, 128), 64, torch.bfloat16),    # one tile, partly filled (a tile is 64 blocks)
    ((3584, 40), 64, torch.bfloat16),   # 2,240 blocks: 35 tiles
    ((96, 40), 64, torch.bfloat16),     # 60 blocks: the one tile's last rows masked
    ((96, 64), 128, torch.float16),     # another block size and dtype
    ((32, 64), 64, torch.float32),
]
RUN_INTERPRETED = """
import sys, torch
from tuneledger import nf4_kernel
assert nf4_kernel.use(None, quantized=True).startswith("on")  # its self_check passed here too
cases = torch.load(sys.argv[1])
torch.save([nf4_kernel.dequantize(*c) for c in cases], sys.argv[2])
"""


def _quantized(shape, blocksize, dtype, device):
    import bitsandbytes.functional as bf

    g = torch.Generator().manual_seed(5)
    # Spread over nine decades, with exact zeros, so every code and rounding path is hit.
    w = (torch.randn(shape, generator=g) * torch.logspace(-6, 3, shape[1])).to(dtype)
    w[0, :7] = 0
    packed, qs = bf.quantize_4bit(w.to(device), quant_type="nf4", compress_statistics=False, blocksize=blocksize)
    return bf.dequantize_4bit(packed, qs), (packed, qs.absmax, qs.code, blocksize, list(shape), dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@needs_bnb
@needs_triton
def test_same_bits_as_bitsandbytes_interpreted_on_cpu(tmp_path):
    import numpy
    import triton

    env = dict(os.environ, TRITON_INTERPRET="1")
    def version(v: str) -> tuple:
        return tuple(int(p) for p in v.split("+")[0].split(".")[:2])

    if version(numpy.__version__) >= (2, 0) and version(triton.__version__) < (3, 2):
        if not (INTERP_NUMPY / "numpy").is_dir():
            pytest.skip(f"{INTERP_NUMPY} is missing: `make test` installs numpy 1.26 there for Triton 3.1's interpreter")
        env["PYTHONPATH"] = os.pathsep.join([str(INTERP_NUMPY)] + [p for p in [env.get("PYTHONPATH")] if p])
    made = [_quantized(*c, "cpu") for c in CASES]
    torch.save([args for _, args in made], tmp_path / "in.pt")
    p = subprocess.run([sys.executable, "-c", RUN_INTERPRETED, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    for (want, _), got, case in zip(made, torch.load(tmp_path / "out.pt"), CASES):
        assert got.dtype == want.dtype and got.shape == want.shape, case
        assert torch.equal(_bits(got), _bits(want)), (case, (got.float() - want.float()).abs().max())


@needs_bnb
@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bitsandbytes' own CUDA kernel as the reference)")
@pytest.mark.parametrize("case", CASES + [((37888, 3584), 64, torch.bfloat16)])  # + Qwen2.5-7B's gate/up group
def test_same_bits_as_bitsandbytes_on_the_gpu(case):
    want, args = _quantized(*case, "cuda")
    nf4_kernel.use(True, quantized=True)
    try:
        got = nf4_kernel.dequantize(*args)
    finally:
        nf4_kernel.use(False, quantized=True)
    assert torch.equal(_bits(got), _bits(want)), (case, (got.float() - want.float()).abs().max())


@needs_bnb
@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_same_bits_inside_a_compiled_function():
    """As in a compiled decoder layer: the op (a triton_op on torch >= 2.6, launched by inductor)
    followed by a matmul gives the eager result bit for bit."""
    want, args = _quantized((512, 256), 64, torch.bfloat16, "cuda")
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    nf4_kernel.use(True, quantized=True)
    try:
        got = torch.compile(lambda x, *a: x @ nf4_kernel.dequantize(*a).t(), fullgraph=True)(x, *args)
    finally:
        nf4_kernel.use(False, quantized=True)
    assert torch.equal(got, x @ want.t())


@needs_triton
def test_sizes_that_disagree_are_refused():
    with pytest.raises(ValueError, match="do not make a 8x8 weight"):
        nf4_kernel.dequantize(torch.zeros(30, dtype=torch.uint8), torch.ones(1), torch.ones(16), 64, [8, 8],
                              torch.bfloat16)


@needs_bnb
def test_the_fused_projection_calls_it_and_nothing_changes(tiny_model, monkeypatch):
    """The wiring, on CPU: with the lever on, every NF4 dequantization of the fused projection goes
    through nf4_kernel.dequantize (here standing in with bitsandbytes' op, whose bits the tests
    above compare), and the loss and gradients are those of the lever off, exactly."""
    nf4_kernel.use(False, quantized=True)
    m0 = speed_tests._nf4_lora_model(tiny_model, True)
    l0, g0 = speed_tests._grads(m0, IDS)
    calls = []

    def stand_in(w, absmax, code, blocksize, shape, dtype):
        calls.append(tuple(shape))
        return torch.ops.bitsandbytes.dequantize_4bit(w, absmax, blocksize, "nf4", shape, dtype)

    monkeypatch.setattr(nf4_kernel, "dequantize", stand_in)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets applies() take CPU tensors
    monkeypatch.setattr(nf4_kernel, "why_not", lambda: None)
    monkeypatch.setattr(nf4_kernel, "self_check", lambda: None)
    assert nf4_kernel.use(None, quantized=True).startswith("on (")
    try:
        m1 = speed_tests._nf4_lora_model(tiny_model, True)
        l1, g1 = speed_tests._grads(m1, IDS)
    finally:
        nf4_kernel.use(False, quantized=True)
    import bitsandbytes as bnb

    n4 = sum(isinstance(m, bnb.nn.Linear4bit) for m in m1.modules())
    assert n4 and len(calls) == 2 * n4, (len(calls), n4)  # every 4-bit projection, forward and backward
    assert l1 == l0
    rel, name = speed_tests._worst(g0, g1)
    assert rel == 0.0, (name, rel)


def test_a_kernel_that_fails_its_check_is_not_used(monkeypatch):
    """A Triton (or GPU) where the kernel does not build, or gives other bits, leaves it off with the
    reason in the ledger's line (bitsandbytes' kernel runs), and refuses nf4_kernel: true."""
    monkeypatch.setattr(nf4_kernel, "why_not", lambda: None)

    def broken(*a):
        raise RuntimeError("PassManager::run failed\nmore")

    monkeypatch.setattr(nf4_kernel, "_launch", broken)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    line = nf4_kernel.use(None, quantized=True)
    assert line == "off (the Triton kernel failed its check here: RuntimeError: PassManager::run failed)", line
    assert not nf4_kernel.is_on()
    with pytest.raises(ValueError, match="nf4_kernel: true cannot apply: the Triton kernel failed its check"):
        nf4_kernel.use(True, quantized=True)
    monkeypatch.setattr(nf4_kernel, "_launch", lambda w, absmax, code, bs, shape, dt, wrap: torch.zeros(shape, dtype=dt))
    assert nf4_kernel.use(None, quantized=True) == "off (the Triton kernel's check gave other bits than bitsandbytes' here)"


@pytest.mark.parametrize("over, match", [
    ({}, "nf4_kernel: true needs an NF4 base .quantization_bit: 4, quantization_type: nf4., but quantization_bit is null"),
    ({"quantization_bit": 4, "quantization_type": "fp4"}, "quantization_type fp4"),
    ({"quantization_bit": 4, "fused_lora": False}, "nf4_kernel: true needs the fused LoRA projection, but fused_lora is false"),
])
def test_true_where_the_config_rules_it_out_is_refused_as_it_loads(over, match):
    """Before any process starts (exit 2 on the command line), not in each rank after the model loads."""
    from tuneledger.config import ConfigError
    from tuneledger.config_load import load_config

    with pytest.raises(ConfigError, match=match):
        load_config(None, {"model_name_or_path": "m", "dataset": ["x.json"], "nf4_kernel": True, **over})
    cfg = load_config(None, {"model_name_or_path": "m", "dataset": ["x.json"], "nf4_kernel": True, "quantization_bit": 4})
    from tuneledger import speed

    # Preflight, in the launcher: off a GPU (on a CPU quantization_bit: 4 is refused even before).
    with pytest.raises(ValueError, match="nf4_kernel: true needs a CUDA GPU"):
        speed.check_levers(cfg, "cpu")


def test_line_and_refusals(monkeypatch):
    assert nf4_kernel.use(False, quantized=True) == "off"
    assert nf4_kernel.use(None, quantized=False) == "off (no NF4 base weights)"
    with pytest.raises(ValueError, match="nf4_kernel: true cannot apply: no NF4 base weights"):
        nf4_kernel.use(True, quantized=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert nf4_kernel.use(None, quantized=True) == "off (no CUDA GPU)"
    with pytest.raises(ValueError, match="no CUDA GPU. Set nf4_kernel=false"):
        nf4_kernel.use(True, quantized=True)
    assert not nf4_kernel.applies(torch.zeros(2, dtype=torch.uint8), "nf4", 64, torch.bfloat16)
