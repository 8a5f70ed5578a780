"""TUNELEDGER_CUDAGRAPHS=1 (make bench's *cgraph rows, an A/B): compiled layers in torch.compile's
reduce-overhead mode (CUDA graphs), padded rows bucketed to a multiple of 64 tokens so that one
graph serves many lengths, and a cudagraph step marked at each micro-batch. The graphs themselves
run only on a GPU (the device call); here: the settings reach torch.compile, the bucketed rows
give the same loss as rows padded to the longest, and the trainer marks each micro-batch."""

from __future__ import annotations

import pytest
import torch

from tuneledger import compiled
from tuneledger.config_load import load_config
from tuneledger.rows import make_collator


def _feats(lengths=(9, 23, 4)):
    g = torch.Generator().manual_seed(4)
    out = []
    for n in lengths:
        ids = torch.randint(10, 1000, (n,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100] * 2 + ids[2:]})
    return out


@pytest.fixture(autouse=True)
def _no_graphs_yet(monkeypatch):
    monkeypatch.setattr(compiled, "_GRAPHS", [False])  # compile_layers sets it; each test starts without


def _graphs(monkeypatch):
    """As compile_layers leaves it after compiling a CUDA model's layers with TUNELEDGER_CUDAGRAPHS=1."""
    monkeypatch.setenv("TUNELEDGER_CUDAGRAPHS", "1")
    monkeypatch.setattr(compiled, "_GRAPHS", [True])


def _cfg():
    return load_config(None, {"model_name_or_path": "m", "dataset": ["x.json"]})


def test_compiled_layers_are_asked_for_cuda_graphs_and_the_line_says_so(monkeypatch):
    asked = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: asked.append(kw) or fn)  # Module.compile calls it
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])
    line = compiled.compile_layers(model, True, "cuda", fused=True, quantized=False)
    assert [kw.get("mode") for kw in asked] == [None] * 3 and "CUDA graphs" not in line
    monkeypatch.setenv("TUNELEDGER_CUDAGRAPHS", "1")
    asked.clear()
    line = compiled.compile_layers(model, True, "cuda", fused=True, quantized=False)
    assert [kw.get("mode") for kw in asked] == ["reduce-overhead"] * 3
    assert "CUDA graphs (TUNELEDGER_CUDAGRAPHS=1, rows padded to a multiple of 64)" in line
    assert compiled.cudagraphs_on() and compiled.pad_multiple() == 64


def test_without_layers_compiled_on_a_gpu_the_variable_changes_nothing(tiny_model, qwen_tokenizer, tmp_path, monkeypatch):
    # A trial: on CPU, TUNELEDGER_CUDAGRAPHS=1 padded rows to 64 and filled grads (18% slower, said nowhere).
    from transformers import AutoModelForCausalLM, TrainingArguments

    from tuneledger.trainer import LedgerTrainer

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    monkeypatch.setenv("TUNELEDGER_CUDAGRAPHS", "1")
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
    for args in ((True, "cpu"), (None, "cpu"), (False, "cuda")):  # compiled on CPU, auto off on CPU, off
        line = compiled.compile_layers(model, *args, fused=True, quantized=False)
        assert "CUDA graphs" not in line and not compiled.cudagraphs_on() and compiled.pad_multiple() is None, args
    assert make_collator(_cfg(), qwen_tokenizer)(_feats())["input_ids"].shape[1] == 23
    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    t = LedgerTrainer(model=m, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]), n_params=1)
    assert not t.cudagraphs


def test_bucketed_rows_give_the_loss_of_rows_padded_to_the_longest(tiny_model, qwen_tokenizer, monkeypatch):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa").eval()
    longest = make_collator(_cfg(), qwen_tokenizer)(_feats())
    _graphs(monkeypatch)
    bucketed = make_collator(_cfg(), qwen_tokenizer)(_feats())
    assert longest["input_ids"].shape[1] == 23 and bucketed["input_ids"].shape[1] == 64
    assert (bucketed["labels"][:, 23:] == -100).all() and bucketed["attention_mask"].sum() == longest["attention_mask"].sum()
    with torch.no_grad():
        a = m(**longest).loss
        b = m(**bucketed).loss
        c = m(input_ids=bucketed["input_ids"], labels=bucketed["labels"]).loss  # drop_padding_mask's way
    assert torch.allclose(a, b, rtol=1e-5) and torch.allclose(a, c, rtol=1e-5), (a, b, c)


