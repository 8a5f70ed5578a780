"""Where one step's time goes: TUNELEDGER_PROFILE_STEP=N profiles step N of a train or dry-run
with torch.profiler and writes `profile-step<N>.json` and `.md` into the run's output dir.

The table splits the step's wall time by what the GPU ran (kernel time by category: all-reduce, matmul,
attention, dequant, fused Triton, elementwise, optimizer, other) and the share it ran nothing
(idle); beside it the host side: kernel launches, host-device syncs, and the CPU ops with the
most self time. The profiler slows the host a little (its own bookkeeping per op, and since
2026-12-06 each op's input shapes: the copy table), so read the idle share as an upper bound, and
the step's s/step from the dry-run's own (unprofiled) steps.
"""

from __future__ import annotations

import bisect
import json
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

# Kernel name fragments, first match wins (lower case). Matmuls: cuBLAS/cuBLASLt/CUTLASS names.
CATEGORIES = (
    ("all-reduce", ("nccl",)),
    ("dequant", ("dequant",)),  # bitsandbytes' kDequantizeBlockwise, our nf4_dequant, Unsloth's _nf4_dequant_kernel
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("optimizer", ("multi_tensor_apply", "adam", "fused_adam")),
    ("matmul", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_", "splitk")),
    ("fused Triton", ("triton", "liger")),
    ("elementwise", ("at::native", "elementwise", "vectorized", "reduce", "copy", "fill", "index", "scatter", "gather")),
    ("fused Triton", ("_kernel",)),  # Liger's own kernel names (_rms_norm_forward_kernel, ...)
)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")  # + cudaMemcpyAsync
# The leaf op only: .contiguous() and clone() call copy_, and would count each copy three times.
COPY_OPS = ("aten::copy_",)
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
GAP_US = 50.0  # a pause between kernels shorter than this is launch latency, not waiting on the host


def category(kernel: str) -> str:
    """The CATEGORIES name of a CUDA kernel, or "other"."""
    k = kernel.lower()
    for name, parts in CATEGORIES:
        if any(p in k for p in parts):
            return name
    return "other"


def summarize(events: list[dict], wall_s: float, top: int = 15) -> dict:
    """One step's split. events: {"name", "kind" ("kernel" | "runtime" | "cpu_op"), "dur_us",
    "self_us"}; wall_s: the step's wall time (s). Returns {"wall_s", "kernel_s", "categories":
    {name: s}, "idle_s", "idle_share", "launches", "syncs", "sync_calls": {runtime call: count},
    "top_cpu_ops": [(name, self s, calls)], "top_kernels": [(category, name, GPU s, calls)],
    "copies": [(op and its input shapes, calls)], "sync_origins": [(runtime call < the ops around
    it, calls)]}: aten::copy_ calls by input shapes (an event's optional "shapes", from a profile
    with record_shapes; every copy, host and device) and by the ops they ran in (its optional
    "origin"), to find where device copies come from; the host syncs likewise by origin, to find
    which op waits on the GPU. Every cudaMemcpy and cudaMemcpyAsync counts (a copy to the
    host waits; the profiler does not say which way a copy went); sync_calls tells the kinds apart.
    Kernel time is a sum over kernels, so on one stream it is the time the GPU was busy.
    With start times (a kernel's and a launch's optional "start_us") also "gaps": idle_gaps()."""
    cats: dict[str, float] = {}
    launches = syncs = 0
    sync_calls: dict[str, int] = {}
    ops: dict[str, list] = {}
    kernels: dict[str, list] = {}
    copies: dict[str, int] = {}
    origins: dict[str, int] = {}
    for e in events:
        if e["kind"] == "kernel":
            c = category(e["name"])
            cats[c] = cats.get(c, 0.0) + e["dur_us"] / 1e6
            k = kernels.setdefault(e["name"], [0.0, 0])
            k[0] += e["dur_us"] / 1e6
            k[1] += 1
        elif e["kind"] == "runtime":
            launches += e["name"].startswith(LAUNCH_CALLS)
            if e["name"].startswith(SYNC_CALLS):
                syncs += 1
                sync_calls[e["name"]] = sync_calls.get(e["name"], 0) + 1
                key = f"{e['name']} < {e['origin']}" if e.get("origin") else e["name"]
                origins[key] = origins.get(key, 0) + 1
        else:
            if e["name"] in COPY_OPS:
                key = f"{e['name']} {e.get('shapes', '')}".strip() + (f" < {e['origin']}" if e.get("origin") else "")
                copies[key] = copies.get(key, 0) + 1
            o = ops.setdefault(e["name"], [0.0, 0])
            o[0] += e["self_us"] / 1e6
            o[1] += 1
    kernel_s = sum(cats.values())
    idle = max(0.0, wall_s - kernel_s)
    return {"wall_s": wall_s, "kernel_s": kernel_s, "categories": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
            "idle_s": idle, "idle_share": idle / wall_s if wall_s else 0.0, "launches": launches, "syncs": syncs,
            "sync_calls": dict(sorted(sync_calls.items(), key=lambda kv: -kv[1])),
            "top_cpu_ops": sorted(((n, s, c) for n, (s, c) in ops.items()), key=lambda t: -t[1])[:top],
            # Which kernels a category's time is: two engines' tables compare kernel by kernel.
            "top_kernels": sorted(((category(n), n, s, c) for n, (s, c) in kernels.items()), key=lambda t: -t[2])[:top],
            "copies": sorted(copies.items(), key=lambda kv: -kv[1])[:top],
            "sync_origins": sorted(origins.items(), key=lambda kv: -kv[1])[:top],
            "gaps": idle_gaps(events, top)}


def idle_gaps(events: list[dict], top: int = 15) -> dict:
    """Where the GPU waited on the host: every pause of GAP_US or more between one kernel's end
    (the latest end so far, any stream) and the next kernel's start, charged to the launch that
    ended it (the last launch call that began before that kernel: with the queue empty, the
    kernel starts a few µs after its launch) and the ops around that launch (its "origin").
    events: summarize()'s, kernels and launches with "start_us". Returns {"count", "total_s",
    "by_origin": [(origin, gap s, gaps)]}, the most waited-on first; zeros without start times."""
    kernels = sorted((e["start_us"], e["start_us"] + e["dur_us"]) for e in events
                     if e["kind"] == "kernel" and "start_us" in e)
    launches = sorted((e["start_us"], e.get("origin") or e["name"]) for e in events
                      if e["kind"] == "runtime" and "start_us" in e and e["name"].startswith(LAUNCH_CALLS))
    starts = [t for t, _ in launches]
    by: dict[str, list] = {}
    count, total, end = 0, 0.0, None
    for k0, k1 in kernels:
        if end is not None and k0 - end >= GAP_US:
            i = bisect.bisect_right(starts, k0) - 1
            key = launches[i][1] if i >= 0 else "(no launch recorded)"
            b = by.setdefault(key, [0.0, 0])
            b[0] += (k0 - end) / 1e6
            b[1] += 1
            count, total = count + 1, total + (k0 - end) / 1e6
        end = k1 if end is None else max(end, k1)
    return {"count": count, "total_s": total,
            "by_origin": sorted(((o, s, c) for o, (s, c) in by.items()), key=lambda t: -t[1])[:top]}


def markdown(s: dict, step: int) -> str:
    """The table of summarize()'s result, in ms and shares of the step."""
    w = s["wall_s"]
    if not s["kernel_s"] and not s["launches"]:  # a CPU run: no GPU timeline, so "idle" would mean nothing
        lines = [f"step {step}: {w * 1e3:.0f} ms wall (profiled), no GPU kernels (a CPU run): where the time went "
                 "is the CPU ops below"]
    else:
        lines = [f"step {step}: {w * 1e3:.0f} ms wall (profiled), GPU kernels {s['kernel_s'] * 1e3:.0f} ms, "
                 f"idle {s['idle_share']:.0%}; {s['launches']:,} kernel launches, {s['syncs']} host syncs"
                 + (" (" + ", ".join(f"{n} {c}" for n, c in s.get("sync_calls", {}).items()) + ")" if s.get("sync_calls") else ""),
                 "",
                 "| category | ms | share of the step |", "| --- | --- | --- |"]
        rows = list(s["categories"].items()) + [("idle", s["idle_s"])]
        lines += [f"| {name} | {sec * 1e3:.1f} | {sec / w:.1%} |" for name, sec in rows]
    lines += ["", "| CPU op (self time) | ms | calls |", "| --- | --- | --- |"]
    lines += [f"| {n[:80]} | {sec * 1e3:.1f} | {c} |" for n, sec, c in s["top_cpu_ops"]]
    if s.get("top_kernels"):
        lines += ["", "| GPU kernel | category | ms | calls |", "| --- | --- | --- | --- |"]
        lines += [f"| {n[:100]} | {cat} | {sec * 1e3:.1f} | {c} |" for cat, n, sec, c in s["top_kernels"]]
    if s.get("copies"):
        lines += ["", "| copy op (input shapes < the ops it ran in) | calls |", "| --- | --- |"]
        lines += [f"| {n[:200]} | {c} |" for n, c in s["copies"]]
    if s.get("sync_origins"):
        lines += ["", "| host sync (runtime call < the ops it ran in) | calls |", "| --- | --- |"]
        lines += [f"| {n[:200]} | {c} |" for n, c in s["sync_origins"]]
    g = s.get("gaps") or {}
    if g.get("count"):
        lines += ["", f"GPU waiting on the host: {g['count']:,} pauses of {GAP_US:.0f} µs or more between kernels, "
                  f"{g['total_s'] * 1e3:.1f} ms in all, by the launch that ended each (the profiler's own host "
                  "time lengthens them):", "",
                  "| launch that ended the pause (< the ops it ran in) | ms | pauses |", "| --- | --- | --- |"]
        lines += [f"| {o[:200]} | {sec * 1e3:.1f} | {c} |" for o, sec, c in g["by_origin"]]
    return "\n".join(lines) + "\n"


def save(s: dict, stem: Path, step: int) -> str:
    """Write summarize()'s result `s` to `<stem>.json` and its table (markdown) to `<stem>.md`;
    returns the table."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(s, indent=1))
    md = markdown(s, step)
    stem.with_suffix(".md").write_text(md)
    return md


def origin(e: Any, depth: int = 3) -> str:
    """The ops a profiler event ran in, innermost first ("aten::item < aten::max < ..."), up to
    `depth` of them; "" at the top level."""
    names = []
    p = getattr(e, "cpu_parent", None)
    while p is not None and len(names) < depth:
        names.append(p.name)
        p = getattr(p, "cpu_parent", None)
    return " < ".join(names)


def events(prof: Any) -> list[dict]:
    """summarize()'s events from a finished torch.profiler.profile."""
    out = []
    for e in prof.events():
        kind = str(getattr(e, "device_type", "")).lower()
        if "cuda" in kind and (getattr(e, "is_user_annotation", False) or e.name.startswith("## ")):
            # A range on the GPU's timeline (torch 2.11 marks each compiled graph's call there, "## Call
            # CompiledFxGraph ... ##"), not a kernel: counted, it doubled Unsloth's C kernel time.
            continue
        if "cuda" in kind:
            d = {"name": e.name, "kind": "kernel", "dur_us": e.time_range.elapsed_us(), "self_us": 0.0}
            if getattr(e.time_range, "start", None) is not None:
                d["start_us"] = e.time_range.start
            out.append(d)
        elif e.name.startswith(("cuda", "cu")) and not e.name.startswith("cudnn"):
            d = {"name": e.name, "kind": "runtime", "dur_us": e.cpu_time, "self_us": e.self_cpu_time_total}
            if e.name.startswith(SYNC_CALLS) or e.name.startswith(LAUNCH_CALLS):
                d["origin"] = origin(e)
            if e.name.startswith(LAUNCH_CALLS) and getattr(getattr(e, "time_range", None), "start", None) is not None:
                d["start_us"] = e.time_range.start
            out.append(d)
        else:
            d = {"name": e.name, "kind": "cpu_op", "dur_us": e.cpu_time, "self_us": e.self_cpu_time_total}
            if e.name in COPY_OPS:
                if getattr(e, "input_shapes", None):
                    d["shapes"] = str(e.input_shapes)
                d["origin"] = origin(e, 2)
            out.append(d)
    return out


class StepProfile(TrainerCallback):
    """Profile optimizer step `step` (1-based) on rank 0; write the split into `out_dir`."""

    def __init__(self, step: int, out_dir: Path, rank: int = 0):
        self.step, self.out_dir, self.rank = step, Path(out_dir), rank
        self.prof = None

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step + 1 != self.step or self.rank != 0:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        self.cuda = torch.cuda.is_available()
        if self.cuda:
            torch.cuda.synchronize()
        self.prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else []),
                            record_shapes=True)
        self.prof.__enter__()
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        if self.prof is None:
            return
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        s = summarize(events(self.prof), wall)
        self.prof = None
        print(save(s, self.out_dir / f"profile-step{self.step}", self.step), flush=True)
