"""The bottleneck rules on the traces in tests/fixtures/diagnosis_traces.yaml (H200 baseline and
field-report numbers, plus marked synthetic and hypothetical cases), the thresholds file, and the
join from monitor samples to a verdict."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tuneledger.config import ConfigError
from tuneledger.diagnose import BOTTLENECKS, DiagnosisThresholds, diagnose, load_thresholds
from tuneledger.monitor.csvlog import read_rows
from tuneledger.monitor.summary import summarize_window

ROOT = Path(__file__).parents[1]
FIX = Path(__file__).parent / "fixtures"
TRACES = yaml.safe_load((FIX / "diagnosis_traces.yaml").read_text())


@pytest.mark.parametrize("case", TRACES, ids=[c["name"] for c in TRACES])
def test_recorded_traces(case):
    d = diagnose(case["inputs"], load_thresholds(ROOT / "configs" / "diagnosis.yaml"))
    assert d["bottleneck"] == case["expect"], d["line"]
    assert d["line"].startswith(case["expect"] + ": ")
    assert "\n" not in d["line"] and "\n" not in d["lever"]
    assert d["inferred"] == case.get("inferred", False)
    assert d["util_available"] == (case["inputs"]["util_mean_pct"] is not None)
    for s in case.get("line_has", []):
        assert s in d["line"], d["line"]
    for s in case.get("lever_has", []):
        assert s in d["lever"], d["lever"]
    for s in case.get("lever_lacks", []):
        assert s not in d["lever"], d["lever"]


def test_line_carries_the_numbers():
    d = diagnose({"util_mean_pct": 25.4, "mem_peak_frac": 0.078, "allreduce_share": 0.04, "data_wait_share": 0.01,
                  "micro_batch": 1, "gradient_checkpointing": True, "mfu": 0.058})
    assert d["line"] == ("host-bound: the GPU is busy only 25% of the time (< 75%) and neither data wait nor all-reduce "
                         "explains it: it idles between many small kernels the host launches [GPU util 25%; memory peak "
                         "8% of the GPU; all-reduce + sync 4% of a step; data wait 1%; micro-batch 1; GC on; MFU 5.8%]")
    assert d["lever"].startswith("a bigger micro-batch than 1 (peak memory 8% leaves room), packing, gradient checkpointing off")


def test_every_verdict_is_reachable_and_known():
    seen = {c["expect"] for c in TRACES}
    assert seen == set(BOTTLENECKS)


def test_precedence_measured_loss_outranks_util():
    base = {"util_mean_pct": 96, "mem_peak_frac": 0.95, "allreduce_share": 0.25, "data_wait_share": 0.15, "micro_batch": 2,
            "gradient_checkpointing": False}
    assert diagnose(base)["bottleneck"] == "communication-bound"
    assert diagnose({**base, "allreduce_share": 0.1})["bottleneck"] == "input-bound"
    assert diagnose({**base, "allreduce_share": 0.1, "data_wait_share": 0.0})["bottleneck"] == "memory-bound"
    assert diagnose({**base, "allreduce_share": 0.1, "data_wait_share": 0.0, "mem_peak_frac": 0.5})["bottleneck"] == "compute-bound"


def test_threshold_edges():
    t = DiagnosisThresholds()
    at = lambda **kw: diagnose({"allreduce_share": 0.0, "data_wait_share": 0.0, "mem_peak_frac": 0.5, **kw}, t)["bottleneck"]  # noqa: E731
    assert at(util_mean_pct=90) == "compute-bound"
    assert at(util_mean_pct=75) == "compute-bound"
    assert at(util_mean_pct=74.9) == "host-bound"
    assert at(util_mean_pct=50, allreduce_share=0.20) == "communication-bound"
    assert at(util_mean_pct=50, allreduce_share=0.199) == "host-bound"
    assert at(util_mean_pct=50, data_wait_share=0.10) == "input-bound"
    assert at(util_mean_pct=50, mem_peak_frac=0.90) == "memory-bound"


def test_memory_bound_levers_fit_the_config():
    mem = {"util_mean_pct": 60, "mem_peak_frac": 0.97, "allreduce_share": 0.0, "data_wait_share": 0.0}
    assert diagnose({**mem, "micro_batch": 4, "gradient_checkpointing": False})["lever"] == \
        ("gradient checkpointing on, or a smaller micro-batch (accumulation keeps the global batch); "
         "what is live at the peak: TUNELEDGER_MEMORY_STEP=2 (docs/speed.md)")
    assert diagnose({**mem, "micro_batch": 4, "gradient_checkpointing": True})["lever"].startswith("a smaller micro-batch")
    assert "shorter cutoff_len" in diagnose({**mem, "micro_batch": 1, "gradient_checkpointing": True})["lever"]


def test_imbalance_is_named():
    d = diagnose({"util_mean_pct": 60, "mem_peak_frac": 0.3, "allreduce_share": 0.3, "data_wait_share": 0.0,
                  "imbalance": True, "util_spread_pts": 22.5})
    assert "util imbalanced across GPUs (22 points)" in d["line"] and d["lever"].startswith("first find the slow GPU")


def test_imbalance_follows_the_thresholds_spread_rule():
    """The summary measures the spread; the verdict judges it with its own imbalance_util_pts
    (configs/diagnosis.yaml), whatever flag the summary computed with the default."""
    base = {"util_mean_pct": 60, "mem_peak_frac": 0.3, "allreduce_share": 0.3, "data_wait_share": 0.0,
            "imbalance": False, "util_spread_pts": 12.0}
    assert "imbalanced" not in diagnose(base)["line"]
    assert "util imbalanced across GPUs (12 points)" in diagnose(base, DiagnosisThresholds(imbalance_util_pts=10))["line"]
    assert "imbalanced" not in diagnose({**base, "imbalance": True, "util_spread_pts": 12.0})["line"]
    assert "imbalanced" in diagnose({**base, "imbalance": True, "util_spread_pts": None})["line"]


def test_the_verdict_does_not_import_the_monitor():
    """diagnose reads plain numbers: importing it must load no part of the monitor (sampler, NVML)."""
    code = ("import sys, tuneledger.diagnose; "
            "bad = sorted(m for m in sys.modules if m.startswith('tuneledger.monitor') or m == 'pynvml'); "
            "sys.exit(' '.join(bad) or None)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, f"diagnose imports {proc.stderr.strip()}"


def test_empty_inputs_are_unknown():
    d = diagnose({})
    assert d["bottleneck"] == "unknown" and "unavailable" in d["line"] and not d["util_available"]


def test_thresholds_file_matches_the_code_defaults():
    # configs/diagnosis.yaml documents the defaults; they must not drift apart
    assert load_thresholds(ROOT / "configs" / "diagnosis.yaml") == DiagnosisThresholds()


def test_thresholds_default_path(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert load_thresholds() == DiagnosisThresholds()  # no configs/ here: the defaults
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "diagnosis.yaml").write_text("compute_util_pct: 95\n")
    assert load_thresholds().compute_util_pct == 95


def test_thresholds_errors(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text("compute_util: 95\n")
    with pytest.raises(ConfigError, match="compute_util"):
        load_thresholds(p)
    p.write_text("host_util_pct: 95\n")
    with pytest.raises(ConfigError, match="must not exceed"):
        load_thresholds(p)
    p.write_text("memory_frac: 1.5\n")
    with pytest.raises(ConfigError, match="memory_frac"):
        load_thresholds(p)
    with pytest.raises(ConfigError, match="not found"):
        load_thresholds(tmp_path / "nope.yaml")


def test_a_stricter_threshold_changes_the_verdict():
    inputs = {"util_mean_pct": 92, "mem_peak_frac": 0.833, "allreduce_share": 0.02, "data_wait_share": 0.01}
    assert diagnose(inputs)["bottleneck"] == "compute-bound"
    assert diagnose(inputs, DiagnosisThresholds(memory_frac=0.8))["bottleneck"] == "memory-bound"


def test_monitor_window_to_verdict():
    """What the dry-run does: join the monitor samples of a preset's window, then diagnose."""
    rows = read_rows(FIX / "monitor_2xh200_synthetic.csv")
    verdicts = {}
    for name, start, end, mb, gc in (("A", "2026-11-29T10:00:30Z", "2026-11-29T10:02:25Z", 1, True),
                                     ("D", "2026-11-29T10:02:30Z", "2026-11-29T10:04:25Z", 8, False)):
        w = summarize_window(rows, start, end)
        verdicts[name] = diagnose({"util_mean_pct": w["util_mean_pct"], "mem_peak_frac": w["mem_peak_frac"],
                                   "allreduce_share": 0.03, "data_wait_share": 0.01, "micro_batch": mb,
                                   "gradient_checkpointing": gc, "imbalance": w["imbalance"],
                                   "util_spread_pts": w["util_spread_pts"]})["bottleneck"]
    assert verdicts == {"A": "host-bound", "D": "compute-bound"}


