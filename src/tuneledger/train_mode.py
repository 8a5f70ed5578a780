"""Trainer.training_step calls `model.train()` at every micro-batch: a walk over every module
(2,333 with LoRA on all seven projections of a 7B) that costs host time (23 ms on a busy 2-core
CPU, bench/results/cpu-2026-12-06-train-walk; not measured on a GPU host), while the GPU,
with nothing queued yet, waits at the start of each micro-batch (bench/results/h100-2026-12-06f-call2,
profile-Cauto.md: 55 ms a step in 8 pauses before the embedding, preset C). Reading the `training`
flags of a kept list of the modules costs 0.4 ms there, so `TrainWalk` calls the real `train()` only
when a module has left training mode (an evaluation, a callback's `model.eval()`).

Exact where it applies: every module's `train` must be one known to do nothing more than set the
flag (nn.Module's, transformers' PreTrainedModel's, DDP's); a model with any other override (peft's
DoRA clears a cache in it), or a `train` set on a module instance, keeps the walk at every call. TUNELEDGER_TRAIN_WALK=every keeps it too:
make bench's `*walk` rows, the A/B.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from tuneledger import env_levers


def _plain_trains() -> tuple:
    from torch.nn.parallel import DistributedDataParallel
    from transformers import PreTrainedModel

    # PreTrainedModel.train re-sets its kernels only when the mode changes; DDP's calls Module's.
    return (torch.nn.Module.train, PreTrainedModel.train, DistributedDataParallel.train)


class TrainWalk:
    """Skips `model.train()`'s walk when every module of `model` is already training.

    The module list is taken at the first `skipped(model)` of a model and kept: a module added to
    the model later (no training path of ours adds one) would not be checked.
    """

    def __init__(self):
        self._model = None
        self._modules: list[torch.nn.Module] | None = None  # None: walk every time (an unknown train)

    def _kept(self, model: torch.nn.Module) -> list[torch.nn.Module] | None:
        if self._model is not model:
            mods = list(model.modules())
            plain = _plain_trains()
            self._model = model
            # A train set on an instance is called by the stock walk too: such a model keeps it.
            self._modules = mods if all(type(m).train in plain and "train" not in vars(m) for m in mods) else None
        return self._modules

    @contextmanager
    def skipped(self, model: torch.nn.Module) -> Iterator[None]:
        """Within the block, `model.train()` (mode True) returns at once when every module is
        training; `model.train(False)`, or a module out of training mode, runs the real walk."""
        mods = None if env_levers.value("TUNELEDGER_TRAIN_WALK") == "every" else self._kept(model)
        if mods is None:
            yield
            return
        real = type(model).train

        def train(mode: bool = True):
            if mode and all(m.training for m in mods):
                return model
            return real(model, mode)

        model.__dict__["train"] = train  # an instance attribute shadows the class's method
        try:
            yield
        finally:
            model.__dict__.pop("train", None)
