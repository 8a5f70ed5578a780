"""train_mode.TrainWalk: Trainer.training_step's `model.train()` at every micro-batch without its
walk over every module when all are training (23 ms of host time a micro-batch on a 7B with LoRA
on a busy 2-core CPU: bench/results/cpu-2026-12-06-train-walk), and the real walk whenever any
module is not."""

from __future__ import annotations

import torch
from torch import nn

from tuneledger.train_mode import TrainWalk


def _model():
    return nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)))


def _walks(monkeypatch):
    calls = []
    real = nn.Module.children
    monkeypatch.setattr(nn.Module, "children", lambda self: calls.append(self) or real(self))
    return calls


def test_a_model_all_in_training_mode_is_not_walked_again(monkeypatch):
    m, walk = _model().train(), TrainWalk()
    calls = _walks(monkeypatch)
    with walk.skipped(m):
        assert m.train() is m
    assert calls == []
    assert "train" not in m.__dict__  # outside the block the class's own train again
    m.train()
    assert len(calls) == len(list(m.modules()))


def test_a_model_or_one_module_out_of_training_mode_is_walked_back(monkeypatch):
    m, walk = _model(), TrainWalk()
    for leave in (lambda: m.eval(), lambda: m[2].eval(), lambda: m[2][1].train(False)):
        m.train()
        leave()
        assert not all(x.training for x in m.modules())
        with walk.skipped(m):
            m.train()
        assert all(x.training for x in m.modules())
    with walk.skipped(m):  # train(False) inside the block is the real eval
        m.train(False)
    assert not any(x.training for x in m.modules())


class _Cached(nn.Linear):
    def train(self, mode: bool = True):  # as peft's DoRA does: more than setting the flag
        self.cleared = getattr(self, "cleared", 0) + 1
        return super().train(mode)


def test_a_module_whose_train_does_more_keeps_the_walk_at_every_call():
    m, walk = nn.Sequential(_Cached(4, 4), nn.Dropout(0.5)).train(), TrainWalk()
    m[0].cleared = 0
    for _ in range(3):
        with walk.skipped(m):
            m.train()
    assert m[0].cleared == 3


def test_a_train_set_on_a_module_instance_keeps_the_walk():
    from types import MethodType

    m, walk = _model().train(), TrainWalk()
    calls = []
    m[1].train = MethodType(lambda self, mode=True: calls.append(mode) or nn.Module.train(self, mode), m[1])
    for _ in range(3):
        with walk.skipped(m):
            m.train()
    assert calls == [True] * 3


def test_a_new_model_is_listed_anew():
    walk, a, b = TrainWalk(), _model().train(), _model()
    with walk.skipped(a):
        a.train()
    b.eval()
    with walk.skipped(b):
        b.train()
    assert all(x.training for x in b.modules())


def test_the_trainer_puts_a_model_left_in_eval_mode_back_in_training_mode(tiny_model, qwen_tokenizer, tmp_path):
    # An evaluation (or a callback) leaves the model in eval mode: the next micro-batch must train
    # with dropout on again, as the stock Trainer does.
    from transformers import AutoModelForCausalLM, TrainingArguments

    from tuneledger.config_load import load_config
    from tuneledger.rows import make_collator
    from tuneledger.trainer import LedgerTrainer

    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=2)
    t = LedgerTrainer(model=m, args=args, n_params=1, drop_padding_mask=True)
    t.current_gradient_accumulation_steps = 1
    cfg = load_config(None, {"model_name_or_path": "m", "dataset": ["x.json"]})
    b = make_collator(cfg, qwen_tokenizer)([{"input_ids": [11, 12, 13, 14], "labels": [11, 12, 13, 14]}] * 2)
    seen = []
    m.model.layers[0].register_forward_pre_hook(lambda mod, a: seen.append(mod.training))
    for leave in (m.eval, m.model.layers[0].eval, lambda: None):
        leave()
        t.training_step(m, dict(b))
        assert seen[-1] is True and all(x.training for x in m.modules())
    assert "train" not in m.__dict__
    assert t.train_walk._modules is not None  # a plain model: the walk was skippable


def test_train_walk_every_keeps_the_stock_walk_for_the_a_b(monkeypatch):
    m, walk = _model().train(), TrainWalk()
    monkeypatch.setenv("TUNELEDGER_TRAIN_WALK", "every")
    calls = _walks(monkeypatch)
    with walk.skipped(m):
        m.train()
    assert len(calls) == len(list(m.modules()))