def test_allocator_cache_is_not_memory_pressure():
    """Preset D on one H200 (bench/results/h200-2026-11-30-scaling): 69 GiB allocated, 130 GiB
    reserved by the caching allocator (packed batches of varying length fragment it), GPU 90%
    busy. The dry-run first called this memory-bound and advised GC on; the run needed half the
    GPU. The verdict reads allocated memory; the samples are that window's NVML rows."""
    from tuneledger.dryrun_row import verdict

    row = {"window_utc": ["2026-11-30T03:14:41.968599+00:00", "2026-11-30T03:14:50.488185+00:00"],
           "memory_mib": [{"rank": 0, "gpu": "NVIDIA H200", "peak_allocated": 70908, "peak_reserved": 132762}],
           "s_per_step": 1.421, "micro_batch": 8, "gradient_checkpointing": False, "mfu": 0.273,
           "split": {"allreduce_s": 0.0, "sync_wait_s": 0.0, "data_wait_s": 0.0332}}
    v = verdict(row, read_rows(FIX / "monitor_1xh200_preset_d.csv"), nproc=1)
    assert abs(v["diagnosis_inputs"]["mem_peak_frac"] - 70908 / 143771) < 1e-3
    assert v["diagnosis"]["bottleneck"] == "compute-bound"
    assert v["gpu_window"]["util_mean_pct"] >= 75


