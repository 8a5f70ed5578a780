"""swiglu_recompute (swiglu.py): the MLP's down_proj input h = silu(gate) x up remade in backward
gives the fused projections' loss and gradients (dense fp32 to rounding, with dropout, grouped,
under eager checkpointing, compiled, and NF4 within the fused path's tolerance), and keeps one
T x intermediate tensor per MLP less for backward. bench/h200_levers.sh can run this file on the
GPU too."""

from __future__ import annotations

import pytest
import torch

from tuneledger import compiled, fused_lora, swiglu
from tuneledger.config_load import load_config

import test_speed as speed_tests  # its loss-and-gradient helpers (tests/ is on the path)
from test_grouped import DEVICE, NF4_TOL, _has_bnb
from test_grouped import _model as _fused_model
from test_speed import IDS, _worst


def _model(tiny_model, recompute: bool, group: bool = False, quant: bool = False, dropout: float = 0.0):
    m = _fused_model(tiny_model, group, quant, dropout)
    if recompute:
        assert swiglu.recompute_swiglu(m, True, True).startswith(f"on ({m.config.num_hidden_layers} MLPs")
    return m


def _grads(m, seed: int = 7):
    return speed_tests._grads(m, IDS, seed)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_recomputed_swiglu_equals_the_fused_projections(tiny_model, monkeypatch, dropout):
    """Loss and every LoRA gradient as the fused projections give them, dropout included (the
    mask is drawn on h in the same order), and every MLP goes through the recomputing function."""
    l0, g0 = _grads(_model(tiny_model, False, dropout=dropout))
    m = _model(tiny_model, True, dropout=dropout)
    calls = []
    apply = swiglu.SwiGLUDownProjection.apply
    monkeypatch.setattr(swiglu.SwiGLUDownProjection, "apply", lambda *a: calls.append(1) or apply(*a))
    l1, g1 = _grads(m)
    assert len(calls) == m.config.num_hidden_layers
    assert abs(l0 - l1) < 1e-6 * abs(l0), (l0, l1)
    rel, name = _worst(g0, g1)
    assert rel < 1e-5, (name, rel)


def test_recomputed_swiglu_with_grouped_lora_and_eager_checkpointing(tiny_model):
    """With gate/up grouped (the group computes both at gate's call), and under transformers'
    eager checkpointing (presets A and B where nothing is compiled): the same gradients."""
    def build(recompute: bool, checkpoint: bool):
        m = _model(tiny_model, recompute, group=True)
        if checkpoint:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return m

    l0, g0 = _grads(_model(tiny_model, False))
    for checkpoint in (False, True):
        l1, g1 = _grads(build(True, checkpoint))
        assert abs(l0 - l1) < 1e-5 * abs(l0), (checkpoint, l0, l1)
        rel, name = _worst(g0, g1)
        assert rel < 1e-4, (checkpoint, name, rel)


def _saved_sizes(mlp, x) -> list[tuple]:
    """The shapes of every tensor autograd keeps for backward during one MLP forward."""
    shapes: list[tuple] = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp(x)
    return shapes


def test_h_is_not_kept_for_backward(tiny_model):
    """The point of the lever: of the [T, intermediate] tensors kept for backward, the fused path
    keeps gate's output, silu(gate), up's output and h; the recomputing one keeps gate's and up's only."""
    plain, lean = _model(tiny_model, False), _model(tiny_model, True)
    inter = plain.config.intermediate_size
    x = torch.randn(1, 12, plain.config.hidden_size, requires_grad=True)
    wide = {}
    for name, m in (("plain", plain), ("lean", lean)):
        mlp = m.base_model.model.model.layers[0].mlp
        wide[name] = sum(1 for s in _saved_sizes(mlp, x) if s[-1] == inter and s[0] * (s[1] if len(s) == 3 else 1) == 12)
    assert wide == {"plain": 4, "lean": 2}, wide


@pytest.mark.skipif(not _has_bnb(), reason="needs bitsandbytes")
def test_recomputed_swiglu_over_nf4(tiny_model):
    """Over NF4 bases (double quantization, bf16 compute): the same loss and gradients as the fused
    projections within their own tolerance."""
    (l0, g0), (l1, g1) = _grads(_model(tiny_model, False, quant=True)), _grads(_model(tiny_model, True, quant=True))
    assert abs(l0 - l1) < 1e-2 * abs(l0), (l0, l1)
    rel, name = _worst(g0, g1)
    assert rel < NF4_TOL, (name, rel)


