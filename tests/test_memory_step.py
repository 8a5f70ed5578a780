"""TUNELEDGER_MEMORY_STEP (memory_step.py): the replay of the allocator's history finds the step's
peak and names what is live then; on a GPU, the peak it finds is torch's own max_memory_allocated."""

from __future__ import annotations

import json

import pytest
import torch

from tuneledger import memory_step
from tuneledger.memory_step import split, where

QWEN = {"filename": "/venv/lib/python3.12/site-packages/transformers/models/qwen2/modeling_qwen2.py", "line": 60, "name": "forward"}
TORCH = {"filename": "/venv/lib/python3.12/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"}
OURS = {"filename": "/work/src/tuneledger/fused_lora.py", "line": 140, "name": "forward"}
INDUCTOR = {"filename": "/tmp/torchinductor_root/ab/cabc123.py", "line": 900, "name": "call"}


def alloc(addr, size, *frames):
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def free(addr, size):
    return {"action": "free_requested", "addr": addr, "size": size, "frames": []}


def snapshot(trace, active):
    """A snapshot of GPU 0: `trace` its history, `active` {address: bytes} its blocks in use at the end."""
    return {"segments": [{"device": 0, "blocks": [{"address": a, "size": s, "state": "active_allocated"}
                                                  for a, s in active.items()]
                          + [{"address": 999, "size": 64, "state": "inactive"}]}],
            "device_traces": [trace + [{"action": "free_completed", "addr": 10, "size": 300, "frames": []}]]}


def test_the_peak_and_what_is_live_then_add_up_to_it():
    # before the step: 600 B of base weights at 1, 400 B at 2 that the step frees after its peak
    trace = [alloc(10, 300, OURS), alloc(11, 500), free(10, 300), alloc(12, 200, INDUCTOR),
             alloc(13, 250, TORCH, QWEN),  # the peak: 1,000 + 500 + 200 + 250
             free(2, 400), free(11, 500), free(13, 250)]
    s = split(snapshot(trace, {1: 600, 12: 200}), 0, 1000, {1: "4-bit base weights", 12: "gradients"})
    assert s["peak_mib"] * 2**20 == pytest.approx(1950)
    assert s["at_event"] == 5 and s["events"] == 8  # free_completed is not an event of allocated bytes
    assert s["end_mib"] * 2**20 == pytest.approx(800)
    rows = {r[0]: (r[1], round(r[2] * 2**20), r[3]) for r in s["rows"]}
    assert rows == {
        "before the step: 4-bit base weights": ("-", 600, 1),
        "before the step: freed after the peak": ("-", 400, 1),
        "in the step: gradients": ("-", 200, 1),  # still live at the end: named by its tensor
        "in the step: no Python frame (autograd's backward, or C++)": ("-", 500, 1),
        "in the step: transformers/models/qwen2/modeling_qwen2.py:60 forward": ("transformers", 250, 1),
    }
    assert sum(r[2] for r in s["rows"]) * 2**20 == pytest.approx(1950)
    assert [r[2] for r in s["rows"]] == sorted((r[2] for r in s["rows"]), reverse=True)


def test_a_block_freed_before_the_peak_is_not_in_it_and_a_reused_address_is_named_only_when_it_is_that_tensor():
    trace = [free(2, 400),  # a block from before the step, gone before the peak
             alloc(2, 100, OURS),  # its address reused by the step: live at the end, named
             alloc(5, 300, OURS), free(5, 300),  # an earlier allocation at a named address: by its code
             alloc(5, 50, INDUCTOR), alloc(6, 700, OURS),  # the peak: 600 + 100 + 50 + 700
             free(6, 700)]
    s = split(snapshot(trace, {1: 600, 2: 100, 5: 50}), 0, 1000, {1: "LoRA weights", 2: "optimizer state", 5: "gradients"})
    assert s["peak_mib"] * 2**20 == pytest.approx(1450)
    rows = {r[0]: round(r[2] * 2**20) for r in s["rows"]}
    assert rows == {"before the step: LoRA weights": 600, "in the step: optimizer state": 100,
                    "in the step: gradients": 50, "in the step: tuneledger/fused_lora.py:140 forward": 700}


def test_a_history_without_the_start_says_what_it_could_not_place():
    """A block from before the step that the snapshot no longer lists (a history that lost its start)
    is still counted at the peak, under its own row, so the rows add up to the peak."""
    s = split(snapshot([alloc(7, 100, OURS)], {}), 0, 1000, {}, truncated=True)
    rows = {r[0]: round(r[2] * 2**20) for r in s["rows"]}
    assert rows == {"before the step: not in the snapshot": 1000, "in the step: tuneledger/fused_lora.py:140 forward": 100}
    assert "kept only the last" in memory_step.markdown(s, 3)