def test_each_micro_batch_marks_a_cudagraph_step(tiny_model, qwen_tokenizer, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, TrainingArguments

    from tuneledger.trainer import LedgerTrainer

    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=3)
    b = make_collator(_cfg(), qwen_tokenizer)(_feats())
    for env, want in ((None, 0), ("1", 2)):
        if env:
            _graphs(monkeypatch)
        t = LedgerTrainer(model=m, args=args, n_params=1, drop_padding_mask=True)
        t.current_gradient_accumulation_steps = 1
        marks.clear()
        for _ in range(2):
            t.training_step(m, dict(b))
        assert len(marks) == want


def _two_micro_batches(t, m, b):
    for _ in range(2):
        t.training_step(m, dict(b))
    return {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.requires_grad}


def test_each_parameter_has_a_grad_before_the_first_backward_so_it_is_added_in_place(
        tiny_model, qwen_tokenizer, tmp_path, monkeypatch):
    # A graph output kept as .grad would be overwritten by the next micro-batch's replay
    # (bench/results/h100-2026-12-06f-call2): the gradient must land in a tensor the trainer made.
    from transformers import AutoModelForCausalLM, TrainingArguments

    from tuneledger.trainer import LedgerTrainer

    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: None)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=3)
    b = make_collator(_cfg(), qwen_tokenizer)(_feats())
    grads = {}
    for env in (None, "1"):
        if env:
            _graphs(monkeypatch)
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        m.lm_head.weight.requires_grad_(False)  # a frozen parameter keeps no grad either way
        t = LedgerTrainer(model=m, args=args, n_params=1, drop_padding_mask=True)
        t.current_gradient_accumulation_steps = 2
        made = {}
        if env:
            t._grads_before_backward(m)
            made = {n: p.grad for n, p in m.named_parameters() if p.requires_grad}
            assert all((g == 0).all() for g in made.values()) and m.lm_head.weight.grad is None
        grads[env] = _two_micro_batches(t, m, b)
        for n, g in made.items():  # the same tensors took both micro-batches' gradients
            assert dict(m.named_parameters())[n].grad is g, n
        assert m.lm_head.weight.grad is None
        m.zero_grad()  # the Trainer's, after the optimizer step: None again, made again next step
        t._grads_before_backward(m)
        assert all(p.grad is not None for p in m.parameters() if p.requires_grad) if env else True
    assert grads[None].keys() == grads["1"].keys()
    for n in grads[None]:
        torch.testing.assert_close(grads["1"][n], grads[None][n], rtol=1e-6, atol=1e-7, msg=n)


def test_compiled_layers_replayed_as_cuda_graphs_accumulate_two_micro_batches_as_eager(
        tiny_model, qwen_tokenizer, tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a GPU (the device call runs this)")
    from transformers import AutoModelForCausalLM, TrainingArguments

    from tuneledger.trainer import LedgerTrainer

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], per_device_train_batch_size=3, bf16=False)
    grads = {}
    for env in (None, "1"):
        if env:
            monkeypatch.setenv("TUNELEDGER_CUDAGRAPHS", env)
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa").cuda()
        if env:
            compiled.compile_layers(m, True, "cuda", fused=False, quantized=False)
        b = {k: v.cuda() for k, v in make_collator(_cfg(), qwen_tokenizer)(_feats()).items()}
        t = LedgerTrainer(model=m, args=args, n_params=1, drop_padding_mask=True)
        t.current_gradient_accumulation_steps = 2
        for _ in range(3):  # the first calls record the graphs; the third step replays them
            m.zero_grad()
            grads[env] = _two_micro_batches(t, m, b)
    for n in grads[None]:
        torch.testing.assert_close(grads["1"][n], grads[None][n], rtol=2e-3, atol=2e-5, msg=n)