def test_swiglu_recompute_is_refused_where_it_cannot_apply_and_auto_says_why_it_is_off(tiny_model):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    assert swiglu.recompute_swiglu(_model(tiny_model, False), False, True) == "off"
    with pytest.raises(ValueError, match="swiglu_recompute: true, but it needs the fused LoRA projection"):
        swiglu.recompute_swiglu(_model(tiny_model, False), True, False)
    assert swiglu.recompute_swiglu(_model(tiny_model, False), None, False) == \
        "off (it needs the fused LoRA projection, which is off here)"
    m = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                       LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "gate_proj"], task_type="CAUSAL_LM"))
    fused_lora.fuse_lora(m, True)
    with pytest.raises(ValueError, match="needs LoRA on down_proj"):
        swiglu.recompute_swiglu(m, True, True)
    assert swiglu.recompute_swiglu(m, None, True).startswith("off (it needs LoRA on down_proj")
    # auto under checkpointing: off (the layer is remade anyway); asked for, it still runs
    m = _model(tiny_model, False)  # fused
    assert swiglu.recompute_swiglu(m, None, True, checkpointing=True) == \
        "off (gradient checkpointing remakes the MLP's activations anyway)"
    assert swiglu.recompute_swiglu(m, True, True, checkpointing=True).startswith("on (")


def test_swiglu_recompute_is_on_where_it_applies_unless_set_false(tiny_model):
    from tuneledger.config import ConfigError
    from tuneledger.model import PreflightError, load_model

    base = {"model_name_or_path": str(tiny_model), "dataset": ["x.json"], "lora_rank": 4, "gradient_checkpointing": False}
    model, info = load_model(load_config(None, base), "cpu")
    assert info["levers"]["swiglu_recompute"].startswith(f"on ({model.config.num_hidden_layers} MLPs")
    assert load_model(load_config(None, {**base, "swiglu_recompute": False}), "cpu")[1]["levers"]["swiglu_recompute"] == "off"
    assert load_model(load_config(None, {**base, "gradient_checkpointing": True}), "cpu")[1]["levers"][
        "swiglu_recompute"].startswith("off (gradient checkpointing")
    assert load_model(load_config(None, {**base, "fused_lora": False}), "cpu")[1]["levers"][
        "swiglu_recompute"].startswith("off (it needs the fused LoRA projection")
    with pytest.raises(ConfigError, match="swiglu_recompute: true needs the fused LoRA projection"):
        load_config(None, {**base, "swiglu_recompute": True, "fused_lora": False})  # refused as it loads
    with pytest.raises(PreflightError, match="swiglu_recompute: true, but it needs the fused LoRA projection"):
        load_model(load_config(None, {**base, "swiglu_recompute": True}).model_copy(update={"fused_lora": False}), "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", [pytest.param(False, id="C-D"), pytest.param(True, id="A-B-checkpoint-inside")])
def test_compiled_recomputed_swiglu_has_eager_gradients_and_no_graph_break(tiny_model, checkpoint):
    """Inside compiled decoder layers (presets C and D on a GPU; A and B with the checkpoint
    traced inside the layer): eager's gradients, and no graph break or compile that the fused
    path's compiled layers do not have."""
    from torch import _dynamo
    from torch._dynamo.utils import counters

    def build(recompute: bool):
        m = _model(tiny_model, recompute)
        if checkpoint:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return m

    def compiled_run(recompute: bool):
        _dynamo.reset()
        counters.clear()
        m = build(recompute)
        compiled.compile_layers(m, True, DEVICE, fused=True, quantized=False, checkpoint=checkpoint)
        out = _grads(m)
        m.zero_grad(set_to_none=True)
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            m(input_ids=IDS[:1, :50], labels=IDS[:1, :50])
        wide = sum(1 for s in shapes if s and s[-1] == m.config.intermediate_size and 50 in s) / m.config.num_hidden_layers
        return out, (dict(counters["graph_break"]), counters["stats"]["unique_graphs"]), wide

    l0, g0 = _grads(build(True))
    _, fused_breaks, fused_wide = compiled_run(False)
    (l1, g1), breaks, wide = compiled_run(True)
    _dynamo.reset()
    assert breaks == fused_breaks, (breaks, fused_breaks)
    if not checkpoint:  # the compiler's partitioner keeps gate's, up's and h; with the lever gate's and up's
        assert (fused_wide, wide) == (3, 2), (fused_wide, wide)
    assert abs(l0 - l1) < 1e-5 * abs(l0), (l0, l1)
    rel, name = _worst(g0, g1)
    assert rel < 1e-4, (name, rel)
