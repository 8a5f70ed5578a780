"""The speed levers (speed.py) compute the same function as the plain path.

Packing isolation holds for every attention backend that runs here: a packed sample's logits
equal the logits of that sample alone. On a CPU: SDPA and the varlen plumbing (the collator's
sample bounds through our attention function, with a per-sample reference kernel); on a GPU
(bench/h200_levers.sh runs this file there) also torch's varlen flash kernel, flex and flash-attn.
The fused LoRA projection equals peft's LoRA in value and gradient.
"""

from __future__ import annotations

import pytest
import torch

from tuneledger import compiled, fused_lora, speed
from tuneledger.config_load import load_config
from tuneledger.config import ConfigError
from tuneledger.data import encode
from tuneledger.rows import make_collator

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
# Logit error against the sample run alone, relative to the logits' scale: fp32 rounding on a CPU;
# on a GPU, bf16 kernels that sum in another order (measured there: bench/results, test log).
TOL = 2e-2 if CUDA else 1e-5

CONVS = [
    [{"role": "user", "content": "short"}, {"role": "assistant", "content": "yes"}],
    [{"role": "user", "content": "a longer question " * 12}, {"role": "assistant", "content": "a longer answer " * 9}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "again"},
     {"role": "assistant", "content": "twice as long"}],
]


def backends() -> list:
    out = [pytest.param("sdpa", id="sdpa"), pytest.param("varlen", id="varlen")]
    out.append(pytest.param("flex", id="flex", marks=pytest.mark.skipif(not (CUDA and speed._has_flex()),
                                                                        reason="flex attention: needs CUDA here")))
    out.append(pytest.param("fa2", id="fa2", marks=pytest.mark.skipif(not (CUDA and speed._has_flash_attn()),
                                                                      reason="flash-attn is not installed")))
    return out


def _model(tiny_model, attn: str):
    from transformers import AutoModelForCausalLM

    impl, _ = speed.pick_attention(attn, True, DEVICE)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=DTYPE, attn_implementation=impl).to(DEVICE).eval()
    model.config.use_cache = False
    return model, impl


@pytest.mark.parametrize("attn", backends())
def test_packed_sample_sees_only_itself(tiny_model, qwen_tokenizer, attn):
    torch.manual_seed(0)
    model, impl = _model(tiny_model, attn)
    feats = [{k: v for k, v in encode(c, qwen_tokenizer, 4096).items() if k in ("input_ids", "labels")} for c in CONVS]
    cfg = load_config(None, {"model_name_or_path": str(tiny_model), "dataset": ["x.json"], "packing": True})
    packed = make_collator(cfg, qwen_tokenizer, impl)([dict(f) for f in feats])
    if impl in (speed.VARLEN, "flash_attention_2"):
        assert packed["cu_seq_lens_q"].tolist()[-1] == packed["input_ids"].shape[1]
    inputs = {k: (v.to(DEVICE) if torch.is_tensor(v) else v) for k, v in packed.items() if k != "labels"}
    with torch.no_grad():
        joined = model(**inputs).logits[0].float()
        alone = [model(input_ids=torch.tensor([f["input_ids"]], device=DEVICE)).logits[0].float() for f in feats]
        # The negative control: the same row with one position run (no sample bounds) mixes samples.
        mixed = model(input_ids=inputs["input_ids"]).logits[0].float()
    scale = torch.cat(alone).abs().max()
    start, errors = 0, []
    for a in alone:
        errors.append(((joined[start:start + len(a)] - a).abs().max() / scale).item())
        start += len(a)
    assert max(errors) < TOL, errors
    later = slice(len(alone[0]), None)  # the first sample has nothing before it to mix with
    leak = ((mixed[later] - joined[later]).abs().max() / scale).item()
    assert leak > 10 * TOL, f"the control did not mix samples ({leak:.2e}): the test would not see a leak"


