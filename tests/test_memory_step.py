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


K = 512  # the allocator's block: the synthetic histories count in blocks


def alloc(addr, size, *frames):
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def free(addr, size):
    return {"action": "free_requested", "addr": addr, "size": size, "frames": []}


def snapshot(trace, active):
    """A snapshot of GPU 0: `trace` its history, `active` {address: bytes} its blocks in use at the end."""
    return {"segments": [{"device": 0, "blocks": [{"address": a, "size": s, "state": "active_allocated"}
                                                  for a, s in active.items()]
                          + [{"address": 999, "size": 64, "state": "inactive"}]}],
            "device_traces": [trace + [{"action": "free_completed", "addr": 10, "size": 300, "frames": []},
                                       {"action": "segment_alloc", "addr": 0, "size": 2**21, "frames": []},
                                       {"action": "segment_map", "addr": 0, "size": 2**21, "frames": []}]]}


def test_the_peak_and_what_is_live_then_add_up_to_it():
    # before the step: 600 K of base weights at 1, 400 K at 2 that the step frees after its peak
    trace = [alloc(10, 300 * K, OURS), alloc(11, 500 * K), free(10, 300 * K), alloc(12, 200 * K, INDUCTOR),
             alloc(13, 250 * K, TORCH, QWEN),  # the peak: 1,000 + 500 + 200 + 250
             free(2, 400 * K), free(11, 500 * K), free(13, 250 * K)]
    s = split(snapshot(trace, {1: 600 * K, 12: 200 * K}), 0, 1000 * K, {1: "4-bit base weights", 12: "gradients"},
              allocated_at_end=800 * K)
    assert s["peak_mib"] * 2**20 == 1950 * K
    assert s["at_event"] == 5 and s["events"] == 8  # free_completed is not an event of allocated bytes
    assert s["end_mib"] * 2**20 == 800 * K and s["replay_gap_mib"] == 0
    rows = {r[0]: (r[1], round(r[2] * 2**20 / K), r[3]) for r in s["rows"]}
    assert rows == {
        "before the step: 4-bit base weights": ("-", 600, 1),
        "before the step: freed after the peak": ("-", 400, 1),
        "in the step: gradients": ("-", 200, 1),  # still live at the end: named by its tensor
        "in the step: no Python frame (autograd's backward, or C++)": ("-", 500, 1),
        "in the step: transformers/models/qwen2/modeling_qwen2.py:60 forward": ("transformers", 250, 1),
    }
    assert sum(r[2] for r in s["rows"]) * 2**20 == 1950 * K
    assert [r[2] for r in s["rows"]] == sorted((r[2] for r in s["rows"]), reverse=True)


def test_a_block_freed_before_the_peak_is_not_in_it_and_a_reused_address_is_named_only_when_it_is_that_tensor():
    trace = [free(2, 400 * K),  # a block from before the step, gone before the peak
             alloc(2, 100 * K, OURS),  # its address reused by the step: live at the end, named
             alloc(5, 300 * K, OURS), free(5, 300 * K),  # an earlier allocation at a named address: by its code
             alloc(5, 50 * K, INDUCTOR), alloc(6, 700 * K, OURS),  # the peak: 600 + 100 + 50 + 700
             free(6, 700 * K)]
    s = split(snapshot(trace, {1: 600 * K, 2: 100 * K, 5: 50 * K}), 0, 1000 * K,
              {1: "trainable weights (LoRA)", 2: "optimizer state", 5: "gradients"})
    assert s["peak_mib"] * 2**20 == 1450 * K
    rows = {r[0]: round(r[2] * 2**20 / K) for r in s["rows"]}
    assert rows == {"before the step: trainable weights (LoRA)": 600, "in the step: optimizer state": 100,
                    "in the step: gradients": 50, "in the step: tuneledger/fused_lora.py:140 forward": 700}


