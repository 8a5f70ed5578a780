"""use_unsloth_gc (offload.py): checkpointed layers' inputs wait in host memory until backward.
On CPU the same hook runs with "cpu" added to offload.DEVICE_TYPES (a copy to host memory, not
pinned): the same loss and gradients as plain checkpointing, eager (reentrant) and compiled
(checkpoint inside), and no layer input left alive on the device between forward and backward.
On a GPU (bench/h200_levers.sh's GPU tests): the same, over NF4, and a lower peak allocation."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tuneledger import compiled, offload
from tuneledger.config_load import load_config

from test_grouped import DEVICE, NF4_TOL, _has_bnb
from test_grouped import _model as _fused_model
from test_speed import IDS, _grads, _worst

CUDA = torch.cuda.is_available()


@pytest.fixture
def on_this_device(monkeypatch):
    """Offload from this test's device (CPU included) and whatever the tiny model's size."""
    monkeypatch.setattr(offload, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(offload, "MIN_BYTES", 0)


def _checkpointed(tiny_model, unsloth_gc: bool, quant: bool = False, compile_layers: bool = False):
    m = _fused_model(tiny_model, False, quant)
    if compile_layers:
        from torch import _dynamo

        _dynamo.reset()
        compiled.compile_layers(m, True, DEVICE, fused=True, quantized=quant, checkpoint=True)
    else:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": unsloth_gc})
        m.enable_input_require_grads()
    line = offload.offload_layer_inputs(m, unsloth_gc, checkpointing=True)
    assert line.startswith(f"on ({m.config.num_hidden_layers} checkpointed layer inputs") == unsloth_gc, line
    return m


def _kept_layer_inputs(m) -> int:
    """How many decoder layers' input tensors are still alive after a training forward (before
    backward): the ones autograd keeps on the device."""
    refs = []
    hooks = [layer.register_forward_pre_hook(lambda mod, args, kw: refs.append(weakref.ref(
        kw.get("hidden_states", args[0] if args else None))), with_kwargs=True)
        for layer in m.base_model.model.model.layers]
    m.train()
    out = m(input_ids=IDS.to(DEVICE), labels=IDS.to(DEVICE))
    for h in hooks:
        h.remove()
    gc.collect()
    alive = sum(1 for r in refs[1:] if r() is not None)  # [0]: the embedding's output, kept by its own op
    out.loss.backward()
    return alive


def test_eager_checkpointing_keeps_no_layer_input_on_the_device_and_the_same_gradients(tiny_model, on_this_device):
    """Reentrant checkpointing under the hook: the same loss and gradients as transformers'
    non-reentrant checkpointing, and every layer input after the first handed to host memory."""
    n = _fused_model(tiny_model, False).config.num_hidden_layers
    l0, g0 = _grads(_checkpointed(tiny_model, False), IDS)
    l1, g1 = _grads(_checkpointed(tiny_model, True), IDS)
    assert offload.LAST["tensors"] >= n - 1 and offload.LAST["bytes"] > 0, offload.LAST
    assert abs(l0 - l1) < 1e-6 * abs(l0), (l0, l1)
    rel, name = _worst(g0, g1)
    assert rel < 1e-5, (name, rel)
    assert _kept_layer_inputs(_checkpointed(tiny_model, False)) == n - 1  # the checkpoint's closure holds them
    assert _kept_layer_inputs(_checkpointed(tiny_model, True)) == 0


def test_evaluation_and_no_grad_pass_the_hook_by(tiny_model, on_this_device):
    m = _checkpointed(tiny_model, True)
    offload.LAST.update(tensors=-1, bytes=-1)
    m.eval()
    with torch.no_grad():
        m(input_ids=IDS.to(DEVICE))
    assert offload.LAST == {"tensors": -1, "bytes": -1}


@pytest.mark.slow
def test_compiled_layers_with_the_checkpoint_inside_offload_the_same_gradients(tiny_model, on_this_device):
    """Compiled layers (checkpoint inside): torch applies the ambient hook to what the compiled
    function saves, its inputs; the gradients stay eager's."""
    l0, g0 = _grads(_checkpointed(tiny_model, False), IDS)
    m = _checkpointed(tiny_model, True, compile_layers=True)
    l1, g1 = _grads(m, IDS)
    assert offload.LAST["tensors"] >= m.config.num_hidden_layers - 1, offload.LAST
    assert abs(l0 - l1) < 1e-5 * abs(l0), (l0, l1)
    rel, name = _worst(g0, g1)
    assert rel < 1e-4, (name, rel)


@pytest.mark.skipif(not (CUDA and _has_bnb()), reason="needs a CUDA GPU and bitsandbytes")
@pytest.mark.parametrize("compile_layers", [False, True], ids=["eager", "compiled"])
def test_on_a_gpu_over_nf4_the_same_gradients_in_less_memory(tiny_model, monkeypatch, compile_layers):
    """With the shipped thresholds (CUDA only, 1 MiB): long rows so each layer input is over
    1 MiB; the same gradients as plain checkpointing within the NF4 path's tolerance and a lower
    peak allocation."""
    ids = torch.randint(0, 1000, (4, 2048), generator=torch.Generator().manual_seed(3))

    def run(unsloth_gc: bool):
        m = _checkpointed(tiny_model, unsloth_gc, quant=True, compile_layers=compile_layers)
        _grads(m, ids)  # compile and warm up
        m.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = _grads(m, ids)
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - base

    (l0, g0), peak0 = run(False)
    (l1, g1), peak1 = run(True)
    assert offload.LAST["tensors"] >= 1 and offload.LAST["bytes"] >= 1 << 20, offload.LAST
    assert abs(l0 - l1) < 1e-2 * abs(l0), (l0, l1)
    rel, name = _worst(g0, g1)
    assert rel < NF4_TOL, (name, rel)
    assert peak1 < peak0, (peak0, peak1)


def test_the_key_loads_refuses_fsdp_and_says_when_it_has_nothing_to_do(tiny_model, monkeypatch):
    from tuneledger.config import ConfigError
    from tuneledger.model import load_model

    base = {"model_name_or_path": str(tiny_model), "dataset": ["x.json"], "lora_rank": 4}
    assert load_model(load_config(None, base), "cpu")[1]["levers"]["use_unsloth_gc"] == "off"
    assert load_model(load_config(None, {**base, "use_unsloth_gc": True}), "cpu")[1]["levers"]["use_unsloth_gc"] == \
        "off (the layers run on the CPU: their inputs are in host memory already)"
    monkeypatch.setattr(offload, "DEVICE_TYPES", ("cuda", "cpu"))
    model, info = load_model(load_config(None, {**base, "use_unsloth_gc": True}), "cpu")
    assert info["levers"]["use_unsloth_gc"].startswith(f"on ({model.config.num_hidden_layers} checkpointed layer inputs")
    assert load_model(load_config(None, {**base, "use_unsloth_gc": True, "gradient_checkpointing": False}), "cpu")[1][
        "levers"]["use_unsloth_gc"].startswith("off (gradient checkpointing is off")
    with pytest.raises(ConfigError, match="use_unsloth_gc: true is for DDP presets"):
        load_config(None, {**base, "use_unsloth_gc": True, "fsdp": "full_shard auto_wrap"})
