"""TUNELEDGER_GUARDS (make bench's *dicttags and *noguard rows, an A/B): TorchDynamo's guards on the
compiled layers, cheaper by recursive dict tags (dict-tags) or dropped for module attributes
(skip-modules, unsafe). The knobs exist in torch >= 2.6 only, and the compiled layers run on a GPU:
here the settings reach torch.compile and the ledger's line; the device call runs the GPU test, a
compiled model with each knob against eager, training and evaluation interleaved."""

from __future__ import annotations

import types

import pytest
import torch

from tuneledger import compiled


@pytest.fixture(autouse=True)
def _no_graphs_yet(monkeypatch):
    monkeypatch.setattr(compiled, "_GRAPHS", [False])


def _layers(n=3):
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(n)])
    return model


def _asked(monkeypatch):
    asked = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: asked.append(kw) or fn)  # Module.compile calls it
    # a stand-in for torch._dynamo.config (torch 2.5's has no use_recursive_dict_tags_for_guards)
    monkeypatch.setattr(torch._dynamo, "config", types.SimpleNamespace(optimize_ddp=True,
                                                                      use_recursive_dict_tags_for_guards=False))
    return asked


def test_without_the_variable_the_compile_is_as_before(monkeypatch):
    asked = _asked(monkeypatch)
    line = compiled.compile_layers(_layers(), True, "cuda", fused=True, quantized=False)
    assert [(kw.get("mode"), kw.get("options")) for kw in asked] == [(None, None)] * 3
    assert "guards" not in line and not torch._dynamo.config.use_recursive_dict_tags_for_guards


def test_dict_tags_sets_dynamos_config_and_says_so(monkeypatch):
    asked = _asked(monkeypatch)
    monkeypatch.setenv("TUNELEDGER_GUARDS", "dict-tags")
    line = compiled.compile_layers(_layers(), True, "cuda", fused=True, quantized=False)
    assert torch._dynamo.config.use_recursive_dict_tags_for_guards is True
    assert [kw.get("options") for kw in asked] == [None] * 3
    assert line.endswith(", guards by recursive dict tags (TUNELEDGER_GUARDS=dict-tags))"), line


def test_skip_modules_passes_the_guard_filter_and_keeps_cuda_graphs_as_an_option(monkeypatch):
    asked = _asked(monkeypatch)
    skip = lambda entries: [True] * len(entries)  # noqa: E731 (torch's filter: one bool per guard)
    monkeypatch.setattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", skip, raising=False)
    monkeypatch.setenv("TUNELEDGER_GUARDS", "skip-modules")
    line = compiled.compile_layers(_layers(), True, "cuda", fused=True, quantized=False)
    assert [kw.get("options") for kw in asked] == [{"guard_filter_fn": skip}] * 3
    assert "no guards on module attributes (TUNELEDGER_GUARDS=skip-modules, unsafe)" in line
    # torch.compile takes a mode or options, not both: reduce-overhead becomes its inductor option
    monkeypatch.setenv("TUNELEDGER_CUDAGRAPHS", "1")
    asked.clear()
    line = compiled.compile_layers(_layers(), True, "cuda", fused=True, quantized=False)
    assert [(kw.get("mode"), kw.get("options")) for kw in asked] == [
        (None, {"guard_filter_fn": skip, "triton.cudagraphs": True})] * 3
    assert "CUDA graphs" in line and compiled.cudagraphs_on()


def test_a_torch_without_the_knobs_changes_nothing_and_says_so(monkeypatch):
    monkeypatch.delattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", raising=False)
    bare = types.SimpleNamespace()  # a dynamo config without use_recursive_dict_tags_for_guards (torch < 2.6)
    for lever, words in (("dict-tags", "has no such config"), ("skip-modules", "has no guard filters")):
        monkeypatch.setenv("TUNELEDGER_GUARDS", lever)
        options, clause = compiled.guard_options(bare)
        assert options is None and f"TUNELEDGER_GUARDS={lever}: no effect" in clause and words in clause
    assert not vars(bare)


@pytest.mark.parametrize("lever", ["dict-tags", "skip-modules"])
def test_compiled_layers_with_fewer_guards_train_and_evaluate_as_eager(tiny_model, tmp_path, monkeypatch, lever):
    """On the GPU: two accumulated micro-batches' gradients as eager's (dropout off), then with
    attention dropout on, an evaluation between training calls gives eager's loss: the evaluation
    ran its own graph (grad mode told it apart), not the training one with dropout."""
    if not torch.cuda.is_available():
        pytest.skip("compiled layers run on a GPU here (the device call runs this)")
    if not hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):
        pytest.skip(f"torch {torch.__version__} has no guard filters")
    from transformers import AutoModelForCausalLM

    ids = torch.randint(10, 1000, (2, 24), generator=torch.Generator().manual_seed(3)).cuda()

    def model(env, dropout):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="eager",
                                                 attention_dropout=dropout).cuda()
        if env:
            monkeypatch.setenv("TUNELEDGER_GUARDS", env)
            compiled.compile_layers(m, True, "cuda", fused=False, quantized=False)
            monkeypatch.delenv("TUNELEDGER_GUARDS")
        return m

    def grads(m):
        m.train()
        for _ in range(3):  # the first calls compile; the third step runs the cached graphs
            m.zero_grad()
            for half in (ids[:1], ids[1:]):
                m(input_ids=half, labels=half).loss.backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    eager, fewer = grads(model(None, 0.0)), grads(model(lever, 0.0))
    for n in eager:
        torch.testing.assert_close(fewer[n], eager[n], rtol=2e-3, atol=2e-5, msg=n)

    def evaluate(m):
        m.eval()
        with torch.no_grad():
            return m(input_ids=ids, labels=ids).loss.item()

    ref = evaluate(model(None, 0.5))
    m = model(lever, 0.5)
    m.train()
    m(input_ids=ids, labels=ids).loss.backward()  # the training graph first, dropout on
    assert evaluate(m) == pytest.approx(ref, rel=1e-4)
    m.train()
    a, b = (m(input_ids=ids, labels=ids).loss.item() for _ in range(2))
    assert a != b  # back in training: dropout draws again
