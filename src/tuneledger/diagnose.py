"""The bottleneck verdict: one line saying what limits a run, and the lever that fits.

`diagnose(inputs, thresholds)` is a pure function of numbers the dry-run already measures over its
steady window (all optional; None = not measured):

    util_mean_pct          GPU utilisation, %: mean over GPUs of each GPU's mean (NVML, via
                           monitor.summary.summarize_window); None without NVML (CPU runs, containers)
    mem_peak_frac          max over ranks of peak allocated memory (torch) / total GPU memory, 0-1
    allreduce_share        (exposed all-reduce + sync wait) s / s_per_step, 0-1
    data_wait_share        data wait s / s_per_step, 0-1
    micro_batch            per-device micro-batch
    gradient_checkpointing bool
    mfu                    model FLOPs utilisation, 0-1 (ledger.mfu)
    imbalance, util_spread_pts   from monitor.summary.summarize_window, to name a slow rank
                           (a spread above imbalance_util_pts counts as imbalance)
    untried_levers         launch levers (on by default where they apply) this run ran without and
                           could take ("key=true", untried_levers):
                           named in a host-bound verdict's lever
    memory_levers          memory levers off that this run could take (memory_levers): named
                           first in a memory-bound verdict's lever, before checkpointing's recompute
    on_cpu                 a CPU run (gloo): there is no GPU to measure, so only rules 1 and 2
                           apply, and the lever of "unknown" is a dry-run on the GPUs, not the
                           monitor (it samples GPUs: on a CPU it has nothing to measure)

Rules, first match wins (time that is measured as lost outranks what utilisation suggests):
  1. allreduce_share >= comm_share           -> communication-bound
  2. data_wait_share >= data_wait_share      -> input-bound
  3. mem_peak_frac >= memory_frac            -> memory-bound
  4. util >= compute_util_pct                -> compute-bound
  5. host_util_pct <= util < compute_util_pct-> compute-bound, mostly (some gaps between kernels)
  6. util < host_util_pct                    -> host-bound (the GPU idles and nothing measured
                                                explains it: it waits on the host between kernels)
  7. util unknown: mfu < host_mfu and micro_batch <= host_micro_batch -> host-bound (inferred);
     otherwise unknown.
Communication comes first because NVML counts NCCL kernels as busy: a step that spends a fifth
of its time in all-reduce can still read 95% utilisation.

Thresholds live in configs/diagnosis.yaml (`load_thresholds`), with the reasoning for each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tuneledger.config import NF4_NESTED_LINE, ConfigError, absmax_once_applies
from tuneledger.config_load import read_yaml_mapping

DEFAULT_PATH = Path("configs/diagnosis.yaml")
# GPUs whose mean utilisation differs by more than this many points in one window are flagged as
# imbalanced. Under DDP every rank runs the same work and waits for the others at each all-reduce,
# so their utilisation should match; a spread this large means one GPU is slower (throttled,
# shared with another process, on a slower link) and holds the others at every sync. 15 points is
# a judgement, well above the difference of a few points expected between identical ranks: check
# it against the device runs. The default of DiagnosisThresholds.imbalance_util_pts and of
# monitor.summary.summarize_window.
IMBALANCE_UTIL_PTS = 15.0

BOTTLENECKS = ("compute-bound", "memory-bound", "communication-bound", "input-bound", "host-bound", "unknown")


class DiagnosisThresholds(BaseModel):
    """Where each verdict starts. The reasoning is in configs/diagnosis.yaml next to each value."""

    model_config = ConfigDict(extra="forbid")

    # util >= this: the GPU always has a kernel running. Saturated runs read 92% (H200, micro-batch
    # 8) and 93-97% (field report, 4090s); host-starved ones 25-60%.
    compute_util_pct: float = Field(90.0, ge=0, le=100)
    # util < this with nothing measured to explain it: host-bound. 75 sits between the highest
    # host-starved reading (60%, preset C + liger on an H200) and the lowest near-saturated (85%,
    # packed micro-batch 8).
    host_util_pct: float = Field(75.0, ge=0, le=100)
    # peak / total >= this: no room to grow the micro-batch, and a longer batch than the dry-run
    # drew may run out of memory (the allocator's cache and fragmentation need the rest).
    memory_frac: float = Field(0.90, gt=0, le=1)
    # Exposed all-reduce + sync wait share of a step: removing it buys at most 1 / (1 - share),
    # 1.25x at 20%; below that the other levers are worth more.
    comm_share: float = Field(0.20, gt=0, le=1)
    # Data wait share: worth fixing sooner (more workers is cheap); 10% = up to 1.11x.
    data_wait_share: float = Field(0.10, gt=0, le=1)
    # Only without utilisation: MFU under this at a small micro-batch suggests host-bound. Plain
    # HF QLoRA on an H200 measured 5.8-11.8% at micro-batch 1-2 (host-starved) and 24.5% at 8.
    host_mfu: float = Field(0.15, gt=0, le=1)
    host_micro_batch: int = Field(2, ge=1)
    # Ranks whose mean utilisation differs by more points are flagged imbalanced (IMBALANCE_UTIL_PTS).
    imbalance_util_pts: float = Field(IMBALANCE_UTIL_PTS, gt=0, le=100)

    @model_validator(mode="after")
    def _ordered(self) -> DiagnosisThresholds:
        if self.host_util_pct > self.compute_util_pct:
            raise ValueError(f"host_util_pct ({self.host_util_pct}) must not exceed compute_util_pct ({self.compute_util_pct})")
        return self


def load_thresholds(path: str | Path | None = None) -> DiagnosisThresholds:
    """Thresholds from a YAML file. path None: configs/diagnosis.yaml if it exists here, else the
    defaults. Raises ConfigError for a missing explicit file, unknown keys or bad values."""
    if path is None:
        if not DEFAULT_PATH.exists():
            return DiagnosisThresholds()
        path = DEFAULT_PATH
    raw = read_yaml_mapping(path, "thresholds")
    try:
        return DiagnosisThresholds(**raw)
    except ValidationError as e:
        lines = [f"{'.'.join(map(str, err['loc'])) or '-'}: {err['msg']}" for err in e.errors()]
        raise ConfigError(f"{path}: invalid thresholds:\n  " + "\n  ".join(lines)) from None


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def diagnose(inputs: dict, thresholds: DiagnosisThresholds | None = None) -> dict:
    """The bottleneck of one run from its steady-window numbers (module doc: inputs and rules).

    Returns {"bottleneck": one of BOTTLENECKS, "line": the verdict in one line with its numbers,
    "lever": what to change, "util_available": bool, "inferred": True when the verdict rests on
    MFU because utilisation was not measured}.
    """
    t = thresholds or DiagnosisThresholds()
    util = inputs.get("util_mean_pct")
    mem = inputs.get("mem_peak_frac")
    comm = inputs.get("allreduce_share")
    data = inputs.get("data_wait_share")
    mb = inputs.get("micro_batch")
    gc = inputs.get("gradient_checkpointing")
    mfu = inputs.get("mfu")
    spread = inputs.get("util_spread_pts")
    # The spread is measured; whether it is an imbalance is this verdict's threshold (a summary's own
    # flag used the default). Without a spread, take the flag as given.
    imbalance = spread > t.imbalance_util_pts if spread is not None else bool(inputs.get("imbalance"))

    cpu = bool(inputs.get("on_cpu"))
    facts = [f"GPU util {util:.0f}%" if util is not None else
             "a CPU run: no GPU util" if cpu else "GPU util unavailable (no NVML samples)",
             f"memory peak {_pct(mem)} of the GPU", f"all-reduce + sync {_pct(comm)} of a step",
             f"data wait {_pct(data)}"]
    if mb is not None:
        facts.append(f"micro-batch {mb}")
    if gc is not None:
        facts.append(f"GC {'on' if gc else 'off'}")
    if mfu is not None:
        facts.append(f"MFU {mfu:.1%}")
    if imbalance:
        facts.append(f"util imbalanced across GPUs ({spread:.0f} points)" if spread is not None else "util imbalanced across GPUs")
    room = mem is not None and mem < 0.6
    mem_note = f"peak memory {_pct(mem)} leaves room" if room else "if memory allows"
    inferred = False

    if comm is not None and comm >= t.comm_share:
        kind = "communication-bound"
        why = f"all-reduce and sync wait take {comm:.0%} of each step (>= {t.comm_share:.0%})"
        lever = ("fewer syncs (a bigger micro-batch or more accumulation per all-reduce) or bigger DDP buckets "
                 "(bucket_cap_mb); check the link with `nvidia-smi topo -m` (NVLink or PCIe, P2P on)")
        if imbalance:
            lever = "first find the slow GPU (util is imbalanced: the others wait for it at every sync); then " + lever
    elif data is not None and data >= t.data_wait_share:
        kind = "input-bound"
        why = f"each step waits {data:.0%} of its time for data (>= {t.data_wait_share:.0%})"
        lever = "more dataloader workers (dataloader_num_workers), pin_memory, and the pre-tokenized cache"
    elif mem is not None and mem >= t.memory_frac:
        kind = "memory-bound"
        why = f"peak memory is {mem:.0%} of the GPU (>= {t.memory_frac:.0%}): no room for a bigger batch, little margin"
        levers = [f"{k} ({MEMORY_LEVER_WHY.get(k, 'docs/speed.md')})" for k in inputs.get("memory_levers") or []]
        if gc is False:
            levers.append("gradient checkpointing on")
        if mb is None or mb > 1:
            levers.append("a smaller micro-batch (accumulation keeps the global batch)")
        if not levers:
            levers.append("GC is on and micro-batch is 1: a shorter cutoff_len, a lower LoRA rank, or a GPU with more memory")
        lever = ", or ".join(levers) + "; what is live at the peak: TUNELEDGER_MEMORY_STEP=2 (docs/speed.md)"
    elif util is not None and util >= t.compute_util_pct:
        kind = "compute-bound"
        why = f"the GPU is busy {util:.0f}% of the time (>= {t.compute_util_pct:.0f}%) with memory to spare"
        lever = ("packing (no pad tokens) or fused kernels (fused cross-entropy, no fp32 upcast of frozen weights); "
                 "turning gradient checkpointing off buys little here (about 5% in the field report)")
    elif util is not None and util >= t.host_util_pct:
        kind = "compute-bound"
        why = (f"the GPU is busy {util:.0f}% of the time (between {t.host_util_pct:.0f}% and {t.compute_util_pct:.0f}%): "
               "mostly compute, with some gaps between kernels")
        lever = (f"packing or fused kernels for the compute; a bigger micro-batch ({mem_note}) or compiled steps "
                 "for the remaining gaps")
    elif util is not None:
        kind = "host-bound"
        why = (f"the GPU is busy only {util:.0f}% of the time (< {t.host_util_pct:.0f}%) and neither data wait nor "
               "all-reduce explains it: it idles between many small kernels the host launches")
        lever = _host_lever(mb, gc, mem_note, inputs.get("untried_levers"))
    elif cpu and util is None:
        # A CPU's step time says nothing of a GPU's bottleneck (MFU here is against no GPU's peak).
        kind = "unknown"
        why = "a CPU run measures no GPU, and neither all-reduce nor data wait is above its threshold"
        lever = "dry-run on the GPUs that will train for a verdict (make dryrun there)"
    elif mfu is not None and mb is not None and mfu < t.host_mfu and mb <= t.host_micro_batch:
        kind, inferred = "host-bound", True
        why = (f"GPU util unavailable; MFU {mfu:.1%} < {t.host_mfu:.0%} at micro-batch {mb} with no data wait or "
               "all-reduce to explain it suggests the GPU idles between small kernels (inferred)")
        lever = _host_lever(mb, gc, mem_note, inputs.get("untried_levers")) + "; confirm with `tuneledger monitor` alongside"
    else:
        kind = "unknown"
        why = ("GPU util unavailable and no measured share (all-reduce, data wait, memory) above its threshold"
               if util is None else "no rule matched")
        lever = "run on GPUs with NVML (or `tuneledger monitor` alongside) so utilisation is measured"
    return {"bottleneck": kind, "line": f"{kind}: {why} [{'; '.join(facts)}]", "lever": lever,
            "util_available": util is not None, "inferred": inferred}


def _host_lever(mb: Any, gc: Any, mem_note: str, untried: list[str] | None = None) -> str:
    levers = [f"a bigger micro-batch{f' than {mb}' if mb is not None else ''} ({mem_note})", "packing"]
    if gc:
        levers.append("gradient checkpointing off (recomputation repeats the launches: 1.7-1.9x per step on an H200)")
    if untried:
        # Fewer launches per step, the same loss; measured together on preset C (docs/measurements.md).
        levers.append(f"the launch levers {' '.join(untried)} (off in this run; grouped_lora, absmax_once and drop_padding_mask together: "
                      f"preset C +53% on an H100; `tuneledger tune --levers {'+'.join(untried)}` measures them here)")
    levers.append("compiled or CUDA-graphed steps")
    return ", ".join(levers[:-1]) + ", or " + levers[-1]


MEMORY_LEVER_WHY = {  # what a memory-bound verdict says of each lever it names
    "swiglu_recompute=true": "one [tokens, intermediate] tensor per layer less kept for backward: D 33.3 -> 27.7 GiB "
                             "for 1% of the step on an H100, docs/speed.md",
    "use_unsloth_gc=true": "the checkpointed layers' inputs wait in pinned host memory until backward, two PCIe "
                           "copies a layer: B 8.6 -> 8.2 GiB for about 30% of its tokens/s on an H200, docs/speed.md",
}


def memory_levers(row: dict) -> list[str]:
    """The memory levers (docs/speed.md) that a dry-run row ran without and could take, as
    "key=true": swiglu_recompute where the LoRA projections are fused and checkpointing is off
    (with it on, a layer's activations are remade anyway) but it did not run (set false, or a
    ledger from before it was on where it applies); use_unsloth_gc where checkpointing is on,
    the base is not sharded (FSDP) and it did not run. [] when none."""
    levers = (row.get("model") or {}).get("levers") or {}
    if (not str(levers.get("swiglu_recompute", "")).startswith("on") and row.get("gradient_checkpointing") is False
            and str(levers.get("fused_lora", "")).startswith("on")):
        return ["swiglu_recompute=true"]
    if (row.get("gradient_checkpointing") is True and not (row.get("config") or {}).get("fsdp")
            and not str(levers.get("use_unsloth_gc", "")).startswith("on")):
        return ["use_unsloth_gc=true"]
    return []


def untried_levers(row: dict) -> list[str]:
    """The launch levers (docs/speed.md; on where they apply since 2026-12-06) that a dry-run row
    ran without and could take, as "key=true", from its config and its `model.levers` line (a
    lever runs when its line starts with "on"; a ledger from before names none): absmax_once
    (double-quantized 4-bit weights, not sharded, and not where the NF4 kernel rebuilt their scales), drop_padding_mask (padded rows), grouped_lora
    (lora_dropout 0, the fused LoRA projection on, and no checkpointing inside compiled layers).
    A lever whose line says "off (why)" could not apply and is not named. [] when none."""
    cfg, levers = row.get("config") or {}, (row.get("model") or {}).get("levers") or {}
    compiled = str(levers.get("compile", "")).startswith("on")

    def ran(key: str) -> bool:
        # "off" (set false) or absent (a ledger from before): could run. "on ..." ran; "off (why)"
        # is the lever's own verdict that it cannot apply here (left padding, no q/k/v group, ...).
        line = str(levers.get(key, ""))
        return line.startswith("on") or line.startswith("off (")

    out = []
    if (not ran("grouped_lora") and cfg.get("lora_dropout") == 0 and ran("fused_lora")
            and not (row.get("gradient_checkpointing") and compiled)):
        out.append("grouped_lora=true")
    # Where our NF4 kernel rebuilt the 8-bit scales in its own launch, absmax_once measured slower
    # (bench/results/h200-2026-12-07-call1): not a lever to try there.
    nested = NF4_NESTED_LINE in str(levers.get("nf4_kernel", ""))
    if (not ran("absmax_once") and not nested
            and absmax_once_applies(cfg.get("quantization_bit"), cfg.get("double_quantization"), cfg.get("fsdp"))):
        out.append("absmax_once=true")
    if not ran("drop_padding_mask") and row.get("packing") is False:
        out.append("drop_padding_mask=true")
    return out