def test_requests_count_as_the_blocks_torch_counts():
    """The history gives requested bytes, torch's allocated statistic block bytes (512 at least, in
    steps of 512): 4 B is a 512-B block, 1,000 B a 1,024-B one; a block still live at the end is
    counted as the snapshot sizes it, and a replay that ends away from torch's count says so."""
    trace = [alloc(20, 4, OURS), alloc(21, 1000, OURS), alloc(22, 3000, OURS), free(20, 4)]
    s = split(snapshot(trace, {21: 1024, 22: 4096}), 0, 0, {}, allocated_at_end=1024 + 4096)
    assert s["peak_mib"] * 2**20 == 512 + 1024 + 4096 and s["replay_gap_mib"] == 0
    off = split(snapshot(trace, {21: 1024, 22: 4096}), 0, 0, {}, allocated_at_end=1024 + 4096 + 3 * 2**20)
    assert off["replay_gap_mib"] == 3 and "The replay ends +3.0 MiB from torch's own count" in memory_step.markdown(off, 2)
    assert memory_step.block_bytes(1) == 512 and memory_step.block_bytes(512) == 512 and memory_step.block_bytes(513) == 1024


def test_a_history_without_the_start_says_what_it_could_not_place(monkeypatch):
    """A block from before the step that the snapshot no longer lists (a history that lost its start)
    is still counted at the peak, under its own row, so the rows add up to the peak; a history as
    long as MAX_ENTRIES is said to have lost its start."""
    monkeypatch.setattr(memory_step, "MAX_ENTRIES", 4)  # the synthetic history's 4 events: as full as it gets
    s = split(snapshot([alloc(7, 100 * K, OURS)], {}), 0, 1000 * K, {})
    rows = {r[0]: round(r[2] * 2**20 / K) for r in s["rows"]}
    assert rows == {"before the step: not in the snapshot": 1000, "in the step: tuneledger/fused_lora.py:140 forward": 100}
    assert s["truncated"] and "kept only the last" in memory_step.markdown(s, 3)
    monkeypatch.setattr(memory_step, "MAX_ENTRIES", 5)
    assert not split(snapshot([alloc(7, 100 * K, OURS)], {}), 0, 1000 * K, {})["truncated"]


def test_where_names_the_innermost_frame_outside_torch():
    assert where([TORCH, QWEN, OURS]) == ("transformers/models/qwen2/modeling_qwen2.py:60 forward", "transformers")
    assert where([INDUCTOR, OURS]) == ("compiled code: call", "compiled")
    assert where([{"filename": "<eval_with_key>.3", "line": 5, "name": "forward"}]) == ("compiled code: forward", "compiled")
    assert where([TORCH]) == ("torch: linear.py:125 forward", "torch")
    assert where([])[1] == "-"
    assert where([{"filename": "/home/me/train_my.py", "line": 3, "name": "main"}]) == ("train_my.py:3 main", "train_my")
    trl = {"filename": "/venv/lib/python3.12/site-packages/trl/trainer/sft_trainer.py", "line": 1, "name": "f"}
    assert where([trl]) == ("trl/trainer/sft_trainer.py:1 f", "trl")  # any installed package, listed or not
    runpy = {"filename": "<frozen runpy>", "line": 88, "name": "_run_code"}
    assert where([runpy, {"filename": "/x/bin/script.py", "line": 2, "name": "main"}]) == ("script.py:2 main", "script")
    functorch = {"filename": "/venv/lib/python3.12/site-packages/functorch/x.py", "line": 1, "name": "g"}
    assert where([functorch, QWEN])[1] == "transformers"


