"""Grouped LoRA projections (grouped.py) compute what the fused projections compute, one by one:
the same loss and gradients (dense fp32 to rounding; NF4 within the fused path's own tolerance),
compiled as eager, with the adapter's tensors and names unchanged. bench/h200_levers.sh runs this
file on the GPU too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tuneledger import compiled, fused_lora, grouped
from tuneledger.config_load import load_config

import test_speed as speed_tests  # its loss-and-gradient helpers (tests/ is on the path)
from test_nf4_kernel import stand_in_nested
from test_speed import IDS, _worst

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
NF4_TOL = 3e-2  # as test_speed's: bf16 compute rounds in another order; a wrong term is of order 1


def _has_bnb() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return False
    return True


def _model(tiny_model, group: bool, quant: bool = False, dropout: float = 0.0):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    torch.manual_seed(0)
    kw: dict = {"dtype": torch.float32}
    if quant:
        kw = {"dtype": torch.bfloat16, "device_map": {"": DEVICE}, "quantization_config": BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)}
    m = AutoModelForCausalLM.from_pretrained(tiny_model, **kw)
    m.config.use_cache = False
    m = get_peft_model(m, LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules="all-linear",
                                     task_type="CAUSAL_LM"))
    torch.manual_seed(1)
    for n, p in m.named_parameters():
        if "lora_B" in n:  # peft starts B at zero, which would hide a wrong B gradient
            p.data.normal_(0, 0.05)
    assert fused_lora.fuse_lora(m, True).startswith("on")
    if group:
        assert grouped.group_lora(m, True, True, dropout).startswith("on (")
    return m


def _grads(m):
    return speed_tests._grads(m, IDS)


def test_grouped_equals_the_fused_projections(tiny_model, monkeypatch):
    """q/k/v (with Qwen2's biases) and gate/up grouped: loss and every LoRA gradient as the fused
    projections give them one by one, and the adapter's names and values unchanged. Every group
    runs as one (no member falls back to its own projection)."""
    plain, grp = _model(tiny_model, False), _model(tiny_model, True)
    assert plain.state_dict().keys() == grp.state_dict().keys()
    l0, g0 = _grads(plain)
    calls = {"group": 0, "alone": 0}
    apply, alone = grouped.GroupedLoraProjection.apply, grouped._fused_forward

    def count(key, fn):
        def wrapped(*a, **k):
            calls[key] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(grouped.GroupedLoraProjection, "apply", count("group", apply))
    monkeypatch.setattr(grouped, "_fused_forward", count("alone", alone))
    l1, g1 = _grads(grp)
    assert calls == {"group": 2 * grp.config.num_hidden_layers, "alone": 0}
    assert abs(l0 - l1) < 1e-5 * abs(l0), (l0, l1)
    rel, name = _worst(g0, g1)
    assert rel < 1e-4, (name, rel)
    g = grp.base_model.model.model.layers[0].self_attn.q_proj._tuneledger_group
    assert g.x is None and g.pending == [None, None, None]  # nothing kept after the group's last member


def test_grouped_with_lora_added_in_place_equals_out_of_place(tiny_model, monkeypatch):
    """In place (fused_lora.add_product, the default) in the groups' forward and backward: the
    same loss and gradients as out of place, TUNELEDGER_ADDMM=copy (eager; the compiled op:
    tests/test_speed.py)."""
    from tuneledger import fused_lora

    monkeypatch.setattr(fused_lora, "ADDMM_INPLACE", False)
    l0, g0 = _grads(_model(tiny_model, True))
    monkeypatch.setattr(fused_lora, "ADDMM_INPLACE", True)
    l1, g1 = _grads(_model(tiny_model, True))
    assert abs(l0 - l1) < 1e-6 * abs(l0), (l0, l1)
    rel, name = _worst(g0, g1)
    assert rel < 1e-5, (name, rel)


@pytest.mark.skipif(not _has_bnb(), reason="needs bitsandbytes")
def test_grouped_nf4_equals_the_fused_projections(tiny_model):
    """The same over NF4 bases (double quantization, bf16 compute): each member dequantized with
    its own quant state."""
    (l0, g0), (l1, g1) = _grads(_model(tiny_model, False, True)), _grads(_model(tiny_model, True, True))
    assert abs(l0 - l1) < 1e-2 * abs(l0), (l0, l1)
    rel, name = _worst(g0, g1)
    assert rel < NF4_TOL, (name, rel)


def _group_of(m, layer: int = 0, attr: str = "q_proj"):
    layer = m.base_model.model.model.layers[layer]
    mod = getattr(layer.self_attn, attr, None) or getattr(layer.mlp, attr)
    return mod._tuneledger_group


def _views_of_one_tensor(g) -> bool:
    start = g.w.untyped_storage().data_ptr()
    return (sum(m.get_base_layer().weight.numel() for m in g.members) == g.w.numel()
            and all(m.get_base_layer().weight.untyped_storage().data_ptr() == start for m in g.members))


def test_groups_lay_their_weights_out_as_one_tensor(tiny_model):
    """Each group's base weights become views of one tensor (no copy kept), so a group reads its
    base without concatenating per call; q/k/v and gate/up both."""
    before = _model(tiny_model, False)  # the same seed: the same base weights, not grouped
    m = _model(tiny_model, True)
    for attr in ("q_proj", "gate_proj"):
        g = _group_of(m, attr=attr)
        assert g.w is not None and g.layout is None and _views_of_one_tensor(g), attr
        layer = before.base_model.model.model.layers[0]
        names = g.names
        mods = [getattr(layer.self_attn if n.endswith(("q_proj", "k_proj", "v_proj")) else layer.mlp, n) for n in names]
        assert torch.equal(g.w, torch.cat([x.get_base_layer().weight for x in mods]))


@pytest.mark.skipif(not _has_bnb(), reason="needs bitsandbytes")
@pytest.mark.parametrize("once", [False, True], ids=["double-quant", "absmax_once"])
def test_laid_out_nf4_groups_compute_what_the_per_call_concatenation_did(tiny_model, monkeypatch, once):
    """NF4: one dequantization of the laid-out weights gives the same bf16 weight as each member's
    own, bit for bit, so the loss and gradients equal the per-call concatenation's exactly; under
    absmax_once the fp32 scales are laid out too."""
    from tuneledger import nf4

    def build(layout: bool):
        if not layout:
            monkeypatch.setattr(grouped, "lay_out", lambda members: (None, None, None))
        orig = fused_lora.fuse_lora
        if once:  # model.py applies absmax_once before grouping
            monkeypatch.setattr(fused_lora, "fuse_lora", lambda mm, w: (nf4.absmax_once(mm, True), orig(mm, w))[1])
        m = _model(tiny_model, True, True)
        monkeypatch.undo()
        return m

    laid, per_call = build(True), build(False)
    g = _group_of(laid, attr="gate_proj")
    assert g.layout is not None and _views_of_one_tensor(g)
    assert (g.absmax is not None) == once
    assert _group_of(per_call).w is None
    (l0, g0), (l1, g1) = _grads(per_call), _grads(laid)
    assert l0 == l1
    assert all(torch.equal(g0[k], g1[k]) for k in g0), [k for k in g0 if not torch.equal(g0[k], g1[k])][:3]


@pytest.mark.skipif(not _has_bnb(), reason="needs bitsandbytes")
@pytest.mark.parametrize("once", [False, True], ids=["double-quant", "absmax_once"])
def test_a_laid_out_group_dequantized_in_torch_ops_is_bitsandbytes_weight(tiny_model, monkeypatch, once):
    """Inside a compiled layer with TUNELEDGER_DEQUANT=graph the laid-out weights go through
    dequantize_in_graph as one tensor: the same bf16 weight as bitsandbytes' op, bit for bit."""
    from tuneledger import nf4

    m = _model(tiny_model, False, True)
    if once:
        nf4.absmax_once(m, True)
    fused_lora.fuse_lora(m, True)
    grouped.group_lora(m, True, True, 0.0)
    g = _group_of(m, attr="gate_proj")
    name = g.members[0].active_adapters[0]
    flat, metas = [], []
    for mem in g.members:
        *ins, meta = fused_lora.base_weight_inputs(mem.get_base_layer())
        flat += [mem.lora_A[name].weight, mem.lora_B[name].weight, *ins]
        metas.append(meta)
    members = grouped._members(tuple(flat), len(metas))
    want = grouped._base(members, tuple(metas), g.w, g.absmax, g.layout)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setenv("TUNELEDGER_DEQUANT", "graph")
    calls = []
    in_graph = fused_lora.dequantize_in_graph
    monkeypatch.setattr(fused_lora, "dequantize_in_graph", lambda *a: calls.append(a[0].shape) or in_graph(*a))
    got = grouped._base(members, tuple(metas), g.w, g.absmax, g.layout)
    assert calls == [g.w.shape]  # one call, on the whole laid-out tensor
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.fixture(scope="module")
def nested_model(tmp_path_factory) -> Path:
    """A random Qwen2 whose q/k/v and gate/up weights are whole numbers of double quantization's
    nested blocks (256 x 64 weights): hidden 256, k/v 128, intermediate 128 (the tiny model's are not)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=256, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1024, max_position_embeddings=256)
    out = tmp_path_factory.mktemp("models") / "nested"
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    return out


@pytest.mark.skipif(not _has_bnb(), reason="needs bitsandbytes")
def test_double_quantized_groups_lay_out_their_8bit_scales_for_the_nf4_kernel(nested_model, monkeypatch):
    """Without absmax_once, a group whose members are whole nested blocks lays out the 8-bit scales,
    their fp32 scales (views, as the weights) and one offset per nested block, and the NF4 kernel
    rebuilds the scales in the one dequantization of the group: the loss and gradients equal the
    per-member path's (each member's scales rebuilt by bitsandbytes and concatenated) exactly. On
    CPU the kernel is stood in by bitsandbytes' ops; on a GPU it runs."""
    from tuneledger import nf4_kernel

    nf4_kernel.use(False, quantized=True)
    per_member = _model(nested_model, True, True)
    assert _group_of(per_member).absmax2 is not None  # laid out, but the kernel is off: per member
    l0, g0 = _grads(per_member)
    calls: list = []
    if CUDA:  # the kernel itself, counted
        real = nf4_kernel.dequantize_nested

        def counted(*a):
            calls.append((tuple(a[8]), a[4].numel()))
            return real(*a)
        monkeypatch.setattr(nf4_kernel, "dequantize_nested", counted)
    else:
        monkeypatch.setattr(nf4_kernel, "dequantize_nested", stand_in_nested(calls))
        monkeypatch.setattr(nf4_kernel, "dequantize", lambda w, a, c, bs, shape, dt:
                            torch.ops.bitsandbytes.dequantize_4bit(w, a, bs, "nf4", shape, dt))
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets applies() take CPU tensors
        monkeypatch.setattr(nf4_kernel, "why_not", lambda: None)
        monkeypatch.setattr(nf4_kernel, "self_check", lambda nested=False: None)
    assert nf4_kernel.use(None, quantized=True).endswith("double quantization's scales in the same kernel)")
    try:
        m = _model(nested_model, True, True)
        for attr, k in (("q_proj", 3), ("gate_proj", 2)):
            g = _group_of(m, attr=attr)
            qss = [mem.get_base_layer().weight.quant_state for mem in g.members]
            assert g.absmax.dtype == torch.uint8 and g.layout[1] == 256 and len(qss) == k
            assert all(q.absmax.untyped_storage().data_ptr() == g.absmax.untyped_storage().data_ptr() for q in qss)
            assert all(q.state2.absmax.untyped_storage().data_ptr() == g.absmax2.untyped_storage().data_ptr() for q in qss)
            want = torch.cat([q.offset.reshape(1).expand(q.state2.absmax.numel()) for q in qss])
            assert torch.equal(g.offset, want) and len(set(g.offset.tolist())) == k  # each member's own
        l1, g1 = _grads(m)
    finally:
        nf4_kernel.use(False, quantized=True)
    # forward and backward: q/k/v and gate/up once each, an offset per nested block; o and down
    # (not grouped) with their one offset
    assert sorted(set(calls)) == [((256, 128), 1), ((256, 256), 1), ((256, 256), 4), ((512, 256), 8)], sorted(set(calls))
    assert len(calls) == 8 * len(m.base_model.model.model.layers), calls
    assert l1 == l0
    assert all(torch.equal(g0[k], g1[k]) for k in g0), [k for k in g0 if not torch.equal(g0[k], g1[k])][:3]


