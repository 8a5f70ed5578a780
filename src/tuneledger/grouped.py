"""Grouped LoRA projections (`grouped_lora`): the projections that read one input, q/k/v of the
attention and gate/up of the MLP, run as one fused projection each (GroupedLoraProjection), so a
layer launches fewer kernels. Why: presets A-C on an H200 are host-bound (preset C: 41,129 kernel
launches per step, the GPU idle 63% of it; bench/results/h200-2026-12-01-session3/call2/prof),
and of a decoder layer's ~184 launches per micro-batch 58 are matmuls (aten::mm and addmm), three
per projection forward and five backward. Grouped, q/k/v take one matmul where they took three for
the base, the LoRA A and the LoRA B, forward and backward; x's three input gradients are one.

transformers calls q_proj, k_proj and v_proj one after another on the same hidden states. The
group's first projection computes all of them and keeps the others' outputs for the calls that
follow with that same tensor (`x is` the one it computed from) in the same grad mode; a call with
any other input, or out of order, computes its own (LoraProjection) and drops what was kept. So
the result is the projection's own unless x or the weights change in place between the group's
calls, which the decoder layers' forward never does.

The members' frozen base weights are laid out side by side once, at grouping (lay_out): one
tensor holds them all, each member's weight becomes a view of its rows, so a group dequantizes
its base in one call ([sum out, in]) and never concatenates weights per micro-batch. Per call
concatenation cost 116 ms of a 1.70 s preset C step on an H100 (448 `cat` kernels and 1,810
device-to-device copies; bench/results/h100-2026-12-06b-call2). 4-bit weights can be laid out
where every member's size is a whole number of quantization blocks (their scales then follow
one another too); otherwise the group concatenates per call, as before.

Exactness: the same arithmetic as LoraProjection per member, in bigger matmuls (a block-diagonal
LoRA B), so bf16 results differ by rounding only. Dropout is not grouped: the group would draw one
mask where peft draws one per projection (another random stream), so grouping needs lora_dropout 0.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F

from tuneledger.fused_lora import (_dequantize, _fused_forward, add_product, base_weight_inputs, kernel_rebuilds_scales,
                                  plain_absmax)
from tuneledger.speed import GROUPED_NEEDS_NO_COMPILED_CHECKPOINT

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# Members whose output gets a tensor of its own: attention saves v as it comes (no rotary, no
# repeat_kv copy where the kernel handles grouped heads), and a view would keep the whole [T, q+k+v]
# output alive until backward (found in review on CPU: +T x (q+k) x 2 B per layer).
OWN_COPY = {"v_proj"}
PER_MEMBER = 8  # A, B, then base_weight_inputs' six tensors (w, absmax, absmax2, code2, offset, code)


def _members(flat: tuple, k: int) -> list[tuple]:
    return [flat[PER_MEMBER * i:PER_MEMBER * (i + 1)] for i in range(k)]


def _base(members: list[tuple], metas: tuple, gw: torch.Tensor | None, gabsmax: torch.Tensor | None,
          layout: tuple | None, gabsmax2: torch.Tensor | None = None, goffset: torch.Tensor | None = None) -> torch.Tensor:
    """The group's base weight [sum out, in] in its compute dtype. `gw`: the laid-out weights
    (lay_out), the members' own being views of it; `layout`: None (dense, or no layout: dequantize
    each member and concatenate) or the 4-bit meta of the whole, (blocksize, blocksize2 or 0,
    quant_type, (sum out, in), dtype); `gabsmax`: the laid-out scales: fp32, or under double
    quantization the 8-bit codes with `gabsmax2` (their fp32 scales) and `goffset` (each member's
    offset, one per nested block), which the NF4 kernel reads as they are (kernel_rebuilds_scales);
    else (None, or the kernel off) each member's are rebuilt as _dequantize does and concatenated
    (1/64 of the weights' elements)."""
    if gw is None:
        return torch.cat([_dequantize(m[2], *m[3:8], metas[i]) for i, m in enumerate(members)])
    if layout is None:
        return gw
    if gabsmax is not None and gabsmax2 is None:
        return _dequantize(gw, gabsmax, None, None, None, members[0][7], layout)
    if gabsmax is not None and kernel_rebuilds_scales(gw, layout, goffset):
        return _dequantize(gw, gabsmax, gabsmax2, members[0][5], goffset, members[0][7], layout)
    absmax = torch.cat([m[3].float() if m[4] is None else plain_absmax(*m[3:7], metas[i][1])
                        for i, m in enumerate(members)])
    return _dequantize(gw, absmax, None, None, None, members[0][7], (layout[0], 0, *layout[2:]))


def _weights(members: list[tuple], metas: tuple, gw: torch.Tensor | None = None, gabsmax: torch.Tensor | None = None,
             layout: tuple | None = None, dt: torch.dtype | None = None, gabsmax2: torch.Tensor | None = None,
             goffset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The group's base weight [sum out, in] (dequantized: _base), LoRA A [k r, in] and block-diagonal
    LoRA B [sum out, k r], in the compute dtype (the base's, or `dt`)."""
    wd = _base(members, metas, gw, gabsmax, layout, gabsmax2, goffset)
    dt = wd.dtype if dt is None else dt
    r, k = members[0][0].shape[0], len(members)
    A = torch.cat([m[0] for m in members]).to(dt)
    B = torch.cat([F.pad(m[1], (i * r, (k - 1 - i) * r)) for i, m in enumerate(members)]).to(dt)
    return wd.to(dt), A, B


class GroupedLoraProjection(torch.autograd.Function):
    """Y = x W^T + b + s (x A^T) B^T for k LoRA projections of one input, one matmul per term.

    Shapes: x [T, in]; member i: A_i [r, in], B_i [out_i, r], W_i [out_i, in] (dense or 4-bit);
    bias: the members' frozen biases in one [sum out] (zeros where one has none) or None.
    W = cat(W_i) [sum out, in], A = cat(A_i) [k r, in], B = block_diag(B_i)
    [sum out, k r]: Y [T, sum out] is cat(y_i) of LoraProjection's y_i (no dropout). Backward:
    dx = dY W + s (dY B) A, dA = s (dY B)^T x split per member, dB_i = s dY_i^T (x A_i^T); W is
    dequantized again rather than kept, as LoraProjection does. Saved: x and x A^T [T, k r].
    gw, gabsmax, gabsmax2, goffset, layout: the laid-out base weights, scales and their meta
    (_base), or None."""

    @staticmethod
    def forward(ctx, x, bias, scale, metas, outs, gw, gabsmax, gabsmax2, goffset, layout, *flat):
        members = _members(flat, len(metas))
        wd, A, B = _weights(members, metas, gw, gabsmax, layout, None, gabsmax2, goffset)
        dt = wd.dtype
        x = x.to(dt)
        if bias is not None:
            y = torch.addmm(bias.to(dt), x, wd.t())
        else:
            y = x @ wd.t()
        a = x @ A.t()
        y = add_product(y, a, B.t(), scale)
        ctx.save_for_backward(x, a, gw, gabsmax, gabsmax2, goffset, *flat)
        ctx.metas, ctx.outs, ctx.scale, ctx.layout = metas, outs, scale, layout
        return y

    @staticmethod
    def backward(ctx, dy):
        x, a, gw, gabsmax, gabsmax2, goffset, *flat = ctx.saved_tensors
        k, s, dt = len(ctx.metas), ctx.scale, x.dtype
        members = _members(tuple(flat), k)
        wd, A, B = _weights(members, ctx.metas, gw, gabsmax, ctx.layout, dt, gabsmax2, goffset)
        dy = dy.to(dt)
        dyb = dy @ B
        dx = add_product((dyb @ A).mul_(s), dy, wd)
        r = A.shape[0] // k
        dA = (dyb.t() @ x).mul_(s)  # [k r, in]
        dB = (dy.t() @ a).mul_(s)  # [sum out, k r]: only the diagonal blocks are B's gradients
        grads: list[Any] = []
        off = 0
        for i, (m, o) in enumerate(zip(members, ctx.outs)):
            grads += [dA[i * r:(i + 1) * r].to(m[0].dtype), dB[off:off + o, i * r:(i + 1) * r].to(m[1].dtype)]
            grads += [None] * (PER_MEMBER - 2)
            off += o
        return (dx, None, None, None, None, None, None, None, None, None, *grads)


class _Group:
    """The projections of one input (q/k/v or gate/up) and the outputs its first one computed
    for the others: `x` the input they came from, `pending[i]` member i's output until it is asked.
    `bias`: the members' frozen biases concatenated once here (a cat per micro-batch saved), or None."""

    def __init__(self, members: tuple, names: tuple) -> None:
        self.members, self.names = members, names
        self.grad = False  # the grad mode the kept outputs were made in
        self.x: torch.Tensor | None = None
        self.pending: list[torch.Tensor | None] = [None] * len(members)
        self.lay_out()

    def lay_out(self) -> None:
        """(Again) the laid-out weights and scales (lay_out) and the concatenated frozen biases,
        from what the members hold now."""
        biases = [getattr(m.get_base_layer(), "bias", None) for m in self.members]
        self.bias = None
        if any(b is not None for b in biases):
            ref = next(b for b in biases if b is not None)
            self.bias = torch.cat([b.detach() if b is not None else ref.new_zeros(m.get_base_layer().out_features)
                                   for b, m in zip(biases, self.members)])
        self.w, scales, self.layout = lay_out(self.members)
        # fp32 scales, or double quantization's (8-bit codes, their fp32 scales, offsets): lay_out
        self.absmax, self.absmax2, self.offset = scales if isinstance(scales, tuple) else (scales, None, None)


def layout_blocker(bases: list) -> str | None:
    """Why the base weights of `bases` (one group's, in order) cannot be laid out as one tensor, or None."""
    ws = [b.weight for b in bases]
    qss = [getattr(w, "quant_state", None) for w in ws]
    if any(q is None for q in qss) != all(q is None for q in qss):
        return "dense and 4-bit members"
    if len({w.dtype for w in ws}) != 1 or len({w.device for w in ws}) != 1 or not all(w.is_contiguous() for w in ws):
        return "the weights' dtype, device or layout differ"
    if qss[0] is None:
        return None if len({w.shape[1:] for w in ws}) == 1 and ws[0].dim() == 2 else "the weights' shapes differ"
    if len({(q.blocksize, q.quant_type, q.dtype, q.shape[1]) for q in qss}) != 1:
        return "the members' quantization differs"
    if any((q.shape[0] * q.shape[1]) % q.blocksize or (q.shape[0] * q.shape[1]) % 2 for q in qss):
        return "a weight is not a whole number of quantization blocks"
    return None


def lay_out(members: tuple) -> tuple[torch.Tensor | None, torch.Tensor | tuple | None, tuple | None]:
    """Lay the members' frozen base weights out as one tensor, each member's weight a view of its
    part (in place: no copy kept, no memory added once the old storages are freed); plain fp32
    4-bit scales (no double quantization, or absmax_once) likewise, and double quantization's
    where nested_blocker allows (the 8-bit codes and their fp32 scales as views, plus each
    member's offset once per nested block: 4 B per 16,384 weights). Returns (the weights, the
    scales: fp32, (codes, scales, offsets), or None, the 4-bit meta of the whole for _base:
    (blocksize, blocksize2 or 0, quant_type, (sum out, in), dtype), None for dense), or
    (None, None, None) where layout_blocker says no."""
    bases = [m.get_base_layer() for m in members]
    if layout_blocker(bases):
        return None, None, None
    ws = [b.weight for b in bases]
    # Not inference tensors, should a re-layout happen under inference_mode: training reads them later.
    with torch.no_grad(), torch.inference_mode(False):
        whole = torch.cat([w.data for w in ws])
        for w, part in zip(ws, whole.split([w.shape[0] for w in ws])):
            w.data = part
    qs = getattr(ws[0], "quant_state", None)
    if qs is None:
        return whole, None, None
    rows = sum(w.quant_state.shape[0] for w in ws)
    scales: Any = None
    blocksize2 = 0
    qss = [w.quant_state for w in ws]
    with torch.no_grad(), torch.inference_mode(False):
        if not any(q.nested for q in qss):
            scales = torch.cat([q.absmax.float() for q in qss])
            for q, part in zip(qss, scales.split([q.absmax.numel() for q in qss])):
                q.absmax = part
        elif not nested_blocker(qss):
            blocksize2 = qss[0].state2.blocksize
            codes, scales2 = torch.cat([q.absmax for q in qss]), torch.cat([q.state2.absmax for q in qss])
            for q, part, part2 in zip(qss, codes.split([q.absmax.numel() for q in qss]),
                                      scales2.split([q.state2.absmax.numel() for q in qss])):
                q.absmax, q.state2.absmax = part, part2
            offsets = torch.cat([q.offset.float().reshape(1).expand(q.state2.absmax.numel()) for q in qss])
            scales = (codes, scales2, offsets)
    return whole, scales, (qs.blocksize, blocksize2, qs.quant_type, (rows, qs.shape[1]), qs.dtype)


def nested_blocker(qss: list) -> str | None:
    """Why the double-quantized scales of these quant states (one group's, all nested) cannot be
    laid out as one, or None: each member must be a whole number of nested blocks, so that its
    scales' scales follow one another too, with one nested code table and fp32 offset tensors."""
    q0 = qss[0]
    if not all(q.nested and q.state2 is not None for q in qss):
        return "some members are double-quantized, some not"
    if any(q.state2.blocksize != q0.state2.blocksize or q.absmax.numel() % q.state2.blocksize for q in qss):
        return "a weight is not a whole number of nested quantization blocks"
    if any(not isinstance(q.offset, torch.Tensor) or q.offset.numel() != 1 or q.absmax.dtype != torch.uint8
           or not torch.equal(q.state2.code, q0.state2.code) for q in qss):
        return "the members' double quantization differs"
    return None


def stale_layouts(groups: list) -> list[str]:
    """The groups (_Group) whose members' base weights are no longer views of the group's laid-out
    tensor (something replaced them after grouping: a device move, a re-quantization), by their
    projections' names. Such a group would compute with the old weights until laid out again."""
    out = []
    for g in groups:
        if g.w is None:
            continue
        start = g.w.data_ptr()
        end = start + g.w.numel() * g.w.element_size()
        if any(not start <= m.get_base_layer().weight.data_ptr() < end for m in g.members):
            out.append("/".join(g.names))
    return out


def layout_check(groups: list):
    """A forward pre-hook for the model: a group whose members' weights were replaced since they
    were laid out (stale_layouts: transformers' Trainer moves the model with `.to(device)`, which
    on CPU gave the parameters new storage) is laid out again from the weights the members hold
    now, so a group never computes with old ones. A few hundred pointer reads per micro-batch on
    the host; the new layout once, where it happened."""
    def check(module: Any, args: tuple) -> None:
        if stale_layouts(groups):
            for g in groups:
                if g.w is not None and stale_layouts([g]):
                    g.lay_out()
    return check


def _grouped_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    g, i = self._tuneledger_group, self._tuneledger_index
    shape = x.shape
    if i > 0:
        out = g.pending[i]
        if out is None or g.x is not x or g.grad != torch.is_grad_enabled():  # alone, or out of order
            g.x, g.pending = None, [None] * len(g.members)
            return _fused_forward(self, x)
        g.pending[i] = None
        if all(p is None for p in g.pending):
            g.x = None
        return out
    name = self.active_adapters[0]
    flat: list[Any] = []
    metas, outs = [], []
    for m in g.members:
        base = m.get_base_layer()
        w, absmax, absmax2, code2, offset, code, meta = base_weight_inputs(base)
        flat += [m.lora_A[name].weight, m.lora_B[name].weight, w, absmax, absmax2, code2, offset, code]
        metas.append(meta)
        outs.append(m.lora_B[name].weight.shape[0])
    y = GroupedLoraProjection.apply(x.reshape(-1, shape[-1]), g.bias, self.scaling[name], tuple(metas), tuple(outs),
                                    g.w, g.absmax, g.absmax2, g.offset, g.layout, *flat)
    parts = [p.reshape(*shape[:-1], p.shape[-1]) for p in y.split(outs, dim=-1)]
    parts = [p.contiguous() if n in OWN_COPY else p for p, n in zip(parts, g.names)]
    g.x, g.grad = x, torch.is_grad_enabled()
    g.pending = [None] + parts[1:]
    return parts[0]


def group_blocker(members: tuple, lora_dropout: float) -> str | None:
    """Why these LoRA layers (already fused: fused_lora.fuse_lora) cannot run as one group, or None."""
    if lora_dropout:
        return "lora_dropout > 0 (a group would draw one dropout mask where peft draws one per projection)"
    names = {m.active_adapters[0] for m in members}
    if len(names) != 1:
        return "the projections' active adapters differ"
    name = names.pop()
    if len({m.scaling[name] for m in members}) != 1 or len({m.lora_A[name].weight.shape for m in members}) != 1:
        return "the projections' LoRA rank or scale differ"
    if any(getattr(getattr(m.get_base_layer(), "bias", None), "requires_grad", False) for m in members):
        return "a base bias is trained (the group keeps one frozen copy of the biases)"
    if len({type(m.get_base_layer()).__name__ for m in members}) != 1:
        return "the projections' base layers differ (dense and 4-bit)"
    return None


def _settings_blocker(fused: bool, lora_dropout: float, compiled_checkpoint: bool) -> tuple[str, str] | None:
    """What keeps the projections apart by the settings alone, before the model is looked at: (the
    ledger's line where grouped_lora is unset, the error where it is true); None when nothing does."""
    for blocks, why in ((not fused, "needs the fused LoRA projection (fused_lora unset or true)"),
                        (lora_dropout, "needs lora_dropout 0 (a group would draw one dropout mask where peft draws one per projection)")):
        if blocks:
            return f"off ({why.split(' (')[0]})", f"grouped_lora: true {why}"
    if compiled_checkpoint:
        return "off (gradient checkpointing inside compiled layers)", GROUPED_NEEDS_NO_COMPILED_CHECKPOINT
    return None


def planned(wanted: bool | None, fused: bool, lora_dropout: float, compiled_checkpoint: bool = False) -> bool:
    """Whether group_lora, given the same arguments, will try to group (it may still find no
    group, or a group that cannot be): the checks it makes before looking at the model."""
    return wanted is not False and _settings_blocker(fused, lora_dropout, compiled_checkpoint) is None


def group_lora(model: Any, wanted: bool | None, fused: bool, lora_dropout: float, compiled_checkpoint: bool = False) -> str:
    """Run each decoder layer's q/k/v and gate/up LoRA projections as one GroupedLoraProjection
    each. `wanted`: the config's grouped_lora (None: where it applies); `fused`: whether
    fused_lora.fuse_lora is on (the group stands in for the fused projection);
    `compiled_checkpoint`: whether gradient checkpointing will run inside compiled layers
    (compiled.checkpoint_inside). Returns the ledger's line, "off (why)" where None cannot apply;
    raises ValueError when True cannot apply (fused_lora off, lora_dropout > 0, checkpointing
    inside compiled layers, mismatched projections)."""
    if wanted is False:
        return "off"
    if blocked := _settings_blocker(fused, lora_dropout, compiled_checkpoint):
        if wanted:
            raise ValueError(blocked[1])
        return blocked[0]
    from peft.tuners.lora import LoraLayer

    groups = []
    for parent in model.modules():
        for names in GROUPS:
            members = tuple(getattr(parent, n, None) for n in names)
            if all(isinstance(m, LoraLayer) for m in members):
                why = group_blocker(members, lora_dropout)
                if why:
                    if wanted:
                        raise ValueError(f"grouped_lora: true cannot apply: {why}. Set grouped_lora=false")
                    return f"off ({why})"
                groups.append((members, names))
    if not groups:
        if not wanted:
            return "off (no q/k/v or gate/up with LoRA on all its projections)"
        raise ValueError("grouped_lora: true, but no group has LoRA on all its projections: lora_target must cover "
                         "q_proj, k_proj and v_proj, or gate_proj and up_proj. Set grouped_lora=false")
    made = []
    for members, names in groups:
        g = _Group(members, names)
        made.append(g)
        for i, m in enumerate(members):
            # Plain attributes, not submodules: a module holding its siblings would loop named_modules()
            object.__setattr__(m, "_tuneledger_group", g)
            object.__setattr__(m, "_tuneledger_index", i)
            m.forward = types.MethodType(_grouped_forward, m)
    laid = sum(g.w is not None for g in made)
    if laid:
        # On the causal LM under peft's wrapper: its forward and generate() both call it, eagerly
        # (regional compilation compiles the decoder layers only).
        target = model.get_base_model() if hasattr(model, "get_base_model") else model
        target.register_forward_pre_hook(layout_check(made))
    kinds = sorted({"/".join(n.split("_")[0] for n in names) for _, names in groups}, reverse=True)
    n = sum(len(m) for m, _ in groups)
    tail = "" if laid == len(groups) else f"; {len(groups) - laid} concatenate their weights per call"
    return f"on ({len(groups)} groups of {n} projections: {' and '.join(kinds)}{tail})"
