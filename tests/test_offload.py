"""use_unsloth_gc (offload.py): checkpointed layers' inputs wait in host memory until backward.
On CPU the same hook runs with "cpu" added to offload.DEVICE_TYPES (a copy to host memory, not
pinned): the same loss and gradients as plain checkpointing, eager and compiled (checkpoint
inside), exactly what was expected moved, and no layer input left alive on the device between
forward and backward. On a GPU (bench/h200_levers.sh's GPU tests): the same over NF4, and the
memory held between forward and backward lower by the layer inputs."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tuneledger import compiled, offload, versions
from tuneledger.config_load import load_config

from test_grouped import DEVICE, _has_bnb
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
        from torch._dynamo.utils import counters

        _dynamo.reset()
        counters.clear()  # compile_stats() then counts this model's graphs, not an earlier test's
        compiled.compile_layers(m, True, next(m.parameters()).device.type, fused=True, quantized=quant, checkpoint=True)
    else:  # as model.load_model checkpoints: non-reentrant
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.enable_input_require_grads()
    line = offload.offload_layer_inputs(m, unsloth_gc, checkpointing=True)
    assert line.startswith(f"on (the inputs of {m.config.num_hidden_layers} checkpointed layers") == unsloth_gc, line
    return m


def _kept_layer_inputs(m, ids=IDS) -> int:
    """How many decoder layers' input tensors after the first are still alive after a training
    forward (before backward): the ones autograd keeps on the device. The first is the
    embedding's output, a leaf that autograd keeps anyway."""
    refs = []
    hooks = [layer.register_forward_pre_hook(lambda mod, args, kw: refs.append(weakref.ref(
        kw.get("hidden_states", args[0] if args else None))), with_kwargs=True)
        for layer in m.base_model.model.model.layers]
    m.train()
    ids = ids.to(next(m.parameters()).device)  # the model's own: on a GPU host the unquantized tiny model stays on the CPU
    out = m(input_ids=ids, labels=ids)
    for h in hooks:
        h.remove()
    assert len(refs) == len(hooks), (len(refs), len(hooks))  # each layer's input was seen: 0 below means none kept
    gc.collect()
    alive = sum(1 for r in refs[1:] if r() is not None)
    out.loss.backward()
    return alive


def test_checkpointed_layers_keep_no_input_on_the_device_and_give_the_same_gradients(tiny_model, on_this_device):
    """Non-reentrant checkpointing under the hook: the same loss and gradients, bit for bit (the
    values make a round trip through host memory); moved: every layer input but the first (a leaf
    autograd keeps) and the final norm's input once (it is saved twice); none left alive."""
    n = _fused_model(tiny_model, False).config.num_hidden_layers
    l0, g0 = _grads(_checkpointed(tiny_model, False), IDS)
    l1, g1 = _grads(_checkpointed(tiny_model, True), IDS)
    assert offload.LAST["tensors"] == (n - 1) + 1, offload.LAST
    assert offload.LAST["bytes"] == n * IDS.numel() * 64 * 4, offload.LAST  # fp32 [2, 64, hidden 64]
    assert l0 == l1, (l0, l1)
    assert all(torch.equal(g0[k], g1[k]) for k in g0)
    assert _kept_layer_inputs(_checkpointed(tiny_model, False)) == n - 1  # saved on the device
    assert _kept_layer_inputs(_checkpointed(tiny_model, True)) == 0
    assert offload.measured().startswith(f"; the last micro-batch moved {n} tensors")


def test_evaluation_and_no_grad_pass_the_hook_by(tiny_model, on_this_device, monkeypatch):
    """Evaluation (eval mode, with or without grad) and a no-grad forward in train mode move nothing."""
    m = _checkpointed(tiny_model, True)
    for training, grad in ((False, False), (False, True), (True, False)):
        monkeypatch.setitem(offload.LAST, "tensors", -1)
        m.train(training)
        with torch.set_grad_enabled(grad):
            m(input_ids=IDS.to(next(m.parameters()).device))
        assert offload.LAST["tensors"] == -1, (training, grad, offload.LAST)