def _lora_model(tiny_model, fused: bool, dropout: float = 0.0):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    torch.manual_seed(1)
    for n, p in model.named_parameters():
        if "lora_B" in n:  # peft starts B at zero, which would hide a wrong B gradient or scale
            p.data.normal_(0, 0.05)
    line = fused_lora.fuse_lora(model, True if fused else False)
    return model, line


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_fused_lora_equals_peft(tiny_model, qwen_tokenizer, dropout):
    """Value and gradients, with and without LoRA dropout: the fused projection draws its masks
    from the same random stream, in the same order, as peft's nn.Dropout."""
    ids = torch.tensor([encode(CONVS[1], qwen_tokenizer, 4096)["input_ids"]])
    out = {}
    for fused in (False, True):
        model, line = _lora_model(tiny_model, fused, dropout)
        model.train()
        assert line.startswith("on") == fused, line
        torch.manual_seed(7)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out[fused] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    (l0, g0), (l1, g1) = out[False], out[True]
    assert abs(l0 - l1) < 1e-5 * abs(l0), (l0, l1)
    assert g0.keys() == g1.keys() and len(g0) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    for n in g0:
        rel = ((g0[n] - g1[n]).norm() / g0[n].norm()).item()
        assert rel < 1e-4, (n, rel)


def test_fused_lora_dropout_is_off_in_eval(tiny_model, qwen_tokenizer):
    ids = torch.tensor([encode(CONVS[0], qwen_tokenizer, 4096)["input_ids"]])
    model, _ = _lora_model(tiny_model, True, 0.5)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)


def test_fused_lora_refuses_what_it_cannot_compute(tiny_model):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                           LoraConfig(r=4, use_dora=True, target_modules="all-linear", task_type="CAUSAL_LM"))
    assert fused_lora.fuse_lora(model, None) == "off (DoRA, a LoRA bias or a merged adapter)"
    with pytest.raises(ValueError, match="fused_lora: true cannot apply: DoRA"):
        fused_lora.fuse_lora(model, True)


def test_pick_attention_says_why():
    assert speed.pick_attention("auto", False, "cpu") == ("sdpa", "sdpa")
    impl, why = speed.pick_attention("auto", True, "cpu")
    assert impl == "sdpa" and "block-diagonal" in why
    with pytest.raises(ValueError, match="flash-attn"):
        speed.pick_attention("fa2", True, "cpu")
    # varlen is for packed rows: a padded batch under it would attend without its padding mask
    assert speed.pick_attention("varlen", False, "cuda")[0] == "sdpa"


@pytest.mark.parametrize("over, match", [
    ({"enable_liger_kernel": True}, "enable_liger_kernel: true needs a CUDA GPU"),
    ({"flash_attn": "flex", "packing": True}, "set flash_attn=auto"),
])
def test_preflight_refuses_a_lever_that_cannot_run(tiny_model, over, match):
    from tuneledger.model import PreflightError
    from tuneledger.preflight_checks import run_checks

    cfg = load_config(None, {"model_name_or_path": str(tiny_model), "dataset": ["x.json"], "report_to": "none", **over})
    with pytest.raises(PreflightError, match=match):
        run_checks(cfg, cuda=False)


def test_load_model_records_levers(tiny_model):
    from tuneledger.model import load_model

    cfg = load_config(None, {"model_name_or_path": str(tiny_model), "dataset": ["x.json"], "lora_rank": 4,
                             "packing": True, "flash_attn": "varlen", "lora_dropout": 0.0})
    _, info = load_model(cfg, "cpu")
    levers = info["levers"]
    assert info["attention"] == speed.VARLEN and "reference" in levers["attention"]
    assert levers["liger"].startswith("off (needs a CUDA GPU")
    assert levers["fused_lora"] == "on (14 projections; LoRA added in place)" and levers["compile"] == "off (no CUDA GPU)"
    assert "lora_dropout_cost" not in levers


def test_the_ledger_says_what_dropout_costs(tiny_model):
    """With dropout on, the levers line says what it costs and how to skip it, so the user decides."""
    from tuneledger.model import load_model

    for fused, says in ((None, "3% of preset D's tokens/s"), (False, "keeps a copy of each projection's input")):
        cfg = load_config(None, {"model_name_or_path": str(tiny_model), "dataset": ["x.json"], "lora_rank": 4,
                                 "lora_dropout": 0.05, "fused_lora": fused})
        levers = load_model(cfg, "cpu")[1]["levers"]
        assert levers["lora_dropout"] == 0.05 and says in levers["lora_dropout_cost"]
        assert "lora_dropout_cost" in speed.levers_line(levers)


