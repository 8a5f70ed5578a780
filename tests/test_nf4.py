"""absmax_once (nf4.py): the unnested quant states give bitsandbytes' own weights bit for bit, the
fused projection's loss and gradients are unchanged, and the ledger line says what it did.
bench/h200_levers.sh runs this file on the GPU too."""

from __future__ import annotations

import pytest
import torch

from tuneledger import nf4
from tuneledger.config_load import load_config

import test_speed as speed_tests
from test_speed import IDS, _has_bnb

needs_bnb = pytest.mark.skipif(not _has_bnb(), reason="needs bitsandbytes (>= 0.49 quantizes on a CPU)")


@needs_bnb
@pytest.mark.parametrize("shape", [(64, 128), (3584, 512)])  # under one nested block of 256 absmax; 28,672 blocks
def test_unnested_state_dequantizes_to_the_same_weight(shape):
    import bitsandbytes.functional as bf

    w = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    packed, qs = bf.quantize_4bit(w, quant_type="nf4", compress_statistics=True, blocksize=64)
    want = bf.dequantize_4bit(packed, qs)
    assert qs.nested
    added = nf4.unnest(qs)
    assert not qs.nested and qs.state2 is None and qs.absmax.dtype == torch.float32
    blocks = qs.absmax.numel()  # fp32 now; before: 1 B each, and one fp32 nested absmax per 256
    assert added == 4 * blocks - (blocks + 4 * -(-blocks // 256))
    got = bf.dequantize_4bit(packed, qs)
    assert torch.equal(got, want), (got - want).abs().max()


@needs_bnb
def test_fused_projection_unchanged_and_the_line_says_so(tiny_model):
    m0 = speed_tests._nf4_lora_model(tiny_model, True)
    l0, g0 = speed_tests._grads(m0, IDS)
    m1 = speed_tests._nf4_lora_model(tiny_model, True)
    n = len(nf4.nested_states(m1))
    assert n > 0
    line = nf4.absmax_once(m1, True)
    assert line.startswith(f"on ({n} weights, +") and line.endswith(" MiB)"), line
    assert nf4.nested_states(m1) == []
    l1, g1 = speed_tests._grads(m1, IDS)
    assert l1 == l0
    rel, name = speed_tests._worst(g0, g1)
    assert rel == 0.0, (name, rel)
    assert nf4.absmax_once(m1, True) == "off (no double-quantized weight)"


@needs_bnb
def test_left_off_by_default_where_the_nf4_kernel_rebuilds_the_scales(tiny_model):
    """Where our NF4 kernel rebuilds double quantization's scales in its own launch, the default
    leaves the 8-bit scales alone and says what the lever would have added; true still forces it,
    and adds exactly that."""
    import re

    m = speed_tests._nf4_lora_model(tiny_model, True)
    n = len(nf4.nested_states(m))
    line = nf4.absmax_once(m, None, kernel_nested=True)
    assert line.startswith("off (the NF4 kernel rebuilds double quantization's scales in its own launch"), line
    assert len(nf4.nested_states(m)) == n > 0  # untouched
    would = re.search(r"add (\d+) MiB", line)
    forced = nf4.absmax_once(m, True, kernel_nested=True)
    assert forced.startswith(f"on ({n} weights, +{would.group(1)} MiB)"), (line, forced)


def test_on_where_it_applies_unless_set_false_and_never_on_preset_f(tiny_model):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert nf4.absmax_once(m, None) == "off (no double-quantized weight)"
    assert nf4.absmax_once(m, False) == "off"
    assert nf4.absmax_once(m, True, sharded=True).startswith("off (preset F")
    assert nf4.absmax_once(m, True) == "off (no double-quantized weight)"


def test_absmax_once_is_a_config_key():
    cfg = load_config(None, {"model_name_or_path": "m", "dataset": ["x.json"], "absmax_once": True})
    assert cfg.absmax_once is True
    assert load_config(None, {"model_name_or_path": "m", "dataset": ["x.json"]}).absmax_once is None  # where it applies


@needs_bnb
def test_grouped_projection_reads_the_unnested_states(tiny_model):
    """grouped_lora dequantizes each member through the same path: unchanged with absmax_once."""
    import test_grouped

    l0, g0 = speed_tests._grads(test_grouped._model(tiny_model, True, quant=True), IDS)
    m1 = test_grouped._model(tiny_model, True, quant=True)
    assert nf4.absmax_once(m1, True).startswith("on (")
    l1, g1 = speed_tests._grads(m1, IDS)
    assert l1 == l0
    assert speed_tests._worst(g0, g1)[0] == 0.0