def test_a_cpu_run_is_not_sent_to_the_gpu_monitor():
    """Issue 21 (18): a CPU dry-run's verdict advised `tuneledger monitor`, which samples GPUs."""
    base = {"util_mean_pct": None, "mem_peak_frac": None, "allreduce_share": 0.05, "data_wait_share": 0.01,
            "micro_batch": 1, "gradient_checkpointing": True, "mfu": 0.001}
    assert "tuneledger monitor" in diagnose(base)["lever"]  # GPUs without NVML samples: the monitor measures them
    cpu = diagnose({**base, "on_cpu": True})
    assert cpu["bottleneck"] == "unknown" and not cpu["inferred"]
    assert "monitor" not in cpu["lever"] + cpu["line"] and "GPUs that will train" in cpu["lever"]
    assert "a CPU run" in cpu["line"]
    # What a CPU run does measure still counts.
    assert diagnose({**base, "on_cpu": True, "data_wait_share": 0.5})["bottleneck"] == "input-bound"


def test_the_dryrun_passes_a_cpu_run_to_the_verdict():
    from tuneledger.dryrun_row import verdict

    row = {"window_utc": ["2026-01-01T00:00:00+00:00", "2026-01-01T00:01:00+00:00"], "memory_mib": [{"peak_allocated": None}],
           "split": {"allreduce_s": 0.1, "sync_wait_s": 0.0, "data_wait_s": 0.0}, "s_per_step": 4.0,
           "micro_batch": 1, "gradient_checkpointing": True, "mfu": 0.0001}
    v = verdict(row, [], nproc=2, cpu=True)
    assert v["diagnosis_inputs"]["on_cpu"] is True and "monitor" not in v["diagnosis"]["lever"]


