"""`use_unsloth_gc` (LLaMA-Factory's key): gradient checkpointing whose kept layer inputs wait in
pinned host memory instead of GPU memory, as Unsloth's and LLaMA-Factory's "unsloth" checkpointing do.

Why: with checkpointing, what stays on the GPU between a layer's forward and its backward is the
layer's input, [micro-batch, T, hidden] bf16 per decoder layer: 28 x 2 x 1,000 x 3,584 x 2 bytes,
about 0.4 GB, at preset B's micro-batch 2 of 1,000-token rows on Qwen2.5-7B. Measured on one H200
(bench/results/h200-2026-12-07-call2): B moved 333 MiB a micro-batch and ran in 8.2 GiB against
Unsloth's 8.3, 1.08x Unsloth's tokens/s, but at 0.68x of B without it (8.6 GiB) in one call
(bench/results/h200-2026-12-07-call1).

How: a saved-tensor hook (torch.autograd.graph.saved_tensors_hooks) around the decoder stack's
forward copies each [.., T, hidden] floating tensor that autograd keeps (1 MiB or more, contiguous,
on a CUDA GPU) into pinned host memory without a host sync, and back when backward unpacks it.
Both copies are queued on the compute stream: the GPU block is reused only by later work on that
stream, after the copy (the GPU waits for the copies; they are not overlapped), as Unsloth's
default does. TUNELEDGER_OFFLOAD=stream (an A/B; its GPU tests pass, its speed is not settled:
bench/results/h100-2026-12-07c-call1) moves them beside the
compute: each copy to host on a side stream that first waits for the compute stream's work so
far, its source kept alive until the copy is done (at most INFLIGHT at once, else the compute
stream waits for the oldest, and none past the forward); in backward, handing a
tensor out starts the copy back of the one saved before it on a second side stream (after the
compute stream's earlier users of its new block and after its copy to host), which the compute
stream waits for only when that tensor is needed: at most one layer input more on the GPU. With every layer
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


class CudaStreams:
    """The stream operations of the streamed copies (OffloadLayerInputs(streams=...)), one object
    so that a test can stand in for CUDA and check the order of the copies on a CPU."""

    def __init__(self):
        self._side: dict = {}

    def current(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def side(self, device: torch.device, kind: str) -> Any:
        """One side stream per device and direction ("d2h", "h2d"), made on first use."""
        key = (kind, device.index)
        if key not in self._side:
            self._side[key] = torch.cuda.Stream(device=device)
        return self._side[key]

    def wait_for(self, on: Any, after: tuple) -> None:
        """Stream `on` waits for each stream or event of `after`."""
        for w in after:
            on.wait_stream(w) if isinstance(w, torch.cuda.Stream) else on.wait_event(w)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, on: Any, after: tuple = ()) -> Any:
        """dst.copy_(src) queued on stream `on` once `on` has waited for each stream or event of
        `after`; returns an event recorded after the copy."""
        self.wait_for(on, after)
        with torch.cuda.stream(on):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(on)
        return done

    def done(self, event: Any) -> bool:
        return event.query()  # no host sync

    def keep_for(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)  # t's block is not reused before `stream`'s work queued at its free is done

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)


INFLIGHT = 2  # copies to host whose GPU source is kept alive at once; more wait (bounded GPU memory)


class _Record:
    """One offloaded tensor of a streamed forward: its pinned host copy and the event after that
    copy; in backward, a device copy prefetched (with the event after it and the stream it was
    allocated on) until it is handed out, and the one handed out while the tensor's other saves
    (a tensor saved twice) are still to be unpacked."""
    __slots__ = ("host", "device", "copied", "index", "saves", "unpacks", "handed", "out", "prefetched", "ready",
                 "alloc", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, copied: Any, index: int):
        self.host, self.device, self.copied, self.index = host, device, copied, index
        self.saves, self.unpacks, self.handed = 1, 0, False
        self.out = self.prefetched = self.ready = self.alloc = None


class OffloadLayerInputs(torch.autograd.graph.saved_tensors_hooks):
    """Saved [.., T, `hidden`] floating tensors of 1 MiB or more go to pinned host memory for backward;
    `weights`: the storage addresses (untyped_storage().data_ptr()) of tensors to leave in place,
    the model's parameters and buffers. `streams` (a CudaStreams; TUNELEDGER_OFFLOAD=stream): the
    copies run on side streams, beside the compute (module doc), and backward's unpack of a tensor
    starts the copy back of the one saved before it."""

    def __init__(self, hidden: int, weights: frozenset[int] = frozenset(), streams: CudaStreams | None = None):
        seen: dict[tuple, tuple] = {}  # one forward's copies, so a tensor saved twice is copied once
        order: list = []  # streamed records, weakly, in the order saved (backward unpacks them in reverse)
        inflight: list = []  # (GPU source, its copy's event, the compute stream): kept alive until copied

        def retire(keep: int) -> None:
            # A source is let go once its copy is done, or after the compute stream waits for the
            # copy: later work on that stream, which may reuse its block, then comes after it.
            while inflight and (len(inflight) > keep or streams.done(inflight[0][1])):
                _, event, compute = inflight.pop(0)
                if not streams.done(event):
                    streams.wait(compute, event)

        def pack(t: torch.Tensor) -> Any:
            size = t.numel() * t.element_size()
            if (t.device.type not in DEVICE_TYPES or t.dim() < 2 or t.shape[-1] != hidden or not t.is_floating_point()
                    or size < MIN_BYTES or not t.is_contiguous() or (t.is_leaf and t.requires_grad)
                    or t.untyped_storage().data_ptr() in weights):
                return t
            key = (t.data_ptr(), t._version, t.dtype, tuple(t.shape))
            if key in seen and seen[key][0]() is t:  # alive, so its memory cannot have been reused
                packed = seen[key][1]
                if isinstance(packed, _Record):
                    packed.saves += 1
                return packed
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            if streams is not None:
                compute, side = streams.current(t.device), streams.side(t.device, "d2h")
                copied = streams.copy(host, t, side, after=(compute,))  # after the kernels that wrote t
                inflight.append((t, copied, compute))
                retire(INFLIGHT)
                packed = _Record(host, t.device, copied, len(order))
                order.append(weakref.ref(packed))
            else:
                host.copy_(t, non_blocking=True)
                packed = (host, t.device)
            LAST["tensors"] += 1
            LAST["bytes"] += size
            seen[key] = (weakref.ref(t), packed)
            return packed

        def prefetch(i: int) -> None:
            rec = order[i]() if i >= 0 else None
            if rec is None or rec.handed or rec.prefetched is not None:
                return
            compute, side = streams.current(rec.device), streams.side(rec.device, "h2d")
            x = torch.empty(rec.host.shape, dtype=rec.host.dtype, device=rec.device)
            # after compute's earlier users of x's block, and after the copy to host
            rec.ready = streams.copy(x, rec.host, side, after=(compute, rec.copied))
            streams.keep_for(x, side)  # were it never handed out, its block still waits for the copy
            rec.prefetched, rec.alloc = x, compute

        def fetch(rec: _Record) -> torch.Tensor:
            compute = streams.current(rec.device)
            if rec.prefetched is not None:
                x, ready, alloc = rec.prefetched, rec.ready, rec.alloc
                rec.prefetched = rec.ready = rec.alloc = None
                streams.wait(compute, ready)
                if compute != alloc:  # used on another stream than it was allocated on: its free waits for that one
                    streams.keep_for(x, compute)
                return x
            # the first tensor backward needs (or a retain_graph rerun): copied back on the compute stream
            x = torch.empty(rec.host.shape, dtype=rec.host.dtype, device=rec.device)
            streams.copy(x, rec.host, compute, after=(rec.copied,))
            return x

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            if isinstance(packed, tuple):
                host, device = packed
                return host.to(device, non_blocking=True)
            rec = packed
            x = rec.out  # a tensor saved twice: the copy its first unpack made
            if x is None:
                x = fetch(rec)
                rec.handed = True
                prefetch(rec.index - 1)  # its copy back runs while this tensor's layer computes backward
            rec.unpacks += 1
            rec.out = x if rec.unpacks < rec.saves else None
            rec.unpacks %= rec.saves
            return x

        self._retire = retire
        super().__init__(pack, unpack)

    def __exit__(self, *args: Any) -> None:
        self._retire(0)  # the forward is done: no source outlives it on the GPU (the peak comes after, at the loss)
        super().__exit__(*args)


def streamed() -> bool:
    """Whether TUNELEDGER_OFFLOAD=stream asks for the side-stream copies (make bench's *ugcstream rows)."""
    from tuneledger import env_levers

    return env_levers.value("TUNELEDGER_OFFLOAD") == "stream"


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
    streams = CudaStreams() if streamed() else None  # the device is a CUDA GPU here (DEVICE_TYPES)

    def offloaded(*args: Any, **kwargs: Any) -> Any:
        if not (stack.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        LAST.update(tensors=0, bytes=0)
        with OffloadLayerInputs(hidden, weights, streams):
            return forward(*args, **kwargs)

    stack.forward = offloaded
    how = ("on side streams beside the compute, each copied back while the layer after it computes backward "
           "(TUNELEDGER_OFFLOAD=stream)" if streams else "the GPU waits for the copies")
    return (f"on (the inputs of {len(stack.layers)} checkpointed layers and the final norm moved to pinned host "
            f"memory until backward, and back; {how})")


def measured() -> str:
    """What the last training forward of this process moved, for the ledger's line: "" before one."""
    if not LAST["tensors"]:
        return ""
    return f"; the last micro-batch moved {LAST['tensors']} tensors, {LAST['bytes'] / 2**20:,.0f} MiB (pinned host memory per rank)"
