"""`use_unsloth_gc` (LLaMA-Factory's key): gradient checkpointing whose kept layer inputs wait in
pinned CPU memory instead of GPU memory, as Unsloth's and LLaMA-Factory's "unsloth" checkpointing do.

Why: with checkpointing, what stays on the GPU between a layer's forward and its backward is the
layer's input, [micro-batch, T, hidden] bf16 per decoder layer: 28 x 2 x 1,000 x 3,584 x 2 bytes,
about 0.4 GB, at preset B's micro-batch 2 of 1,000-token rows on Qwen2.5-7B. Unsloth's B keeps
them on the CPU, and ran in 0.3 GiB less than our B without absmax_once (8.3 against 8.6 GiB;
bench/results/h100-2026-12-07-call1).

How: a saved-tensor hook (torch.autograd.graph.saved_tensors_hooks) around the decoder stack's
forward copies each [.., T, hidden] floating tensor that autograd keeps (1 MiB or more, contiguous,
on a CUDA GPU) into pinned host memory without waiting (the copy is queued on the compute stream,
so the GPU memory is reused only after it), and copies it back when backward unpacks it. What
autograd keeps there is the layers' inputs only when every layer is checkpointed:
- compiled layers take their checkpoint inside (compiled.checkpoint_inside): the compiled
  function saves its inputs for the recompute, and torch applies ambient hooks to them at run time;
- eager layers: transformers' checkpoint turns reentrant (torch.utils.checkpoint with
  use_reentrant=True saves its inputs with save_for_backward; the non-reentrant one keeps them in
  a closure that no hook sees). LLaMA-Factory's use_unsloth_gc is reentrant too.
The final norm's input is kept the same way (one more tensor). Nothing changes in the arithmetic:
the same values come back (tests/test_offload.py).
Cost: two PCIe copies of each layer input a micro-batch, on the compute stream (as Unsloth's).
"""

from __future__ import annotations

from typing import Any

import torch

MIN_BYTES = 1 << 20  # smaller saved tensors (cos/sin, masks, norms' statistics) stay where they are
DEVICE_TYPES = ("cuda",)  # tests add "cpu" to run the same path without a GPU
LAST = {"tensors": 0, "bytes": 0}  # what the last training forward offloaded (tests, the ledger's line)


class OffloadLayerInputs(torch.autograd.graph.saved_tensors_hooks):
    """Saved [.., T, `hidden`] floating tensors of 1 MiB or more go to pinned host memory for backward."""

    def __init__(self, hidden: int):
        def pack(t: torch.Tensor) -> Any:
            size = t.numel() * t.element_size()
            if (t.device.type not in DEVICE_TYPES or t.dim() < 2 or t.shape[-1] != hidden or not t.is_floating_point()
                    or size < MIN_BYTES or not t.is_contiguous()):
                return t
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            host.copy_(t, non_blocking=True)
            LAST["tensors"] += 1
            LAST["bytes"] += size
            return host, t.device

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            host, device = packed
            return host.to(device, non_blocking=True)

        super().__init__(pack, unpack)


def offload_layer_inputs(model: Any, wanted: bool, checkpointing: bool, sharded: bool = False) -> str:
    """Wrap the decoder stack's forward (the module holding `layers`) of `model` so that, while
    training with grad, the tensors its checkpointed layers keep go to pinned CPU memory.

    `wanted`: use_unsloth_gc. Call after the model's gradient checkpointing is set up (eager layers
    must checkpoint reentrantly: model.load_model does). Returns the ledger's line; raises
    ValueError when asked for with FSDP (`sharded`: FSDP's own offload applies there)."""
    if not wanted:
        return "off"
    if sharded:
        raise ValueError("use_unsloth_gc: true is for DDP presets; with fsdp (preset F) use fsdp_config's "
                         "offload_params (FSDP's CPU offload) instead")
    if not checkpointing:
        return "off (gradient checkpointing is off: no layer inputs are kept to offload)"
    device = next(model.parameters()).device.type
    if device not in DEVICE_TYPES:
        return f"off (the layers run on the {device.upper()}: their inputs are in host memory already)"
    stack = next((m for m in model.modules() if isinstance(getattr(m, "layers", None), torch.nn.ModuleList)), None)
    if stack is None:
        raise ValueError("use_unsloth_gc: no decoder layers (a `layers` ModuleList) found")
    hidden = int(model.config.hidden_size)
    forward = stack.forward

    def offloaded(*args: Any, **kwargs: Any) -> Any:
        if not (stack.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        LAST.update(tensors=0, bytes=0)
        with OffloadLayerInputs(hidden):
            return forward(*args, **kwargs)

    stack.forward = offloaded
    return (f"on ({len(stack.layers)} checkpointed layer inputs of [.., T, {hidden}] kept in pinned CPU memory, "
            "copied on the compute stream)")