def test_the_model_weights_stay_where_they_are(on_this_device):
    """A compiled layer saves a frozen weight it needs in backward as is (its graph saves the
    weight, not eager's transposed view of it): a [out, hidden] bf16 weight passes every other test, and
    would be copied to host memory and back at every micro-batch for nothing. The activation saved
    beside it (x saved twice by x * x: once) moves."""
    hidden = 64
    w = torch.nn.Parameter(torch.randn(hidden, hidden), requires_grad=False)
    x = torch.randn(2, 8, hidden, requires_grad=True) * 1.0  # not a leaf: a layer's input

    def forward():
        return (x @ w).sum() + (x * x).sum()  # mm saves w itself (x's gradient needs it), as a compiled graph does

    offload.LAST.update(tensors=0, bytes=0)
    with offload.OffloadLayerInputs(hidden, frozenset({w.untyped_storage().data_ptr()})):
        y = forward()
    assert offload.LAST == {"tensors": 1, "bytes": x.numel() * 4}, offload.LAST  # x, not w
    y.backward()
    offload.LAST.update(tensors=0, bytes=0)
    with offload.OffloadLayerInputs(hidden):  # without the weights' addresses the weight moves too
        forward()
    assert offload.LAST == {"tensors": 2, "bytes": x.numel() * 4 + w.numel() * 4}, offload.LAST


class StandInStreams:
    """offload.CudaStreams on a CPU: each copy runs at once into its own tensor, no copy is ever
    done early (done() is False: the in-flight cap and the forward's end retire them), and every
    stream operation is logged with the stream's name ("compute", "d2h", "h2d") and the events as
    ("d2h"|"h2d"|"compute", n)."""

    def __init__(self):
        self.log: list = []
        self.events = 0

    def current(self, device):
        return "compute"

    def side(self, device, kind):
        return kind

    def copy(self, dst, src, on, after=()):
        dst.copy_(src)
        self.events += 1
        self.log.append(("copy", on, tuple(after), (on, self.events)))
        return on, self.events

    def done(self, event):
        return False

    def keep_for(self, t, stream):
        self.log.append(("keep", stream))

    def wait(self, stream, event):
        self.log.append(("wait", stream, event))


def test_streamed_copies_keep_the_gradients_and_copy_each_input_back_ahead_of_its_backward(tiny_model, on_this_device,
                                                                                          monkeypatch):
    """TUNELEDGER_OFFLOAD=stream: the same loss and gradients bit for bit, the same tensors moved.
    Forward: each copy to host on the d2h stream after the compute stream's work so far; the
    compute stream waits for each copy before its source is let go (past offload.INFLIGHT at once,
    here 0, and every one by the forward's end). Backward: the first tensor it needs is copied back on the
    compute stream after its copy to host, each later one on the h2d stream (after the compute
    stream and its copy to host), started when the tensor saved after it is handed out and waited
    for before use; a tensor saved twice (the final norm's input) is copied back once."""
    m0 = _checkpointed(tiny_model, True)
    l0, g0 = _grads(m0, IDS)
    plain = dict(offload.LAST)
    fake = StandInStreams()
    monkeypatch.setenv("TUNELEDGER_OFFLOAD", "stream")
    monkeypatch.setattr(offload, "CudaStreams", lambda: fake)
    monkeypatch.setattr(offload, "INFLIGHT", 0)  # every copy waited for at once: the cap's path, seen in order
    m = _checkpointed(tiny_model, True)
    assert "on side streams" in offload.offload_layer_inputs(_fused_model(tiny_model, False), True, checkpointing=True)
    m.train()
    torch.manual_seed(7)
    loss = m(input_ids=IDS, labels=IDS).loss
    forward = len(fake.log)
    loss.backward()
    g1 = {k: p.grad.detach().float().clone() for k, p in m.named_parameters() if p.requires_grad}
    assert offload.LAST == plain, (offload.LAST, plain)
    assert loss.item() == l0 and all(torch.equal(g0[k], g1[k]) for k in g0)

    n = plain["tensors"]
    fwd, bwd = fake.log[:forward], fake.log[forward:]
    d2h = [e for e in fwd if e[0] == "copy"]
    assert len(d2h) == n and all(e[1] == "d2h" and e[2] == ("compute",) for e in d2h), fwd
    waited = [e[2] for e in fwd if e[0] == "wait"]
    assert waited == [e[3] for e in d2h] and all(e[1] == "compute" for e in fwd if e[0] == "wait"), fwd  # each, in order
    assert all(fwd.index(("wait", "compute", e[3])) == fwd.index(e) + 1 for e in d2h), fwd  # the cap, right after each
    back = [e for e in bwd if e[0] == "copy"]
    assert len(back) == n, bwd  # one each: the tensor saved twice is copied back once
    assert back[0][1] == "compute" and back[0][2] == (d2h[-1][3],), back  # the last saved, needed first
    assert all(e[1] == "h2d" and e[2] == ("compute", d[3]) for e, d in zip(back[1:], reversed(d2h[:-1]))), back
    for e in back[1:]:  # each prefetch is waited for, after it was queued
        assert bwd.index(("wait", "compute", e[3])) > bwd.index(e)
    assert ("keep", "h2d") in bwd
    assert _kept_layer_inputs(_checkpointed(tiny_model, True)) == 0


