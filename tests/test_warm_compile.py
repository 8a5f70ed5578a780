"""probes.time_warm_compile: what compiling costs a train that finds the dry-run's kernels cached."""

from __future__ import annotations

import pytest
import torch

from tuneledger.probes import time_warm_compile


class _Trainer:
    """The three Trainer methods time_warm_compile uses, over a compiled two-layer model."""

    def __init__(self, model, batches):
        self.model_wrapped, self.batches = model, batches

    def get_train_dataloader(self):
        return iter(self.batches)

    def _prepare_inputs(self, b):
        return b

    def compute_loss(self, model, b):
        return model(b["x"]).float().pow(2).mean()


@pytest.mark.slow  # inductor builds C++ kernels on the CPU: about half a minute on 2 cores
def test_warm_compile_is_measured_from_the_cache_and_leaves_no_gradients(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
                                  for _ in range(2)])
    for layer in model:
        layer.compile(dynamic=None)
    # Micro-batches of varying length, as the run's first steps: one compile per shape, then dynamic.
    batches = [{"x": torch.randn(n, 32)} for n in (7, 11, 13)]
    trainer = _Trainer(model, batches)
    for b in batches:  # the dry-run's own steps: the cold compile, which fills the cache
        trainer.compute_loss(model, b).backward()
    got = time_warm_compile(trainer)
    assert got["micro_batches"] == 3 and got["forgot"][:2] == ["dynamo", "PyCodeCache"]
    # Which pass is slower is left to benchmarks (the H200 ETA calls): on a loaded 2-core machine
    # this tiny model's two passes swapped (0.120 s against 0.128).
    assert got["first_pass_s"] > 0 and got["second_pass_s"] > 0
    assert got["compile_s"] == pytest.approx(max(0.0, got["first_pass_s"] - got["second_pass_s"]))
    assert all(p.grad is None for p in model.parameters())  # no gradient leaks into the run after it


def test_no_batches_no_figure():
    assert time_warm_compile(_Trainer(torch.nn.Linear(2, 2), [])) is None


def test_forget_compiled_code_drops_the_loaded_modules():
    """The probe must load the compiled code again as a new process would: inductor's loaded
    modules go (the dict this torch keeps them in), not only dynamo's frames."""
    from torch._inductor.codecache import PyCodeCache

    from tuneledger.probes import forget_compiled_code

    loaded = getattr(PyCodeCache, "modules", None)
    if not isinstance(loaded, dict):
        loaded = PyCodeCache.cache  # torch 2.5: the same dict under its older name
    loaded["sentinel-key"] = object()
    from torch._inductor.codecache import CppWrapperCodeCache

    CppWrapperCodeCache.cache["sentinel-key"] = object()  # compile_cpp_wrapper's loaded wrappers
    cleared = forget_compiled_code()
    assert cleared[:2] == ["dynamo", "PyCodeCache"] and "CppWrapperCodeCache" in cleared
    assert "sentinel-key" not in loaded and "sentinel-key" not in CppWrapperCodeCache.cache