def test_a_group_that_cannot_be_laid_out_concatenates_per_call_and_says_so(tiny_model):
    """A member weight that is not contiguous cannot be a view of one tensor: that group keeps the
    per-call concatenation, with the same results, and the levers line counts it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def build(group: bool):
        torch.manual_seed(0)
        m = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.data.normal_(0, 0.05)
        up = m.base_model.model.model.layers[0].mlp.up_proj.get_base_layer().weight
        up.data = up.data.t().contiguous().t()  # the same values, column-major
        fused_lora.fuse_lora(m, True)
        return m, (grouped.group_lora(m, True, True, 0.0) if group else None)

    (plain, _), (grp, line) = build(False), build(True)
    assert line.endswith("; 1 concatenate their weights per call)"), line
    assert _group_of(grp, attr="gate_proj").w is None and _group_of(grp, 1, "gate_proj").w is not None
    (l0, g0), (l1, g1) = _grads(plain), _grads(grp)
    assert abs(l0 - l1) < 1e-5 * abs(l0)
    rel, name = _worst(g0, g1)
    assert rel < 1e-4, (name, rel)


def test_a_weight_replaced_after_grouping_is_laid_out_again_before_the_forward(tiny_model):
    """A group computes from its laid-out tensor: a member weight replaced after grouping (a
    device move: transformers' Trainer does one) must not leave the group computing with the old
    one. The next forward lays that group out again, from the weights the members hold now."""
    grp, plain = _model(tiny_model, True), _model(tiny_model, False)
    for m in (grp, plain):
        w = m.base_model.model.model.layers[1].mlp.up_proj.get_base_layer().weight
        w.data = w.data.clone() * 2  # new storage and new values
    g = _group_of(grp, 1, "gate_proj")
    assert grouped.stale_layouts([g]) == ["gate_proj/up_proj"]
    with torch.no_grad():
        assert torch.allclose(grp(input_ids=IDS).logits, plain(input_ids=IDS).logits, atol=1e-5)
    assert grouped.stale_layouts([g]) == [] and _views_of_one_tensor(g)
    # q/k/v carry Qwen2's biases: a re-layout takes them from the members too, and generate() (which
    # peft sends to the causal LM, past its own forward) checks the layout as well.
    for m in (grp, plain):
        attn = m.base_model.model.model.layers[0].self_attn
        attn.v_proj.get_base_layer().bias.data = attn.v_proj.get_base_layer().bias.data.clone() + 1
        attn.v_proj.get_base_layer().weight.data = attn.v_proj.get_base_layer().weight.data.clone()
    kw = {"input_ids": IDS[:1, :8], "max_new_tokens": 3, "do_sample": False, "output_logits": True,
          "return_dict_in_generate": True}
    with torch.no_grad():
        a, b = grp.generate(**kw), plain.generate(**kw)
    assert torch.equal(a.sequences, b.sequences) and grouped.stale_layouts([_group_of(grp)]) == []
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a.logits, b.logits))


def test_grouped_under_eager_checkpointing_recomputes_the_group(tiny_model):
    """transformers' checkpointing (eager: presets A and B where compile is off) runs the layer's
    forward again in backward: the group computes again, with the same gradients."""
    def build(group: bool):
        m = _model(tiny_model, group)
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return m

    (l0, g0), (l1, g1) = _grads(build(False)), _grads(build(True))
    assert abs(l0 - l1) < 1e-5 * abs(l0), (l0, l1)
    rel, name = _worst(g0, g1)
    assert rel < 1e-4, (name, rel)


def test_a_member_called_alone_computes_its_own_projection(tiny_model):
    """k_proj on another input than the one q_proj computed from, or before q_proj: its own output."""
    grp, plain = _model(tiny_model, True), _model(tiny_model, False)
    attn_g, attn_p = grp.base_model.model.model.layers[0].self_attn, plain.base_model.model.model.layers[0].self_attn
    x, other = torch.randn(1, 5, attn_g.q_proj.in_features), torch.randn(1, 5, attn_g.q_proj.in_features)
    with torch.no_grad():
        assert torch.allclose(attn_g.k_proj(x), attn_p.k_proj(x), atol=1e-5)  # before q_proj
        assert torch.allclose(attn_g.q_proj(x), attn_p.q_proj(x), atol=1e-5)
        assert torch.allclose(attn_g.k_proj(other), attn_p.k_proj(other), atol=1e-5)  # another input
        assert torch.allclose(attn_g.v_proj(x), attn_p.v_proj(x), atol=1e-5)  # the kept one


def test_v_gets_a_tensor_of_its_own_and_a_broken_sequence_keeps_nothing(tiny_model):
    """Attention saves v as it comes: a view of the group's output would keep q and k alive until
    backward. A member called in another grad mode than the group's computes its own, and the
    kept state is dropped."""
    grp = _model(tiny_model, True)
    attn = grp.base_model.model.model.layers[0].self_attn
    x = torch.randn(1, 5, attn.q_proj.in_features)
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    assert k.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()  # a view, rotary copies it
    assert v.untyped_storage().data_ptr() != q.untyped_storage().data_ptr() and v.is_contiguous()
    with torch.no_grad():
        attn.q_proj(x)
    k = attn.k_proj(x)  # with grad, after a q_proj without
    g = attn.q_proj._tuneledger_group
    assert k.requires_grad and g.x is None and g.pending == [None, None, None]


def test_the_levers_line_names_the_groups_made_and_a_target_without_one_is_refused(tiny_model):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def lora(targets):
        m = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM"))
        fused_lora.fuse_lora(m, True)
        return m

    m = lora(["q_proj", "v_proj", "gate_proj", "up_proj"])
    layers = m.config.num_hidden_layers
    assert grouped.group_lora(m, True, True, 0.0) == f"on ({layers} groups of {2 * layers} projections: gate/up)"
    with pytest.raises(ValueError, match="lora_target must cover q_proj, k_proj and v_proj, or gate_proj and up_proj"):
        grouped.group_lora(lora(["q_proj", "v_proj"]), True, True, 0.0)


def test_checkpointing_inside_compiled_layers_rules_out_the_preset_before_any_rank(tmp_path):
    """Presets A and B with compile on are refused per preset, before their ranks start; C and D run."""
    from tuneledger.config import ConfigError
    from tuneledger.dryrun import plan

    items = [str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"), "model_name_or_path=m",
             "grouped_lora=true", "lora_dropout=0", "torch_compile=true", f"output_dir={tmp_path}"]
    planned = dict(plan(items, ["A", "B", "C", "D"], 1, "cuda"))
    for name in ("A", "B"):
        assert isinstance(planned[name], ConfigError) and str(planned[name]).startswith(
            f"preset {name}: grouped_lora: true cannot run with gradient checkpointing inside compiled layers"), planned[name]
    assert not isinstance(planned["C"], ConfigError) and not isinstance(planned["D"], ConfigError)
    # Compile off (not left to auto, which is on where a GPU compiles): nothing rules A or B out.
    uncompiled = items[:-2] + ["torch_compile=false", f"output_dir={tmp_path}"]
    assert not any(isinstance(c, ConfigError) for c in dict(plan(uncompiled, ["A", "B"], 1, "cuda")).values())


def test_grouped_lora_is_refused_where_it_would_change_the_result(tiny_model):
    """true where it cannot apply is refused, naming why; unset (None) is off there, with the same why."""
    with pytest.raises(ValueError, match="grouped_lora: true needs lora_dropout 0"):
        _model(tiny_model, True, dropout=0.05)
    assert grouped.group_lora(_model(tiny_model, False), None, True, 0.05) == "off (needs lora_dropout 0)"
    assert grouped.group_lora(_model(tiny_model, False), None, False, 0.0) == "off (needs the fused LoRA projection)"
    assert (grouped.group_lora(_model(tiny_model, False), None, True, 0.0, compiled_checkpoint=True)
            == "off (gradient checkpointing inside compiled layers)")
    with pytest.raises(ValueError, match="needs the fused LoRA projection"):
        grouped.group_lora(_model(tiny_model, False), True, False, 0.0)
    assert grouped.group_lora(_model(tiny_model, False), False, True, 0.0) == "off"
    with pytest.raises(ValueError, match="gradient checkpointing inside compiled layers"):
        grouped.group_lora(_model(tiny_model, False), True, True, 0.0, compiled_checkpoint=True)
    m = _model(tiny_model, False)
    m.base_model.model.model.layers[0].self_attn.k_proj.get_base_layer().bias.requires_grad_(True)
    with pytest.raises(ValueError, match="a base bias is trained"):
        grouped.group_lora(m, True, True, 0.0)
    assert grouped.group_lora(m, None, True, 0.0).startswith("off (a base bias is trained")


def test_the_ledger_names_grouped_lora_on_where_it_applies_and_off_where_asked(tiny_model):
    from tuneledger.config import ConfigError
    from tuneledger.model import PreflightError, load_model

    base = {"model_name_or_path": str(tiny_model), "dataset": ["x.json"], "lora_rank": 4, "lora_dropout": 0}
    model, info = load_model(load_config(None, base), "cpu")  # unset: on where it applies
    layers = model.config.num_hidden_layers
    assert info["levers"]["grouped_lora"] == f"on ({2 * layers} groups of {5 * layers} projections: q/k/v and gate/up)"
    assert load_model(load_config(None, {**base, "grouped_lora": False}), "cpu")[1]["levers"]["grouped_lora"] == "off"
    assert (load_model(load_config(None, {**base, "lora_dropout": 0.1}), "cpu")[1]["levers"]["grouped_lora"]
            == "off (needs lora_dropout 0)")
    model, info = load_model(load_config(None, {**base, "grouped_lora": True}), "cpu")
    assert info["levers"]["grouped_lora"] == f"on ({2 * layers} groups of {5 * layers} projections: q/k/v and gate/up)"
    with pytest.raises(ConfigError, match="grouped_lora: true needs lora_dropout 0 \\(it is 0.1\\)"):
        load_config(None, {**base, "grouped_lora": True, "lora_dropout": 0.1})  # bad input: refused as it loads
    # and the model's own guard, for a config built around the validation (model_copy does not validate)
    with pytest.raises(PreflightError, match="grouped_lora: true needs lora_dropout 0"):
        load_model(load_config(None, {**base, "grouped_lora": True}).model_copy(update={"lora_dropout": 0.1}), "cpu")


@pytest.mark.slow
def test_compiled_grouped_layers_have_eager_gradients_and_no_graph_break(tiny_model):
    """The group keeps its members' outputs on a Python object between calls; traced by dynamo,
    that must stay inside the layer's graph (no graph break the ungrouped compiled layer does not
    have: torch 2.5.1 breaks both on a Mapping check of transformers'), add no compile per layer
    (each layer's group is another object: a guard on it would recompile 28 times) and give
    eager's gradients."""
    from torch import _dynamo
    from torch._dynamo.utils import counters

    def compiled_run(group: bool):
        _dynamo.reset()
        counters.clear()
        m = _model(tiny_model, group)
        compiled.compile_layers(m, True, DEVICE, fused=True, quantized=False)
        out = _grads(m)
        return out, (dict(counters["graph_break"]), counters["stats"]["unique_graphs"])

    l0, g0 = _grads(_model(tiny_model, True))
    _, ungrouped_breaks = compiled_run(False)
    (l1, g1), breaks = compiled_run(True)
    _dynamo.reset()
    assert breaks == ungrouped_breaks, (breaks, ungrouped_breaks)
    assert abs(l0 - l1) < 1e-5 * abs(l0), (l0, l1)
    rel, name = _worst(g0, g1)
    assert rel < 1e-4, (name, rel)


@pytest.mark.parametrize("wanted", [None, False])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dropout", [0.0, 0.05])
@pytest.mark.parametrize("compiled_checkpoint", [False, True])
def test_planned_says_what_group_lora_will_try(wanted, fused, dropout, compiled_checkpoint):
    """grouped.planned (model.py's absmax_once default reads it before grouping) agrees with
    group_lora's own checks: where it is False group_lora says "off" without the model; where it
    is True group_lora goes on to the model (None here: it fails reading it)."""
    args = (wanted, fused, dropout, compiled_checkpoint)
    if grouped.planned(*args):
        with pytest.raises(AttributeError):
            grouped.group_lora(None, *args)
    else:
        assert grouped.group_lora(None, *args).startswith("off")