def test_streamed_sources_under_the_cap_are_let_go_by_the_forwards_end(tiny_model, on_this_device, monkeypatch):
    """Within offload.INFLIGHT the compute stream waits for no copy during the forward; leaving
    the hooks (the decoder stack's end) waits for each copy still in flight, in order."""
    fake = StandInStreams()
    monkeypatch.setenv("TUNELEDGER_OFFLOAD", "stream")
    monkeypatch.setattr(offload, "CudaStreams", lambda: fake)
    m = _checkpointed(tiny_model, True)
    m.train()
    m(input_ids=IDS, labels=IDS)
    n = offload.LAST["tensors"]
    assert 0 < n <= offload.INFLIGHT, n  # the tiny model's two layers: under the cap
    copies = [e[3] for e in fake.log if e[0] == "copy"]
    assert fake.log[n:] == [("wait", "compute", c) for c in copies], fake.log  # all copies first, then the waits


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="on a GPU host the GPU test runs the compiled case (inductor's CPU compile here "
                    "took over 100 s of a device call)")
def test_compiled_layers_with_the_checkpoint_inside_move_their_inputs(tiny_model, on_this_device):
    """Compiled layers (checkpoint inside): torch applies the ambient hook to what the compiled
    function saves, its inputs; the gradients are those of the same compiled layers without it."""
    l0, g0 = _grads(_checkpointed(tiny_model, False, compile_layers=True), IDS)
    m = _checkpointed(tiny_model, True, compile_layers=True)
    l1, g1 = _grads(m, IDS)
    if not compiled.compile_stats().get("graphs"):
        assert not versions.torch_at_least(compiled.COMPILE_MIN_TORCH), compiled.compile_stats()
        pytest.skip(f"torch {torch.__version__}: dynamo compiled no layer graph here (graph breaks in transformers' "
                    "attention lookup); the compiled path is measured from torch 2.9 (compiled.COMPILE_MIN_TORCH)")
    n = m.config.num_hidden_layers
    assert offload.LAST["tensors"] == n, offload.LAST  # layers 2..n's inputs and the final norm's, no weight
    assert abs(l0 - l1) <= 1e-6 * abs(l0), (l0, l1)
    rel, name = _worst(g0, g1)
    assert rel < 1e-6, (name, rel)
    assert _kept_layer_inputs(m) == 0


class SlowSideStreams(offload.CudaStreams):
    """Real streams whose side-stream copies start late (torch.cuda._sleep after their waits): a
    missing wait on either side then reads or overwrites the wrong bytes, not just sometimes."""

    def copy(self, dst, src, on, after=()):
        if on == torch.cuda.current_stream(dst.device if dst.is_cuda else src.device):
            return super().copy(dst, src, on, after)
        self.wait_for(on, after)
        with torch.cuda.stream(on):
            torch.cuda._sleep(1 << 22)  # a few ms at GPU clocks
        return super().copy(dst, src, on)


