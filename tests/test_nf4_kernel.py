"""nf4_kernel: our Triton NF4 dequantization gives bitsandbytes' weight bit for bit, plain and under
double quantization (dequantize_nested), on CPU through Triton's interpreter (TRITON_INTERPRET=1)
against bitsandbytes' arithmetic written in torch ops, and on a CUDA GPU against bitsandbytes' own
kernels (bench/h200_levers.sh runs this file there); compiled for a GPU, the nested kernel's add is
not fused into an fma; the fused projection calls it and its loss and gradients do not change; the
lever's line says what it did and True is refused where it cannot run.

On CPU the reference is not bitsandbytes' CPU op: where torch reports AVX512, bitsandbytes 0.50 runs
a native kernel that gave other fp16 bits at blocksize 128 (an AMD EPYC, 2026-12-07: 736 of 6,144
weights) than its CUDA kernel's arithmetic, which the torch-ops reference is.

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
CASES = [  # (shape [out, in], blocksize, dtype)
    ((64, 128), 64, torch.bfloat16),    # one tile, partly filled (a tile is 64 blocks)
    ((3584, 40), 64, torch.bfloat16),   # 2,240 blocks: 35 tiles
    ((96, 40), 64, torch.bfloat16),     # 60 blocks: the one tile's last rows masked
    ((96, 64), 128, torch.float16),     # another block size and dtype
    ((32, 64), 64, torch.float32),
]
# Double quantization (nested blocks of 256 scales): one partly filled nested block, several, and a
# weight that ends inside one.
NESTED_CASES = [((64, 128), 64, torch.bfloat16), ((3584, 40), 64, torch.bfloat16), ((96, 200), 64, torch.float16)]
RUN_INTERPRETED = """
import sys, torch
from tuneledger import nf4_kernel
assert nf4_kernel.use(None, quantized=True).startswith("on")  # its self_check passed here too
cases, nested = torch.load(sys.argv[1])
torch.save(([nf4_kernel.dequantize(*c) for c in cases], [nf4_kernel.dequantize_nested(*c) for c in nested]), sys.argv[2])
"""


def _reference(packed, absmax, code, blocksize, shape, dtype) -> torch.Tensor:
    """bitsandbytes' NF4 arithmetic (its CUDA kDequantizeBlockwise) in torch ops: code[q] x absmax in
    fp32, rounded once to `dtype`; high nibble first."""
    b = packed.view(torch.uint8).reshape(-1)
    q = torch.stack((b >> 4, b & 15), dim=-1).reshape(-1).long()
    return (code.float()[q] * absmax.float().repeat_interleave(blocksize)).to(dtype).reshape(shape)


def _quantized(shape, blocksize, dtype, device, nested: bool = False):
    """(bitsandbytes' weight, the kernel's arguments) for a random weight quantized on `device`; on a
    CPU the weight is _reference's. `nested`: double quantization, dequantize_nested's arguments."""
    import bitsandbytes.functional as bf

    g = torch.Generator().manual_seed(5)
    # Spread over nine decades, with exact zeros, so every code and rounding path is hit.
    w = (torch.randn(shape, generator=g) * torch.logspace(-6, 3, shape[1])).to(dtype)
    w[0, :7] = 0
    packed, qs = bf.quantize_4bit(w.to(device), quant_type="nf4", compress_statistics=nested, blocksize=blocksize)
    if nested:
        args = (packed, qs.absmax, qs.state2.absmax, qs.state2.code, qs.offset, qs.code, blocksize,
                qs.state2.blocksize, list(shape), dtype)
    else:
        args = (packed, qs.absmax, qs.code, blocksize, list(shape), dtype)
    if device != "cpu":
        return bf.dequantize_4bit(packed, qs), args
    absmax = qs.absmax
    if nested:  # bitsandbytes' two steps: the 8-bit scales' dequantization, then + offset, each rounded
        s2 = qs.state2
        absmax = s2.code[qs.absmax.long()] * s2.absmax.repeat_interleave(s2.blocksize)[:qs.absmax.numel()]
        absmax = absmax + qs.offset
    return _reference(packed, absmax, qs.code, blocksize, list(shape), dtype), args


def stand_in_nested(calls: list):
    """nf4_kernel.dequantize_nested in bitsandbytes' ops, for the wiring tests on CPU (its own bits
    are this file's interpreted and GPU tests'): the 8-bit scales rebuilt by bitsandbytes, then
    each nested block's offset added (one offset: all blocks'). Appends (shape, offsets) to `calls`."""
    def dequantize_nested(w, qabsmax, absmax2, code2, offset, code, blocksize, blocksize2, shape, dtype):
        calls.append((tuple(shape), offset.numel()))
        absmax = torch.ops.bitsandbytes.dequantize_blockwise(qabsmax, absmax2, code2, blocksize2, torch.float32)
        absmax = absmax + (offset if offset.numel() == 1 else offset.repeat_interleave(blocksize2)[:absmax.numel()])
        return torch.ops.bitsandbytes.dequantize_4bit(w, absmax, blocksize, "nf4", shape, dtype)
    return dequantize_nested


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
    nested = [_quantized(*c, "cpu", nested=True) for c in NESTED_CASES]
    torch.save(([args for _, args in made], [args for _, args in nested]), tmp_path / "in.pt")
    p = subprocess.run([sys.executable, "-c", RUN_INTERPRETED, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got_plain, got_nested = torch.load(tmp_path / "out.pt", weights_only=True)
    assert len(got_plain) == len(CASES) and len(got_nested) == len(NESTED_CASES)
    for (want, _), got, case in zip(made + nested, got_plain + got_nested, CASES + NESTED_CASES):
        assert got.dtype == want.dtype and got.shape == want.shape, case
        assert torch.equal(_bits(got), _bits(want)), (case, (got.float() - want.float()).abs().max())


def test_the_cpu_reference_is_bitsandbytes_arithmetic():
    """_reference against bitsandbytes' own generic (torch) implementation, which its CPU op uses
    without AVX512: the same bits, so the interpreted test compares with bitsandbytes' arithmetic."""
    bnb_default = pytest.importorskip("bitsandbytes.backends.default.ops", reason="needs bitsandbytes")
    for case in CASES:
        want, (packed, absmax, code, blocksize, shape, dtype) = _quantized(*case, "cpu")
        ref = bnb_default._dequantize_4bit_compute(packed.view(torch.uint8).reshape(-1), absmax, code, blocksize,
                                                   shape, dtype)
        assert torch.equal(_bits(ref), _bits(want)), case