def test_compile_is_auto_and_refuses_the_unsafe_4bit_path(tiny_model):
    model, _ = _lora_model(tiny_model, False)
    assert compiled.compile_layers(model, None, "cpu", fused=True, quantized=False) == "off (no CUDA GPU)"
    assert compiled.compile_layers(model, None, "cuda", fused=False, quantized=True).startswith(
        "off (the LoRA projections are not fused")
    with pytest.raises(ValueError, match="needs the fused LoRA projection"):
        compiled.compile_layers(model, True, "cuda", fused=False, quantized=True)
    assert compiled.compile_planned(None, "cpu") is False and compiled.compile_planned(True, "cpu") is True
    with pytest.raises(ConfigError, match="needs the fused LoRA projection"):  # bad input: as the config loads
        load_config(None, {"model_name_or_path": str(tiny_model), "dataset": ["x.json"], "fused_lora": False,
                           "torch_compile": True, "quantization_bit": 4})


def test_cpp_wrapper_is_a_key_the_ledger_names_and_refused_without_compile(tiny_model):
    """compile_cpp_wrapper turns on inductor's C++ wrapper for the compiled layers and the levers
    line says so; with nothing compiled it says the key did nothing; with torch_compile: false the
    preflight refuses it, naming both keys."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch import _dynamo

    model, _ = _lora_model(tiny_model, True)
    # compile_layers sets these globally (nothing compiles here): each patch gives them back after
    with inductor_config.patch(cpp_wrapper=False), functorch_config.patch(cse=functorch_config.cse), \
            _dynamo.config.patch(optimize_ddp=_dynamo.config.optimize_ddp):
        assert "nothing compiled to wrap" in compiled.compile_layers(model, None, "cpu", fused=True, quantized=False,
                                                                     cpp_wrapper=True)
        assert compiled.compile_layers(model, False, "cuda", fused=True, quantized=False, cpp_wrapper=True) == \
            "off (compile_cpp_wrapper: nothing compiled to wrap)"
        assert inductor_config.cpp_wrapper is False
        line = compiled.compile_layers(model, True, "cpu", fused=True, quantized=False, cpp_wrapper=True)
        assert "C++ wrapper" in line and inductor_config.cpp_wrapper is True
    with pytest.raises(ConfigError, match="compile_cpp_wrapper: true needs the compiled layers.*torch_compile is false"):
        load_config(None, {"model_name_or_path": str(tiny_model), "dataset": ["x.json"], "torch_compile": False,
                           "compile_cpp_wrapper": True})
    assert load_config(None, {"model_name_or_path": "m", "dataset": ["x.json"]}).compile_cpp_wrapper is False
    for bad, says in (({"lora_dropout": 0.05}, "grouped_lora: true needs lora_dropout 0 \\(it is 0.05\\)"),
                      ({"fused_lora": False}, "grouped_lora: true needs the fused LoRA projection, but fused_lora is false")):
        with pytest.raises(ConfigError, match=says):
            load_config(None, {"model_name_or_path": "m", "dataset": ["x.json"], "grouped_lora": True, **bad})


def _has_bnb() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return False
    return True


def _nf4_lora_model(tiny_model, fused: bool, dropout: float = 0.0):
    """The tiny model in NF4 (double quantization, bf16 compute) with LoRA on every projection:
    bitsandbytes >= 0.49 quantizes on a CPU too, so this runs in CI."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    torch.manual_seed(0)
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.bfloat16)
    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16, device_map={"": DEVICE},
                                             quantization_config=q)
    m.config.use_cache = False
    m = get_peft_model(m, LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules="all-linear",
                                     task_type="CAUSAL_LM"))
    torch.manual_seed(1)
    for n, p in m.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.05)
    assert fused_lora.fuse_lora(m, fused).startswith("on" if fused else "off")
    return m