@pytest.mark.skipif(not (CUDA and _has_bnb()), reason="needs a CUDA GPU and bitsandbytes")
@pytest.mark.parametrize("streamed", [False, True, "slow"], ids=["compute-stream", "side-streams", "slow-side-streams"])
@pytest.mark.parametrize("compile_layers", [False, True], ids=["eager", "compiled"])
def test_on_a_gpu_over_nf4_the_same_gradients_and_the_inputs_off_the_gpu(tiny_model, compile_layers, streamed,
                                                                          monkeypatch):
    """With the shipped thresholds (CUDA only, 1 MiB): rows long enough that each layer input is
    1 MiB or more. The same loss (forward values are untouched) and gradients within 1e-3 (SDPA's
    backward may add in another order between runs); the memory held between forward and backward
    lower by at least the layer inputs after the first."""
    ids = torch.randint(0, 1000, (8, 2048), generator=torch.Generator().manual_seed(3))
    if streamed:  # TUNELEDGER_OFFLOAD=stream: the copies on side streams, real CUDA events and waits
        monkeypatch.setenv("TUNELEDGER_OFFLOAD", "stream")
    if streamed == "slow":
        monkeypatch.setattr(offload, "CudaStreams", SlowSideStreams)

    def run(unsloth_gc: bool):
        m = _checkpointed(tiny_model, unsloth_gc, quant=True, compile_layers=compile_layers)
        _grads(m, ids)  # compile and warm up
        m.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = m(input_ids=ids.to(DEVICE), labels=ids.to(DEVICE))
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        out.loss.backward()
        torch.cuda.synchronize()
        return out.loss.item(), {k: p.grad.detach().float().clone() for k, p in m.named_parameters() if p.requires_grad}, held

    l0, g0, held0 = run(False)
    l1, g1, held1 = run(True)
    if compile_layers and not compiled.compile_stats().get("graphs"):
        pytest.skip(f"torch {torch.__version__}: dynamo compiled no layer graph here; the eager case ran this path")
    n, hidden = _fused_model(tiny_model, False).config.num_hidden_layers, 64
    layer_input = ids.numel() * hidden * 2  # bf16
    assert offload.LAST["tensors"] >= n - 1 and offload.LAST["bytes"] >= (n - 1) * layer_input, offload.LAST
    assert l0 == l1, (l0, l1)
    rel, name = _worst(g0, g1)
    assert rel < 1e-3, (name, rel)
    assert held0 - held1 >= (n - 1) * layer_input, (held0, held1, layer_input)


def test_the_key_loads_refuses_fsdp_and_says_when_it_has_nothing_to_do(tiny_model, monkeypatch):
    from tuneledger.config import ConfigError
    from tuneledger.model import load_model

    base = {"model_name_or_path": str(tiny_model), "dataset": ["x.json"], "lora_rank": 4}
    assert load_model(load_config(None, base), "cpu")[1]["levers"]["use_unsloth_gc"] == "off"
    assert load_model(load_config(None, {**base, "use_unsloth_gc": True}), "cpu")[1]["levers"]["use_unsloth_gc"] == \
        "off (the layers run on the CPU: their inputs are in host memory already)"
    monkeypatch.setattr(offload, "DEVICE_TYPES", ("cuda", "cpu"))
    model, info = load_model(load_config(None, {**base, "use_unsloth_gc": True}), "cpu")
    assert info["levers"]["use_unsloth_gc"].startswith(f"on (the inputs of {model.config.num_hidden_layers} checkpointed layers")
    assert load_model(load_config(None, {**base, "use_unsloth_gc": True, "gradient_checkpointing": False}), "cpu")[1][
        "levers"]["use_unsloth_gc"].startswith("off (gradient checkpointing is off")
    with pytest.raises(ConfigError, match="use_unsloth_gc: true is not supported with fsdp"):
        load_config(None, {**base, "use_unsloth_gc": True, "fsdp": "full_shard auto_wrap"})