def test_a_host_bound_verdict_names_the_opt_in_levers_the_run_could_take():
    from tuneledger.diagnose import untried_levers

    levers = {"fused_lora": "on (196 projections)", "compile": "on (28 decoder layers, regional)"}
    qlora = {"grouped_lora": False, "absmax_once": False, "drop_padding_mask": False, "lora_dropout": 0.0,
             "quantization_bit": 4, "double_quantization": True, "fsdp": None}
    c = {"config": qlora, "model": {"levers": levers}, "gradient_checkpointing": False, "packing": False}
    assert untried_levers(c) == ["grouped_lora=true", "absmax_once=true", "drop_padding_mask=true"]
    # What each lever needs: dropout 0 and no checkpoint inside compiled layers; double-quantized 4-bit
    # weights, unsharded; padded rows. One already on is not named again.
    assert untried_levers({**c, "config": {**qlora, "lora_dropout": 0.05}})[0] == "absmax_once=true"
    assert "grouped_lora=true" not in untried_levers({**c, "gradient_checkpointing": True})
    assert "grouped_lora=true" in untried_levers({**c, "gradient_checkpointing": True,
                                                  "model": {"levers": {**levers, "compile": "off"}}})
    assert untried_levers({**c, "config": {**qlora, "fsdp": "full_shard", "double_quantization": True}}) == [
        "grouped_lora=true", "drop_padding_mask=true"]
    assert untried_levers({**c, "packing": True, "config": {**qlora, "quantization_bit": None},
                           "model": {"levers": {**levers, "grouped_lora": "on (56 groups of 140 projections)"}}}) == []
    # Unset (on where it applies, since 2026-12-06): what the levers line says ran is what counts.
    ran = {**levers, "grouped_lora": "on (56 groups)", "absmax_once": "on (196 weights)", "drop_padding_mask": "on (right padding)"}
    unset = {**qlora, "grouped_lora": None, "absmax_once": None, "drop_padding_mask": None}
    assert untried_levers({**c, "config": unset, "model": {"levers": ran}}) == []
    # A lever that said why it could not apply (auto) is not suggested: true would be refused or do nothing.
    cannot = {**ran, "grouped_lora": "off (no q/k/v or gate/up with LoRA on all its projections)",
              "drop_padding_mask": "off (padding on the left: the mask is needed)"}
    assert untried_levers({**c, "config": unset, "model": {"levers": cannot}}) == []
    assert untried_levers({**c, "config": unset, "model": {"levers": {**ran, "absmax_once": "off"}}}) == ["absmax_once=true"]
    nested = {**ran, "absmax_once": "off", "nf4_kernel": "on (Triton NF4 dequantization, bitsandbytes' bits; "
              "double quantization's scales in the same kernel)"}
    assert untried_levers({**c, "config": unset, "model": {"levers": nested}}) == []  # measured slower there
    assert untried_levers({}) == []
    host = {"util_mean_pct": 59, "mem_peak_frac": 0.22, "allreduce_share": 0.0, "data_wait_share": 0.01,
            "micro_batch": 2, "gradient_checkpointing": False, "mfu": 0.196}
    d = diagnose({**host, "untried_levers": untried_levers(c)})
    assert d["bottleneck"] == "host-bound"
    assert "`tuneledger tune --levers grouped_lora=true+absmax_once=true+drop_padding_mask=true`" in d["lever"]
    assert "launch levers" in d["lever"] and "launch levers" not in diagnose(host)["lever"]


def test_a_memory_bound_verdict_names_swiglu_recompute_before_checkpointing():
    """Without checkpointing, a run whose LoRA projections are fused could keep one [tokens,
    intermediate] tensor per layer less (swiglu_recompute) before paying checkpointing's recompute;
    with checkpointing on, or the lever on, or no fused projection, it is not named."""
    from tuneledger.diagnose import memory_levers

    row = {"config": {"swiglu_recompute": False}, "model": {"levers": {"fused_lora": "on (196 projections)"}},
           "gradient_checkpointing": False}
    assert memory_levers(row) == ["swiglu_recompute=true"]
    # with checkpointing on: the layer inputs it keeps could wait in host memory (use_unsloth_gc)
    assert memory_levers({**row, "gradient_checkpointing": True}) == ["use_unsloth_gc=true"]
    assert memory_levers({**row, "gradient_checkpointing": True, "config": {"fsdp": "full_shard auto_wrap"}}) == []
    assert memory_levers({**row, "gradient_checkpointing": True,
                          "model": {"levers": {"use_unsloth_gc": "on (the inputs of 28 checkpointed layers ...)"}}}) == []
    gc_on = diagnose({"util_mean_pct": 96, "mem_peak_frac": 0.95, "micro_batch": 1, "gradient_checkpointing": True,
                      "memory_levers": ["use_unsloth_gc=true"]})
    assert gc_on["lever"].startswith("use_unsloth_gc=true (the checkpointed layers' inputs wait in pinned host memory")
    assert "8.6 -> 8.2 GiB" in gc_on["lever"]  # its measured cost, not a promise
    ran = {"fused_lora": "on (196 projections)", "swiglu_recompute": "on (28 MLPs: h = silu(gate) x up remade in backward)"}
    assert memory_levers({**row, "model": {"levers": ran}}) == []  # on (asked, or auto): nothing to name
    assert memory_levers({**row, "model": {"levers": {"fused_lora": "off"}}}) == []
    assert memory_levers({}) == []
    full = {"util_mean_pct": 96, "mem_peak_frac": 0.95, "allreduce_share": 0.0, "data_wait_share": 0.0,
            "micro_batch": 8, "gradient_checkpointing": False}
    d = diagnose({**full, "memory_levers": memory_levers(row)})
    assert d["bottleneck"] == "memory-bound"
    assert d["lever"].startswith("swiglu_recompute=true (one [tokens, intermediate] tensor per layer less")
    assert d["lever"].index("swiglu_recompute") < d["lever"].index("gradient checkpointing on")
    assert "swiglu_recompute" not in diagnose(full)["lever"]