def _grads(m, ids, seed: int = 7):
    m.train()
    torch.manual_seed(seed)
    x = ids.to(next(m.parameters()).device)
    loss = m(input_ids=x, labels=x).loss
    loss.backward()
    # a copy: .float() of an fp32 grad is the grad itself, which a later backward would add to
    return loss.item(), {n: p.grad.detach().float().clone() for n, p in m.named_parameters() if p.requires_grad}


def _worst(g0: dict, g1: dict) -> tuple[float, str]:
    assert g0.keys() == g1.keys() and g0
    return max((((g0[n] - g1[n]).norm() / g0[n].norm()).item(), n) for n in g0)


IDS = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(2))


def fixed_dropout(monkeypatch, every: int = 10):
    """Replace torch's dropout (peft's nn.Dropout goes through F.dropout, the fused projection
    through torch.native_dropout) by one that drops the same elements of any tensor of a shape:
    every `every`-th by flat index, scaled by 1/(1-p) as torch does. Compares the two paths'
    dropout arithmetic without depending on how a backend maps random numbers to elements.
    Returns the calls so far by name ("dropout", "native_dropout"), for the test to check both ran."""
    calls = {"dropout": 0, "native_dropout": 0}

    def keep(x):
        return (torch.arange(x.numel(), device=x.device) % every != 0).reshape(x.shape)

    def dropout(x, p=0.5, training=True, inplace=False):
        calls["dropout"] += 1
        return x * keep(x) / (1 - p) if training and p else x

    def native_dropout(x, p, train):
        calls["native_dropout"] += 1
        k = keep(x)
        return (x * k / (1 - p) if train else x), k

    monkeypatch.setattr(torch.nn.functional, "dropout", dropout)
    monkeypatch.setattr(torch, "native_dropout", native_dropout)
    return calls
# NF4 with bf16 compute: the fused path and bitsandbytes' matmul round in another order. Measured
# on a CPU: worst gradient 1e-2 relative (compiled against eager, 2 layers); a weight of another
# layer, or a missing term, is of order 1.
NF4_TOL = 3e-2


@pytest.mark.skipif(not _has_bnb(), reason="needs bitsandbytes")
@pytest.mark.parametrize("dropout,fixed", [(0.0, False), (0.1, False), (0.1, True)], ids=["p0", "p0.1", "p0.1-fixed-masks"])
def test_fused_nf4_projection_equals_bitsandbytes(tiny_model, dropout, fixed, monkeypatch):
    """The fused projection dequantizes through bitsandbytes' torch.library ops, as
    bitsandbytes.functional does: same loss and gradients as peft over bitsandbytes' Linear4bit.
    With dropout on a GPU both sides drop the same fixed elements (fixed_dropout): peft drops the
    fp32 copy of x that it makes for its fp32 adapter, the fused projection drops bf16 x, and
    CUDA's dropout kernel maps its random numbers to elements by the dtype's vector width, so the
    masks differ there (equally random; on one H100 the worst gradient was 0.82 apart:
    bench/results/h100-2026-12-06e-call2). On the CPU the random stream itself is compared too."""
    if dropout and not fixed and DEVICE == "cuda":
        pytest.skip("CUDA's dropout masks depend on the dtype dropped (fp32 in peft, bf16 here): p0.1-fixed-masks compares the arithmetic")
    calls = fixed_dropout(monkeypatch) if fixed else None
    l0, g0 = _grads(_nf4_lora_model(tiny_model, False, dropout), IDS)
    l1, g1 = _grads(_nf4_lora_model(tiny_model, True, dropout), IDS)
    assert calls is None or (calls["dropout"] > 0 and calls["native_dropout"] > 0), calls  # both paths dropped the fixed elements
    assert abs(l0 - l1) < 1e-2 * abs(l0), (l0, l1)
    rel, name = _worst(g0, g1)
    assert rel < NF4_TOL, (name, rel)


