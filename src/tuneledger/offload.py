"""`use_unsloth_gc` (LLaMA-Factory's key): gradient checkpointing whose kept layer inputs wait in
pinned host memory instead of GPU memory, as Unsloth's and LLaMA-Factory's "unsloth" checkpointing do.

Why: with checkpointing, what stays on the GPU between a layer's forward and its backward is the
layer's input, [micro-batch, T, hidden] bf16 per decoder layer: 28 x 2 x 1,000 x 3,584 x 2 bytes,
about 0.4 GB, at preset B's micro-batch 2 of 1,000-token rows on Qwen2.5-7B. Unsloth's B, whose
checkpointing keeps them on the host, ran in 8.3 GiB against our B's 8.6 without absmax_once
(bench/results/h100-2026-12-07-call1); that this is where the difference lies is our reading,
not measured.

How: a saved-tensor hook (torch.autograd.graph.saved_tensors_hooks) around the decoder stack's
forward copies each [.., T, hidden] floating tensor that autograd keeps (1 MiB or more, contiguous,
on a CUDA GPU) into pinned host memory without a host sync, and back when backward unpacks it.
Both copies are queued on the compute stream: the GPU block is reused only by later work on that
stream, after the copy (the GPU waits for the copies; they are not overlapped). With every layer
checkpointed, what autograd keeps there is the layers' inputs: torch's checkpoint saves its
positional inputs with save_for_backward (non-reentrant: _NoopSaveInputs; compiled layers, which
take their checkpoint inside, save them for the recompute), and ambient hooks apply to both.
Also kept, and moved: the final norm's input. Not moved: a leaf that requires grad (the embedding's
output under enable_input_require_grads: autograd keeps that tensor anyway), and the model's own
weights and buffers (a compiled layer saves a frozen bf16 weight it needs in backward as is: it
stays on the GPU anyway). A tensor saved twice in
one forward is copied once. The same values come back, so the loss and gradients do not change
(tests/test_offload.py).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

MIN_BYTES = 1 << 20  # smaller saved tensors (cos/sin, masks, norms' statistics) stay where they are
DEVICE_TYPES = ("cuda",)  # tests add "cpu" to run the same path without a GPU
LAST = {"tensors": 0, "bytes": 0}  # what the last training forward moved to host memory (ledger, tests)


class OffloadLayerInputs(torch.autograd.graph.saved_tensors_hooks):
    """Saved [.., T, `hidden`] floating tensors of 1 MiB or more go to pinned host memory for backward;
    `weights`: the storage addresses (untyped_storage().data_ptr()) of tensors to leave in place,
    the model's parameters and buffers."""

    def __init__(self, hidden: int, weights: frozenset[int] = frozenset()):
        seen: dict[tuple, tuple] = {}  # one forward's copies, so a tensor saved twice is copied once

        def pack(t: torch.Tensor) -> Any:
            size = t.numel() * t.element_size()
            if (t.device.type not in DEVICE_TYPES or t.dim() < 2 or t.shape[-1] != hidden or not t.is_floating_point()
                    or size < MIN_BYTES or not t.is_contiguous() or (t.is_leaf and t.requires_grad)
                    or t.untyped_storage().data_ptr() in weights):
                return t
            key = (t.data_ptr(), t._version, t.dtype, tuple(t.shape))
            if key in seen and seen[key][0]() is t:  # alive, so its memory cannot have been reused
                return seen[key][1]
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            host.copy_(t, non_blocking=True)
            LAST["tensors"] += 1
            LAST["bytes"] += size
            seen[key] = (weakref.ref(t), (host, t.device))
            return host, t.device

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            host, device = packed
            return host.to(device, non_blocking=True)

        super().__init__(pack, unpack)


def offload_layer_inputs(model: Any, wanted: bool, checkpointing: bool) -> str:
    """Wrap the decoder stack's forward (the module holding `layers`) of `model` so that, while
    training with grad, the tensors its checkpointed layers keep go to pinned host memory.

    `wanted`: use_unsloth_gc (JobConfig refuses it with fsdp as the config loads). Returns the
    ledger's line (measured() adds what moved); raises ValueError for a model without `layers`."""
    if not wanted:
        return "off"
    if not checkpointing:
        return "off (gradient checkpointing is off: no layer inputs are kept to move)"
    device = next(model.parameters()).device.type
    if device not in DEVICE_TYPES:
        return f"off (the layers run on the {device.upper()}: their inputs are in host memory already)"
    stack = next((m for m in model.modules() if isinstance(getattr(m, "layers", None), torch.nn.ModuleList)), None)
    if stack is None:
        raise ValueError("use_unsloth_gc: no decoder layers (a `layers` ModuleList) found")
    hidden = int(model.config.hidden_size)
    # after grouping and compiling (model.load_model wraps last), so the laid-out weights are these
    weights = frozenset(t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers()))
    forward = stack.forward

    def offloaded(*args: Any, **kwargs: Any) -> Any:
        if not (stack.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        LAST.update(tensors=0, bytes=0)
        with OffloadLayerInputs(hidden, weights):
            return forward(*args, **kwargs)

    stack.forward = offloaded
    return (f"on (the inputs of {len(stack.layers)} checkpointed layers and the final norm moved to pinned host "
            "memory until backward, and back; the GPU waits for the copies)")


def measured() -> str:
    """What the last training forward of this process moved, for the ledger's line: "" before one."""
    if not LAST["tensors"]:
        return ""
    return f"; the last micro-batch moved {LAST['tensors']} tensors, {LAST['bytes'] / 2**20:,.0f} MiB (pinned host memory per rank)"