@needs_bnb
@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bitsandbytes' own CUDA kernel as the reference)")
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "double-quant"])
@pytest.mark.parametrize("case", CASES + [((37888, 3584), 64, torch.bfloat16)])  # + Qwen2.5-7B's gate/up group
def test_same_bits_as_bitsandbytes_on_the_gpu(case, nested):
    want, args = _quantized(*case, "cuda", nested=nested)
    line = nf4_kernel.use(True, quantized=True)
    try:
        assert line.endswith("double quantization's scales in the same kernel)"), line  # its nested check passed
        got = (nf4_kernel.dequantize_nested if nested else nf4_kernel.dequantize)(*args)
    finally:
        nf4_kernel.use(False, quantized=True)
    assert torch.equal(_bits(got), _bits(want)), (case, (got.float() - want.float()).abs().max())


def _sass(exact_add: bool) -> str:
    """The nested kernel compiled for an H100 (sm_90) by Triton's own ptxas, no GPU needed, as SASS."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tuneledger.nf4_triton import nf4_dequant_nested

    sig = ["*u8", "*u8", "*fp32", "*fp32", "*fp32", "*fp32", "*bf16", "i32"]
    consts = [32, 64, True, 256, False, exact_add]  # HALF, ROWS, OUT_BF16, BLOCKS2, OFFSET_PER_BLOCK2, EXACT_ADD
    src = ASTSource(fn=nf4_dequant_nested, signature=dict(enumerate(sig)),
                    constants={len(sig) + i: v for i, v in enumerate(consts)})
    cubin = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    f = Path(os.environ.get("TMPDIR", "/tmp")) / f"tuneledger-nested-{os.getpid()}-{exact_add}.cubin"
    f.write_bytes(cubin)
    try:
        return subprocess.run([str(tool), str(f)], capture_output=True, text=True, check=True).stdout
    finally:
        f.unlink()


@needs_triton
def test_the_nested_scale_add_is_never_an_fma_on_the_gpu():
    """bitsandbytes rounds the 8-bit scale's multiply and the offset's add apart; an fma rounds once
    and can give another scale. The kernel's add is PTX add.rn, which ptxas never fuses: its SASS has
    an FADD and no FFMA, where the same kernel with a plain `+` compiles to one FFMA (the control:
    proof that the check can fail)."""
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm").is_file():
        pytest.skip("this Triton has no bundled ptxas/nvdisasm (the lock's triton 3.1 has them)")
    try:
        exact, fused = _sass(True), _sass(False)
    except (ImportError, TypeError) as e:  # another Triton's compile API
        pytest.skip(f"Triton {triton.__version__}'s ahead-of-time compile API differs: {e}")
    assert "FFMA" not in exact and "FADD" in exact
    assert "FFMA" in fused


@needs_bnb
@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "double-quant"])
def test_same_bits_inside_a_compiled_function(nested, caplog):
    """As in a compiled decoder layer: the op (a triton_op on torch >= 2.6, launched by inductor)
    followed by a matmul gives the eager result bit for bit; torch's analysis of what the kernel
    writes did not give up (it then copies every input: the weights, at every call)."""
    import logging

    caplog.set_level(logging.WARNING, logger="torch._higher_order_ops.triton_kernel_wrap")
    want, args = _quantized((512, 256), 64, torch.bfloat16, "cuda", nested=nested)
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    op = nf4_kernel.dequantize_nested if nested else nf4_kernel.dequantize
    nf4_kernel.use(True, quantized=True)
    try:
        torch._dynamo.reset()
        got = torch.compile(lambda x, *a: x @ op(*a).t(), fullgraph=True)(x, *args)
    finally:
        nf4_kernel.use(False, quantized=True)
    assert torch.equal(got, x @ want.t())
    assert not [r for r in caplog.records if "assuming every input is mutated" in r.getMessage()], caplog.text[-2000:]


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
    calls: list = []

    def stand_in(w, absmax, code, blocksize, shape, dtype):
        calls.append((tuple(shape), None))
        return torch.ops.bitsandbytes.dequantize_4bit(w, absmax, blocksize, "nf4", shape, dtype)

    monkeypatch.setattr(nf4_kernel, "dequantize", stand_in)
    monkeypatch.setattr(nf4_kernel, "dequantize_nested", stand_in_nested(calls))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets applies() take CPU tensors
    monkeypatch.setattr(nf4_kernel, "why_not", lambda: None)
    monkeypatch.setattr(nf4_kernel, "self_check", lambda nested=False: None)
    assert nf4_kernel.use(None, quantized=True).startswith("on (")
    try:
        m1 = speed_tests._nf4_lora_model(tiny_model, True)
        l1, g1 = speed_tests._grads(m1, IDS)
    finally:
        nf4_kernel.use(False, quantized=True)
    import bitsandbytes as bnb

    n4 = sum(isinstance(m, bnb.nn.Linear4bit) for m in m1.modules())
    # every 4-bit projection, forward and backward, its double-quantized scales rebuilt in the kernel
    assert n4 and len(calls) == 2 * n4 and all(offsets == 1 for _, offsets in calls), (calls, n4)
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