@pytest.mark.skipif(not _has_bnb(), reason="needs bitsandbytes")
@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("shape", [(64, 128), (3584, 512)])  # 128 absmax blocks (< one nested block of 256); 28,672
def test_dequantize_in_graph_is_bitsandbytes_dequantize(nested, shape):
    """The torch-ops dequantization of compiled layers gives bitsandbytes' weight bit for bit."""
    import bitsandbytes.functional as bf

    w = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    packed, state = bf.quantize_4bit(w, quant_type="nf4", compress_statistics=nested, blocksize=64)
    want = bf.dequantize_4bit(packed, state)

    class Base:
        weight = packed
    packed.quant_state = state
    got = fused_lora.dequantize_in_graph(*fused_lora.base_weight_inputs(Base))
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.skipif(not _has_bnb(), reason="needs bitsandbytes")
def test_compiled_layers_dequantize_through_bitsandbytes_ops_unless_asked(monkeypatch):
    """Inside a compiled layer NF4 goes through bitsandbytes' ops by default and through the
    torch-ops copy only with TUNELEDGER_DEQUANT=graph. (The compiled test below used to read this
    off inductor's code with run_and_get_code, which left torch 2.5.1 segfaulting at its next compile.)"""
    import bitsandbytes.functional as bf

    w = torch.randn((64, 128), generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    packed, state = bf.quantize_4bit(w, quant_type="nf4", compress_statistics=True, blocksize=64)
    packed.quant_state = state

    class Base:
        weight = packed
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(fused_lora, "dequantize_in_graph", lambda *a: "graph")
    monkeypatch.delenv("TUNELEDGER_DEQUANT", raising=False)
    got = fused_lora._dequantize(*fused_lora.base_weight_inputs(Base))
    assert isinstance(got, torch.Tensor) and torch.equal(got, bf.dequantize_4bit(packed, state))
    monkeypatch.setenv("TUNELEDGER_DEQUANT", "graph")
    assert fused_lora._dequantize(*fused_lora.base_weight_inputs(Base)) == "graph"


@pytest.mark.slow
@pytest.mark.parametrize("quant", [pytest.param(False, id="dense"), pytest.param(True, id="nf4", marks=pytest.mark.skipif(
    not _has_bnb(), reason="needs bitsandbytes"))])
def test_compiled_fused_projection_has_eager_gradients(tiny_model, quant):
    """A compiled layer traces backward once for every layer: each layer's gradients must still
    use its own weights (the fused projection takes them as inputs, never off its ctx). About a
    minute of compiling on 2 CPU cores; bench/h200_levers.sh runs it on the GPU too."""
    def build(compile_it: bool):
        m = _nf4_lora_model(tiny_model, True) if quant else _lora_model(tiny_model, True)[0]
        if compile_it:
            compiled.compile_layers(m, True, DEVICE, fused=True, quantized=quant)
        return m

    (l0, g0), (l1, g1) = (_grads(build(c), IDS) for c in (False, True))
    assert abs(l0 - l1) < (1e-2 if quant else 1e-5) * abs(l0), (l0, l1)
    rel, name = _worst(g0, g1)
    assert rel < (NF4_TOL if quant else 1e-4), (name, rel)


def test_an_unknown_addmm_setting_is_refused_by_name(tiny_model, monkeypatch):
    """TUNELEDGER_ADDMM takes inplace or copy: a typo is a ValueError naming the variable (a
    PreflightError in the worker, model._lever), not a silent in-place run."""
    monkeypatch.setenv("TUNELEDGER_ADDMM", "off")
    with pytest.raises(ValueError, match=r"TUNELEDGER_ADDMM='off': use inplace .* or copy"):
        _lora_model(tiny_model, True)
    for ok in ("copy", "inplace"):  # the A/B's value and the default's name are accepted (read at import: the line's wording is not)
        monkeypatch.setenv("TUNELEDGER_ADDMM", ok)
        assert _lora_model(tiny_model, True)[1].startswith("on (14 projections; LoRA added ")


@pytest.mark.slow
def test_lora_added_in_place_has_the_same_gradients_eager_and_compiled(tiny_model, monkeypatch):
    """In place (fused_lora.add_product, the default): the LoRA term and dx added into the GEMM's
    own output give the out-of-place (TUNELEDGER_ADDMM=copy) loss and gradients, eager and in
    compiled layers, and the compiled graph calls tuneledger::addmm_ (kept in place, not turned
    back into a copy)."""
    from torch import _dynamo

    from tuneledger import fused_lora

    monkeypatch.setattr(fused_lora, "ADDMM_INPLACE", False)
    m, line = _lora_model(tiny_model, True)
    assert "LoRA added out of place: TUNELEDGER_ADDMM=copy" in line
    (l0, g0) = _grads(m, IDS)
    monkeypatch.setattr(fused_lora, "ADDMM_INPLACE", True)
    (l1, g1) = _grads(_lora_model(tiny_model, True)[0], IDS)
    assert abs(l0 - l1) < 1e-6 * abs(l0), (l0, l1)
    rel, name = _worst(g0, g1)
    assert rel < 1e-5, (name, rel)
    _dynamo.reset()  # traced anew with the in-place op, not reused from another test's graphs
    m, line = _lora_model(tiny_model, True)
    assert "LoRA added in place" in line  # the ledger says how it ran
    compiled.compile_layers(m, True, DEVICE, fused=True, quantized=False)
    before = fused_lora.addmm_calls[0]
    (l2, g2) = _grads(m, IDS)
    _dynamo.reset()
    assert fused_lora.addmm_calls[0] > before  # the compiled layers ran the op
    assert abs(l0 - l2) < 1e-5 * abs(l0), (l0, l2)
    rel, name = _worst(g0, g2)
    assert rel < 1e-4, (name, rel)


@pytest.mark.slow
def test_cpp_wrapper_compiled_layers_have_eager_gradients(tiny_model):
    """compile_cpp_wrapper launches the same kernels from C++: loss and gradients equal eager's
    (dense on 2 CPU cores, inductor's CPU C++ wrapper; the H200's CUDA one was 8.9e-05 from the
    Python wrapper's loss over 10 steps of preset C: bench/results/h200-2026-12-04/call14-c-cpp)."""
    import torch._inductor.config as inductor_config
    from torch import _dynamo

    _dynamo.reset()  # no other test's compiled layers (Python wrapper) reused from dynamo's cache
    eager = _lora_model(tiny_model, True)[0]
    wrapped = _lora_model(tiny_model, True)[0]
    with inductor_config.patch(cpp_wrapper=False):  # given back after: other tests compile with Python's
        assert "C++ wrapper" in compiled.compile_layers(wrapped, True, DEVICE, fused=True, quantized=False,
                                                        cpp_wrapper=True)
        (l0, g0), (l1, g1) = _grads(eager, IDS), _grads(wrapped, IDS)
    _dynamo.reset()
    assert abs(l0 - l1) < 1e-5 * abs(l0), (l0, l1)
    rel, name = _worst(g0, g1)
    assert rel < 1e-4, (name, rel)


@pytest.mark.slow
@pytest.mark.skipif(not _has_bnb(), reason="needs bitsandbytes")
def test_compiled_layer_keeps_no_dequantized_weight_for_backward(tiny_model):
    """Forward and backward each dequantize; traced into one graph, the compiler must not merge
    the two and keep the bf16 weight [out, in] of every projection alive until backward (13 GiB
    on Qwen2.5-7B)."""
    m = _nf4_lora_model(tiny_model, True)
    compiled.compile_layers(m, True, DEVICE, fused=True, quantized=True)
    weights = {tuple(mod.get_base_layer().weight.quant_state.shape) for mod in m.modules() if hasattr(mod, "lora_A")}
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    m.train()
    x = IDS[:1, :50].to(next(m.parameters()).device)  # 50 tokens: no activation [T, in] has a weight's shape
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(input_ids=x, labels=x).loss.backward()
    assert saved
    kept = [s for s in saved if s[0] in weights and s[1] == torch.bfloat16]
    assert not kept, kept


def _saved_activation_bytes(m, x) -> tuple[int, list]:
    """Bytes saved for backward by one training step in the decoder layers, and the saved
    (shape, dtype) list. Not counted: the model's parameters (a saved weight is a reference, no
    memory), NF4 quant states (absmax, code: the weights' too) and the logits and loss tensors
    [.., vocab], alike in every case and, with the tiny model's 151k vocabulary, larger than all
    layers together."""
    weights = {p.untyped_storage().data_ptr() for p in m.parameters()}
    for mod in m.modules():
        state = getattr(getattr(mod, "weight", None), "quant_state", None)
        for part in (state, getattr(state, "state2", None)):
            weights |= {t.untyped_storage().data_ptr() for t in vars(part).values() if torch.is_tensor(t)} if part else set()
    vocab = m.get_output_embeddings().weight.shape[0]
    total, kept = [0], []

    def pack(t):
        kept.append((tuple(t.shape), t.dtype))
        if t.untyped_storage().data_ptr() not in weights and vocab not in t.shape:
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(input_ids=x, labels=x).loss.backward()
    return total[0], kept


@pytest.mark.slow
@pytest.mark.parametrize("quant", [pytest.param(False, id="dense"), pytest.param(True, id="nf4", marks=pytest.mark.skipif(
    not _has_bnb(), reason="needs bitsandbytes"))])
def test_checkpoint_inside_compiled_layers_is_checkpointing(tiny_model, quant):
    """Checkpointing traced inside each compiled layer (compiled.checkpoint_inside, presets A/B
    with compile on) computes eager checkpointing's gradients and saves no more for backward
    than transformers' checkpoint does (the layers' inputs; weights not counted), far less than
    no checkpointing. With NF4 no dequantized bf16 weight is kept."""
    def build(gc: bool, compile_it: bool):
        m = _nf4_lora_model(tiny_model, True) if quant else _lora_model(tiny_model, True)[0]
        if gc:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if compile_it:
            line = compiled.compile_layers(m, True, DEVICE, fused=True, quantized=quant, checkpoint=gc)
            assert ("checkpointing inside, every op recomputed" in line) == gc, line
        m.train()
        return m

    ref = build(True, False)
    # 50 tokens (no activation [T, in] has a weight's shape), where the model is: the dense one
    # stays on the CPU on a GPU machine too (the GPU run of 2026-12-06 fed it CUDA ids).
    x = IDS[:1, :50].to(next(ref.parameters()).device)
    l0, g0 = _grads(ref, IDS)
    ref.zero_grad(set_to_none=True)
    ref_bytes, _ = _saved_activation_bytes(ref, x)
    no_gc_bytes, _ = _saved_activation_bytes(build(False, False), x)
    m = build(True, True)
    l1, g1 = _grads(m, IDS)
    m.zero_grad(set_to_none=True)
    inside_bytes, kept = _saved_activation_bytes(m, x)
    assert abs(l0 - l1) < (1e-2 if quant else 1e-5) * abs(l0), (l0, l1)
    rel, name = _worst(g0, g1)
    assert rel < (NF4_TOL if quant else 1e-4), (name, rel)
    assert ref_bytes < no_gc_bytes / 2, (ref_bytes, no_gc_bytes)  # the control: checkpointing saves memory here
    # Eager non-reentrant checkpointing holds each layer's inputs (hidden [B,T,H], cos and sin
    # [B,T,head_dim]) outside saved_tensors_hooks; the compiled graph saves them through the hooks
    # (torch 2.13), so they are the fair allowance on top of eager's count.
    cfg = m.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    size = m.get_input_embeddings().weight.element_size()
    inputs = cfg.num_hidden_layers * x.shape[1] * (cfg.hidden_size + 2 * head_dim) * size
    assert inside_bytes <= 1.1 * ref_bytes + inputs, (inside_bytes, ref_bytes, inputs)
    assert inside_bytes < no_gc_bytes / 2, (inside_bytes, no_gc_bytes)
    if quant:
        weights = {tuple(mod.get_base_layer().weight.quant_state.shape) for mod in m.modules() if hasattr(mod, "lora_A")}
        assert not [s for s in kept if s[0] in weights and s[1] == torch.bfloat16]
