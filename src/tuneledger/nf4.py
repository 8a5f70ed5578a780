"""`absmax_once`: double quantization's absmax dequantized once, at load, instead of at every use.

With double quantization (`double_quantization: true`, the default and Unsloth's) each 4-bit
weight's per-block scales (absmax, one per 64 weights) are themselves stored in 8 bits. Every
dequantization of the weight, forward and again in backward, first rebuilds them in fp32: a
`dequantize_blockwise` kernel and an add of the offset, two launches and two dispatcher calls on
the host, before the weight's own kernel. On Qwen2.5-7B that is 196 weights x 2 passes x 2 ops per
micro-batch, the host time that host-bound presets (A-C at micro-batch 1-2 on an H200) wait on.

Here each quant state is rebuilt as a plain one whose absmax is that same fp32 result, computed
once by bitsandbytes' own ops: every later dequantization reads the same scales and makes the
same bf16 weight, bit for bit (tests/test_nf4.py), with one kernel instead of three. Cost: 4 bytes
per 64 weights instead of about 1 (+332 MiB on Qwen2.5-7B: 7.07e9 / 64 x 3 B).
"""

from __future__ import annotations

from typing import Any


def nested_states(model: Any) -> list:
    """The bitsandbytes quant states of `model` that use double quantization, each once (peft's
    LoRA layer shows its base layer's weight as its own)."""
    out: dict[int, Any] = {}
    for m in model.modules():
        qs = getattr(getattr(m, "weight", None), "quant_state", None)
        if qs is not None and getattr(qs, "nested", False):
            out[id(qs)] = qs
    return list(out.values())


def unnest(qs: Any) -> int:
    """Turn one nested quant state into a plain one in place: absmax becomes
    dequantize_blockwise(absmax, state2) + offset in fp32, exactly as
    bitsandbytes.functional.dequantize_4bit computes it at every call. Returns the bytes it added."""
    import torch

    added = added_bytes(qs)
    from tuneledger.fused_lora import plain_absmax

    with torch.no_grad():
        absmax = plain_absmax(qs.absmax, qs.state2.absmax, qs.state2.code, qs.offset, qs.state2.blocksize)
    qs.absmax, qs.nested, qs.state2, qs.offset = absmax.float(), False, None, None
    return added


def added_bytes(qs: Any) -> int:
    """What unnest() adds to one nested quant state: fp32 scales in place of the 8-bit ones and
    their own nested scales."""
    return (qs.absmax.numel() * 4 - qs.absmax.numel() * qs.absmax.element_size()
            - qs.state2.absmax.numel() * qs.state2.absmax.element_size())


def absmax_once(model: Any, wanted: bool | None, sharded: bool = False, kernel_nested: bool = False) -> str:
    """Apply the lever to every double-quantized weight of `model` unless `wanted` is False. None,
    the default: wherever there is one, unless `kernel_nested` (our NF4 kernel rebuilds the 8-bit
    scales inside its own launch, nf4_kernel.rebuilds_nested_scales: also one kernel per
    dequantization, so the lever would only add memory); True: wherever there is one, it never
    refuses. Returns the ledger's line. Preset F is left alone: FSDP2 shards the quant states with
    the weights."""
    if wanted is False:
        return "off"
    if sharded:
        return "off (preset F: FSDP2 shards the quant states)"
    states = nested_states(model)
    if not states:
        return "off (no double-quantized weight)"
    if wanted is None and kernel_nested:
        would = sum(added_bytes(qs) for qs in states)
        return (f"off (the NF4 kernel rebuilds double quantization's scales in its own launch: "
                f"the lever would add {would / 2**20:.0f} MiB for no launch; absmax_once=true forces it)")
    added = sum(unnest(qs) for qs in states)
    return f"on ({len(states)} weights, +{added / 2**20:.0f} MiB)"
