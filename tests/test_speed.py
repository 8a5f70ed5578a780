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

from tuneledger import speed
from tuneledger.config import load_config
from tuneledger.data import encode
from tuneledger.trainer import make_collator

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


def _lora_model(tiny_model, fused: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    torch.manual_seed(1)
    for n, p in model.named_parameters():
        if "lora_B" in n:  # peft starts B at zero, which would hide a wrong B gradient or scale
            p.data.normal_(0, 0.05)
    line = speed.fuse_lora(model, True if fused else False)
    return model, line


def test_fused_lora_equals_peft(tiny_model, qwen_tokenizer):
    ids = torch.tensor([encode(CONVS[1], qwen_tokenizer, 4096)["input_ids"]])
    out = {}
    for fused in (False, True):
        model, line = _lora_model(tiny_model, fused)
        assert line.startswith("on") == fused, line
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out[fused] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    (l0, g0), (l1, g1) = out[False], out[True]
    assert abs(l0 - l1) < 1e-5 * abs(l0), (l0, l1)
    assert g0.keys() == g1.keys() and len(g0) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    for n in g0:
        rel = ((g0[n] - g1[n]).norm() / g0[n].norm()).item()
        assert rel < 1e-4, (n, rel)


def test_fused_lora_refuses_dropout(tiny_model):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                           LoraConfig(r=4, lora_dropout=0.1, target_modules="all-linear", task_type="CAUSAL_LM"))
    assert speed.fuse_lora(model, None) == "off (lora_dropout > 0 (peft's path applies it))"
    with pytest.raises(ValueError, match="lora_dropout"):
        speed.fuse_lora(model, True)


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
    ({"fused_lora": True, "lora_dropout": 0.1}, "set lora_dropout=0"),
    ({"fused_lora": True, "lora_dropout": 0.0, "torch_compile": True}, "set one of them to false"),
    ({"flash_attn": "flex", "packing": True}, "set flash_attn=auto"),
])
def test_preflight_refuses_a_lever_that_cannot_run(tiny_model, over, match):
    from tuneledger.model import PreflightError
    from tuneledger.preflight import run_checks

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
    assert levers["fused_lora"] == "on (14 projections)" and levers["compile"] == "off"


def test_fused_lora_stays_out_of_compiled_layers(tiny_model):
    model, _ = _lora_model(tiny_model, False)
    assert speed.fuse_lora(model, None, compiled=True).startswith("off (torch_compile")
    with pytest.raises(ValueError, match="do not go together"):
        speed.fuse_lora(model, True, compiled=True)


def _has_bnb_cuda() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return False
    return CUDA


@pytest.mark.slow
@pytest.mark.parametrize("quant", [pytest.param(False, id="dense"), pytest.param(True, id="nf4", marks=pytest.mark.skipif(
    not _has_bnb_cuda(), reason="NF4 needs bitsandbytes and a CUDA GPU"))])
def test_compiled_fused_projection_has_eager_gradients(tiny_model, quant):
    """The mechanism behind refusing fused_lora + torch_compile: on an H200 (NF4, torch 2.11) the
    compiled fused projection trained wrongly; on a CPU (dense, torch 2.5.1) it matches. This runs
    both where it can, so the device call shows whether a fix holds."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    def build(compiled: bool):
        torch.manual_seed(0)
        kw = {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                        bnb_4bit_compute_dtype=torch.bfloat16)} if quant else {}
        m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=DTYPE if quant else torch.float32,
                                                 device_map={"": DEVICE if quant else "cpu"}, **kw)
        m.config.use_cache = False
        m = get_peft_model(m, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                                         task_type="CAUSAL_LM"))
        torch.manual_seed(1)
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.data.normal_(0, 0.05)
        speed.fuse_lora(m, True)
        if compiled:
            speed.compile_layers(m, True, DEVICE if quant else "cpu")
        return m

    ids = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(2))
    grads = []
    for compiled in (False, True):
        m = build(compiled)
        x = ids.to(next(m.parameters()).device)
        m(input_ids=x, labels=x).loss.backward()
        grads.append({n: p.grad.float() for n, p in m.named_parameters() if p.requires_grad})
    tol = 2e-2 if quant else 1e-4
    for n, g in grads[0].items():
        rel = ((g - grads[1][n]).norm() / g.norm()).item()
        assert rel < tol, (n, rel)
