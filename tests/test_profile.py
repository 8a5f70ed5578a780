"""The step profile (TUNELEDGER_PROFILE_STEP): kernel categories, the split of a step, and the
callback on a real (CPU) profiler."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from tuneledger import profile


def test_kernel_names_fall_in_their_category():
    assert profile.category("void kDequantizeBlockwise<__nv_bfloat16, 512, 64, 8, 2>(float*, ...)") == "dequant"
    # our Triton kernel and Unsloth's: dequantization too, not "other" and "fused Triton" (2026-12-06d profiles)
    assert profile.category("nf4_dequant") == profile.category("_nf4_dequant_kernel") == "dequant"
    assert profile.category("void pytorch_flash::flash_fwd_kernel<...>") == "attention"
    assert profile.category("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT") == "matmul"
    assert profile.category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matmul"
    assert profile.category("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "fused Triton"
    assert profile.category("_rms_norm_forward_kernel") == "fused Triton"
    assert profile.category("void at::native::vectorized_elementwise_kernel<4, ...>") == "elementwise"
    assert profile.category("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>") == "optimizer"
    assert profile.category("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "all-reduce"
    assert profile.category("some_unknown") == "other"


def test_summary_splits_the_step_and_counts_the_host_side():
    ev = [{"name": "gemm_a", "kind": "kernel", "dur_us": 300_000, "self_us": 0},
          {"name": "flash_fwd", "kind": "kernel", "dur_us": 100_000, "self_us": 0},
          {"name": "cudaLaunchKernel", "kind": "runtime", "dur_us": 5, "self_us": 5},
          {"name": "cudaLaunchKernel", "kind": "runtime", "dur_us": 5, "self_us": 5},
          {"name": "cudaStreamSynchronize", "kind": "runtime", "dur_us": 50, "self_us": 50},
          {"name": "cudaMemcpyAsync", "kind": "runtime", "dur_us": 9, "self_us": 9},
          {"name": "cudaMemcpyAsync", "kind": "runtime", "dur_us": 9, "self_us": 9},
          {"name": "aten::mm", "kind": "cpu_op", "dur_us": 40, "self_us": 30},
          {"name": "aten::mm", "kind": "cpu_op", "dur_us": 40, "self_us": 30},
          {"name": "aten::copy_", "kind": "cpu_op", "dur_us": 4, "self_us": 3, "shapes": "[[8, 64], [8, 64], []]"}]
    s = profile.summarize(ev, wall_s=0.5)
    assert s["categories"] == {"matmul": 0.3, "attention": 0.1}
    assert abs(s["idle_s"] - 0.1) < 1e-9 and abs(s["idle_share"] - 0.2) < 1e-9
    assert (s["launches"], s["syncs"]) == (2, 3)
    assert s["sync_calls"] == {"cudaMemcpyAsync": 2, "cudaStreamSynchronize": 1}  # the kinds told apart, most first
    assert s["top_cpu_ops"][0] == ("aten::mm", 60e-6, 2)
    assert s["top_kernels"] == [("matmul", "gemm_a", 0.3, 1), ("attention", "flash_fwd", 0.1, 1)]
    md = profile.markdown(s, 5)
    assert "| matmul | 300.0 | 60.0% |" in md and "| idle | 100.0 | 20.0% |" in md and "2 kernel launches, 3 host syncs (cudaMemcpyAsync 2, cudaStreamSynchronize 1)" in md
    assert "| gemm_a | matmul | 300.0 | 1 |" in md
    assert s["copies"] == [("aten::copy_ [[8, 64], [8, 64], []]", 1)] and "| aten::copy_ [[8, 64], [8, 64], []] | 1 |" in md


def test_syncs_and_copies_are_told_by_the_ops_they_ran_in():
    """A host sync or a copy is listed with the ops around it (the profiler's cpu_parent chain),
    innermost first: where a step waits on the GPU, and where its device copies come from."""
    def ev(name, parent=None):
        return SimpleNamespace(name=name, cpu_parent=parent, device_type="DeviceType.CPU", cpu_time=5.0,
                               self_cpu_time_total=5.0, input_shapes=[[4], [4]])
    item = ev("aten::_local_scalar_dense", ev("aten::item", ev("LigerFusedLinearCrossEntropyFunction", ev("top"))))
    clone = ev("aten::clone", ev("GroupedLoraProjectionBackward"))
    gpu = dict(device_type="DeviceType.CUDA", cpu_time=0.0, self_cpu_time_total=0.0, cpu_parent=None,
               time_range=SimpleNamespace(elapsed_us=lambda: 700.0))
    kernel = SimpleNamespace(name="nvjet_sm90_tst", **gpu)
    # GPU-side ranges, not kernels: torch 2.11 puts each compiled graph's call on the GPU timeline.
    ranges = [SimpleNamespace(name="## Call CompiledFxGraph f7dy ##", **gpu),
              SimpleNamespace(name="my_range", is_user_annotation=True, **gpu)]
    prof = SimpleNamespace(events=lambda: [ev("cudaStreamSynchronize", item), ev("cudaStreamSynchronize", item),
                                           ev("cudaMemcpyAsync"), ev("aten::copy_", clone), ev("cudaLaunchKernel", item),
                                           kernel, *ranges])
    e = profile.events(prof)
    assert [x["name"] for x in e if x["kind"] == "kernel"] == ["nvjet_sm90_tst"]
    assert e and profile.origin(item) == "aten::item < LigerFusedLinearCrossEntropyFunction < top"
    s = profile.summarize(e, wall_s=1.0)
    assert s["sync_origins"] == [("cudaStreamSynchronize < aten::_local_scalar_dense < aten::item < "
                                  "LigerFusedLinearCrossEntropyFunction", 2), ("cudaMemcpyAsync", 1)]
    assert s["copies"] == [("aten::copy_ [[4], [4]] < aten::clone < GroupedLoraProjectionBackward", 1)]
    md = profile.markdown(s, 3)
    assert "| host sync (runtime call < the ops it ran in) | calls |" in md
    assert "| cudaStreamSynchronize < aten::_local_scalar_dense < aten::item < LigerFusedLinearCrossEntropyFunction | 2 |" in md


def test_callback_profiles_only_its_step(tmp_path):
    cb = profile.StepProfile(2, tmp_path)
    a = torch.randn(64, 64)
    for step in range(3):
        state = SimpleNamespace(global_step=step)
        cb.on_step_begin(None, state, None)
        (a @ a).sum()
        cb.on_step_end(None, state, None)
    s = json.loads((tmp_path / "profile-step2.json").read_text())
    assert s["wall_s"] > 0 and any(n.startswith("aten::") for n, _, _ in s["top_cpu_ops"])
    b = a.t()
    for step in range(3, 5):  # a copy on the profiled step is listed with its shapes
        cb = profile.StepProfile(4, tmp_path / "copies")
        state = SimpleNamespace(global_step=step)
        cb.on_step_begin(None, state, None)
        b.contiguous()
        cb.on_step_end(None, state, None)
    c = json.loads((tmp_path / "copies" / "profile-step4.json").read_text())["copies"]
    md = (tmp_path / "copies" / "profile-step4.md").read_text()
    if not torch.cuda.is_available():  # a CPU run says so instead of reading as an idle GPU
        assert "no GPU kernels (a CPU run)" in md and "idle" not in md, md
    assert any(n.startswith("aten::copy_ [[64, 64], [64, 64]") for n, _ in c), c
    assert [p.name for p in tmp_path.iterdir()] and len(list(tmp_path.glob("profile-step*.json"))) == 1


def test_idle_gaps_are_charged_to_the_launch_that_ended_them():
    """A pause between kernels (50 µs or more; less is launch latency) is charged to the last
    launch before the next kernel and the ops it ran in; overlapping kernels (two streams) leave
    no pause; the table lists the most waited-on first."""
    def k(start, dur):
        return {"name": "k", "kind": "kernel", "dur_us": dur, "self_us": 0, "start_us": start}

    def launch(start, origin):
        return {"name": "cudaLaunchKernel", "kind": "runtime", "dur_us": 3, "self_us": 3, "start_us": start, "origin": origin}

    ev = [k(0, 100), launch(90, "aten::mm < Optimizer.step"), k(400, 100),  # 300 µs waited on the optimizer
          k(450, 200),                                                    # overlaps (another stream): no pause
          launch(640, "aten::add_"), k(660, 10),                           # 10 µs after 650: latency, not a pause
          launch(700, "aten::mm < Optimizer.step"), k(770, 10),            # 100 µs more on the optimizer
          launch(800, "LigerFusedLinearCrossEntropyFunction"), k(900, 10)]  # 120 µs on Liger
    g = profile.summarize(ev, wall_s=0.001)["gaps"]
    assert g["count"] == 3 and abs(g["total_s"] - 520e-6) < 1e-12
    assert [(o, round(s * 1e6), c) for o, s, c in g["by_origin"]] == [("aten::mm < Optimizer.step", 400, 2),
                                                                      ("LigerFusedLinearCrossEntropyFunction", 120, 1)]
    md = profile.markdown(profile.summarize(ev, wall_s=0.001), 5)
    assert "3 pauses of 50 µs or more between kernels, 0.5 ms in all" in md
    assert "| aten::mm < Optimizer.step | 0.4 | 2 |" in md
    # Without start times (older events) there is no gap table.
    assert profile.idle_gaps([{"name": "k", "kind": "kernel", "dur_us": 5, "self_us": 0}]) == {
        "count": 0, "total_s": 0.0, "by_origin": []}