def test_where_names_the_innermost_frame_outside_torch():
    assert where([TORCH, QWEN, OURS]) == ("transformers/models/qwen2/modeling_qwen2.py:60 forward", "transformers")
    assert where([INDUCTOR, OURS]) == ("compiled code: call", "compiled")
    assert where([{"filename": "<eval_with_key>.3", "line": 5, "name": "forward"}]) == ("compiled code: forward", "compiled")
    assert where([TORCH]) == ("torch: linear.py:125 forward", "torch")
    assert where([])[1] == "-"
    assert where([{"filename": "/home/me/train_my.py", "line": 3, "name": "main"}]) == ("train_my.py:3 main", "train_my")


def test_the_table_lists_before_then_the_biggest_of_the_step_and_sums_the_rest():
    trace = [alloc(100 + i, 1000 + i, {"filename": f"/x/tuneledger/m{i}.py", "line": i, "name": "f"})
             for i in range(memory_step.TOP + 3)]
    s = split(snapshot(trace, {1: 10}), 0, 10, {1: "buffers"})
    md = memory_step.markdown(s, 4, run_peak_mib=1.5)
    lines = [ln for ln in md.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert lines[0].startswith("| before the step: buffers")
    assert len(lines) == 1 + memory_step.TOP + 1 and lines[-1].startswith("| in the step: 3 other places")
    assert "m17.py" in lines[1]  # the biggest first
    assert "step 4" in md and "the run's peak so far (torch.cuda.max_memory_allocated): 2 MiB" in md


def test_a_snapshot_without_the_gpus_history_is_refused():
    with pytest.raises(ValueError, match="no allocator history for GPU 1"):
        split({"segments": [], "device_traces": [[]]}, 1, 0, {})


def test_tensor_names_tells_the_kept_tensors_apart():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, bias=False))
    model[0].weight.requires_grad_(False)
    model.register_buffer("rope", torch.zeros(3))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    names = memory_step.tensor_names(model, opt, device_type="cpu")

    def ptr(t):
        return t.untyped_storage().data_ptr()

    assert names[ptr(model[0].weight)] == "frozen 32-bit weights"
    assert names[ptr(model[1].weight)] == "trainable weights (LoRA)"
    assert names[ptr(model[1].weight.grad)] == "gradients"
    assert names[ptr(opt.state[model[1].weight]["exp_avg"])] == "optimizer state"
    assert names[ptr(model.rope)] == "buffers"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the allocator's history)")
def test_on_a_gpu_the_peak_found_is_torchs_own(tmp_path):
    torch.cuda.empty_cache()
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(512, 1024, device="cuda")
    model(x).square().mean().backward()  # a first step: the optimizer's state exists before the recorded one
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.reset_peak_memory_stats()
    rec = memory_step.Recorder()
    rec.start()
    model(x).square().mean().backward()
    opt.step()
    md = rec.finish(tmp_path / "memory-step2", 2, model, opt)
    s = json.loads((tmp_path / "memory-step2.json").read_text())
    assert s["peak_mib"] == pytest.approx(torch.cuda.max_memory_allocated() / 2**20, abs=0.01)
    rows = {r[0]: r[2] for r in s["rows"]}
    weights = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    assert rows["before the step: trainable weights (LoRA)"] == pytest.approx(weights, rel=0.01)
    assert rows["before the step: optimizer state"] == pytest.approx(2 * weights, rel=0.01)
    assert 0 < rows.get("in the step: gradients", 0) <= weights * 1.01  # the peak may come before the last one
    assert (tmp_path / "memory-step2.pickle").stat().st_size > 0 and "This step's peak" in md


def test_a_failing_split_is_said_and_the_run_goes_on(monkeypatch, tmp_path, capsys):
    """A diagnosis must never end the run it watches: finish() raising is one note, and the
    recording is switched off."""
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append((a, k)))

    class Broken(memory_step.Recorder):
        def finish(self, *a, **k):
            raise RuntimeError("snapshot failed")

    cb = memory_step.MemoryStep(3, tmp_path)
    cb.rec = Broken()
    cb.on_optimizer_step(None, None, None, model=None, optimizer=None)
    assert "TUNELEDGER_MEMORY_STEP=3: no memory split (RuntimeError: snapshot failed)" in capsys.readouterr().out
    assert calls == [((), {"enabled": None})] and cb.rec is None
    cb.on_step_end(None, None, None)  # after it, nothing left to do