def test_the_table_lists_before_then_the_biggest_of_the_step_and_sums_the_rest():
    trace = [alloc(100 + i, (i + 1) * K, {"filename": f"/x/tuneledger/m{i}.py", "line": i, "name": "f"})
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
    with pytest.raises(ValueError, match="entry 1 .* address 10 allocated again with no free since entry 0"):
        split(snapshot([alloc(10, K), alloc(10, K)], {}), 0, 0, {})  # the rows summed less than the peak
    with pytest.raises(ValueError, match="entry 2 .* address 10 freed again with no alloc since entry 1"):
        split(snapshot([alloc(10, K), free(10, K), free(10, K)], {}), 0, 0, {})
    for bad in (0, "", {}):  # a falsy non-list is damage too, not "no segments"
        with pytest.raises(ValueError, match="segments is a"):
            split({"segments": bad, "device_traces": [[]]}, 0, 0, {})
    with pytest.raises(ValueError, match="frames that are not a list"):
        split(snapshot([{**alloc(10, K), "frames": 0}], {}), 0, 0, {})
    for damaged in ([], None, {"device_traces": {"0": []}}, {"device_traces": [None]}):
        with pytest.raises(ValueError, match="no device_traces list"):
            split(damaged, 0, 0, {})
    with pytest.raises(ValueError, match="entry 0 .* a text filename"):
        split(snapshot([alloc(10, K, {"filename": 5, "line": 1, "name": "f"})], {}), 0, 0, {})


def test_an_event_without_its_size_or_address_is_refused_by_number():
    """Numbered as the raw history counts (memory_viz, the pickle), every action included."""
    bad = {"action": "alloc", "addr": 20, "frames": []}
    with pytest.raises(ValueError, match=r"GPU 0's history entry 1 \(alloc; 0-based.*\) has no whole number >= 0 for size"):
        split(snapshot([alloc(10, K), bad], {}), 0, 0, {})
    with pytest.raises(ValueError, match="entry 0 .* for addr or size"):
        split(snapshot([{"action": "free_requested"}], {}), 0, 0, {})
    with pytest.raises(ValueError, match="history entry 1 \\(0-based\\) has no action"):
        split(snapshot([alloc(10, K), {"addr": 20, "size": K}], {}), 0, 0, {})
    for size in (True, -512, 512.0):  # a bool is an int to isinstance; a negative or float size is damage
        with pytest.raises(ValueError, match="for size"):
            split(snapshot([alloc(10, size)], {}), 0, 0, {})


def test_a_damaged_segment_block_or_frame_is_refused_by_number():
    """The snapshot's other parts: each damage a ValueError naming where, never a KeyError or a wrong sum."""
    good = snapshot([alloc(10, K)], {10: K})
    assert split(good, 0, 0, {})["peak_mib"] == K / 2**20
    cases = [({"segments": {"device": 0}}, "segments is a dict, not a list"),
             ({"segments": ["x"]}, "segment 0 .* is not a mapping with a list of blocks"),
             ({"segments": [{"device": 0, "blocks": [{"address": 10, "size": K, "state": "active_allocated"}, 7]}]},
              "segment 0's block 1 .* is not a mapping"),
             ({"segments": [{"device": 0, "blocks": [{"size": K, "state": "active_allocated"}]}]},
              "segment 0's block 0 .* for address"),
             ({"segments": [{"device": 0, "blocks": [{"address": 10, "size": -K, "state": "active_allocated"}]}]},
              "segment 0's block 0 .* for size")]
    for damage, message in cases:
        with pytest.raises(ValueError, match=message):
            split({**good, **damage}, 0, 0, {})
    inactive = {"segments": [{"device": 0, "blocks": [{"state": "inactive"}]}]}  # a free block needs no address
    assert split({**good, **inactive}, 0, 0, {})["peak_mib"] == K / 2**20
    with pytest.raises(ValueError, match="history entry 0 \\(alloc; 0-based\\) has frames that are not a list"):
        split(snapshot([alloc(10, K, "frame as text")], {}), 0, 0, {})


def test_a_lost_start_is_anchored_on_torchs_count_at_the_end(monkeypatch):
    """400,000 events and more: the ring buffer drops the step's first allocations. Counting on from
    the step's first count would give a peak too low and a negative end; anchored on torch's count
    at the end, the kept events' peak and their rows agree (found by a new-user trial)."""
    monkeypatch.setattr(memory_step, "MAX_ENTRIES", 5)
    full = [alloc(10, 5000 * K, OURS), alloc(11, 3000 * K, OURS), free(10, 5000 * K), alloc(12, 2000 * K, OURS),
            free(11, 3000 * K), free(12, 2000 * K), alloc(13, 64 * K, OURS)]
    snap = {"segments": [{"device": 0, "blocks": [{"address": 1, "size": 1000 * K, "state": "active_allocated"},
                                                  {"address": 13, "size": 64 * K, "state": "active_allocated"}]}],
            "device_traces": [full[-5:]]}  # the last five: both big allocations lost
    s = split(snap, 0, 1000 * K, {1: "frozen 16-bit weights"}, allocated_at_end=1064 * K)
    assert s["truncated"] and round(s["peak_mib"] * 2**20 / K) == 9000 and round(s["end_mib"] * 2**20 / K) == 1064
    rows = {r[0]: round(r[2] * 2**20 / K) for r in s["rows"]}
    assert rows == {"before the kept history: freed after the peak": 8000, "before the kept history: frozen 16-bit weights": 1000}
    assert s["replay_gap_mib"] == 0 and "anchored on torch's own" in memory_step.markdown(s, 3)
    monkeypatch.setattr(memory_step, "MAX_ENTRIES", 4)  # the one alloc and snapshot()'s three other events: full
    kept_more = snapshot([alloc(20, 2**21, OURS)], {20: 2**21})  # 2 MiB kept, 1 MiB counted at the end
    with pytest.raises(ValueError, match="allocates 1.0 MiB more than torch counted"):
        split(kept_more, 0, 0, {}, allocated_at_end=2**20)


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
    # the launcher's allocator setting (launch.py): blocks are their requests rounded to 512 B
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    try:
        _peak_found_is_torchs_own(tmp_path)
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")


def _peak_found_is_torchs_own(tmp_path):
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
    loss = model(x).square().mean()
    small = [torch.ones((), device="cuda") * i for i in range(200)]  # 4-B requests in 512-B blocks
    odd = torch.empty(1_000_001, dtype=torch.uint8, device="cuda")  # a request that is not a whole block
    loss.backward()
    opt.step()
    md = rec.finish(tmp_path / "memory-step2", 2, model, opt)
    del small, odd
    s = json.loads((tmp_path / "memory-step2.json").read_text())
    assert s["peak_mib"] * 2**20 == torch.cuda.max_memory_allocated()  # exact: block bytes, as torch counts
    assert s["replay_gap_mib"] == 0
    rows = {r[0]: r[2] for r in s["rows"]}
    weights = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    assert rows["before the step: trainable weights (LoRA)"] == pytest.approx(weights, rel=0.01)
    assert rows["before the step: optimizer state"] == pytest.approx(2 * weights, rel=0.01)
    assert 0 < rows.get("in the step: gradients", 0) <= weights * 1.01  # the peak may come before the last one
    assert sum(rows.values()) == pytest.approx(s["peak_mib"])
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


def test_the_callback_records_its_step_on_rank_0_and_a_failing_start_is_said(monkeypatch, tmp_path, capsys):
    from types import SimpleNamespace

    started = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(memory_step.Recorder, "start", lambda self: started.append(self))
    cb = memory_step.MemoryStep(3, tmp_path)
    cb.on_step_begin(None, SimpleNamespace(global_step=1), None)  # step 2
    assert not started and cb.rec is None
    memory_step.MemoryStep(3, tmp_path, rank=1).on_step_begin(None, SimpleNamespace(global_step=2), None)
    assert not started
    cb.on_step_begin(None, SimpleNamespace(global_step=2), None)  # step 3, rank 0
    assert len(started) == 1 and cb.rec is started[0]

    def no_history(self):
        raise RuntimeError("cudaMallocAsync does not yet support recordHistory")

    monkeypatch.setattr(memory_step.Recorder, "start", no_history)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: None)
    cb = memory_step.MemoryStep(3, tmp_path)
    cb.on_step_begin(None, SimpleNamespace(global_step=2), None)
    assert cb.rec is None and "no memory split (RuntimeError: cudaMallocAsync" in capsys.readouterr().out


def test_no_history_is_said_from_torchs_own_allocator(monkeypatch):
    """The worker asks torch which allocator runs (either variable may have chosen it) and says why
    nothing is recorded at the start, so a step past the end is not silent either."""
    import torch

    from tuneledger import worker

    assert worker.why_no_allocator_history(False) == "no CUDA GPU here"
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    assert "cudaMallocAsync" in worker.why_no_allocator_history(True)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    assert worker.why_no_allocator_history(True) == ""
