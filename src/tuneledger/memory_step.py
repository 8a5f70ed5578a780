"""Where one step's peak memory goes: TUNELEDGER_MEMORY_STEP=N records the CUDA caching allocator's
history over optimizer step N of a train or dry-run (rank 0) and writes `memory-step<N>.md` and
`.json` into the run's output dir, and `.pickle`, the snapshot itself, for pytorch.org/memory_viz.

Why: the dry-run's peak allocated says how much, not what. Two tools at the same micro-batch can
differ by a few hundred MiB (preset B against Unsloth's, docs/measurements.md), and what to cut
depends on what is live at the peak: kept activations, a dequantized weight, the loss's chunks,
gradients or the optimizer's state.

How: torch.cuda.memory._record_memory_history (Python stacks) from the step's start to the end of
its optimizer step. The history is replayed (an allocation counts from its 'alloc' to its
'free_requested', as torch's allocated-bytes statistic does) to find the step's peak, and what is
live then is summed by name. Blocks allocated before the step are named by the tensors that hold
them at the end (the model's 4-bit weights and their scales, frozen 16-bit weights, LoRA weights,
buffers, gradients, the optimizer's state); the step's own allocations still live at the end
likewise; the others by the code that made them: the innermost frame outside torch's own files
(inductor's generated code counts as "compiled"), or "no Python frame" (autograd's backward runs
in C++ threads). Recording costs about 2 µs per allocation (torch's figure), so a profiled warm-up
step keeps the measured ones clean.
"""

from __future__ import annotations

import json
import pickle
from collections import defaultdict
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

MAX_ENTRIES = 400_000  # allocator events kept, the latest; a step that makes more loses its start (the table says so)
TOP = 15  # rows of the step's own allocations, the rest summed
PACKAGES = ("tuneledger", "transformers", "peft", "liger_kernel", "bitsandbytes", "accelerate", "unsloth",
            "unsloth_zoo", "flash_attn")  # named from a source checkout too (outside site-packages)
BLOCK = 512  # the caching allocator's smallest block and its rounding (c10's kMinBlockSize)


def block_bytes(requested: int) -> int:
    """The bytes torch's allocated statistic counts for a request of `requested` bytes: rounded up to
    BLOCK (exact with expandable segments, the launcher's default; without them a large block can
    keep an unsplit remainder, which the end-of-step check shows)."""
    return max(BLOCK, -(-requested // BLOCK) * BLOCK)


def where(frames: list[dict]) -> tuple[str, str]:
    """(the code, its package) that made an allocation, from its frames (innermost first, as torch
    records them: {"filename", "line", "name"}): the innermost frame outside torch's own files."""
    if not frames:
        return "no Python frame (autograd's backward, or C++)", "-"
    for f in frames:
        path = f.get("filename", "")
        if "torchinductor" in path or path.startswith(("<eval_with_key", "<fx")):  # inductor's module; an fx graph
            return f"compiled code: {f.get('name', '?')}", "compiled"
        if path.startswith("<") or path.endswith(".c"):  # <frozen runpy>, <string>: Python's own
            continue
        parts = Path(path).parts
        site = max((i for i, p in enumerate(parts) if p in ("site-packages", "dist-packages")), default=None)
        if site is not None and site + 1 < len(parts):  # an installed package: the folder after site-packages
            pkg = parts[site + 1].removesuffix(".py")
            tail = "/".join(parts[site + 2:]) or parts[site + 1]
        elif any(p in PACKAGES for p in parts):  # a source checkout (src/tuneledger/...)
            i = max(i for i, p in enumerate(parts) if p in PACKAGES)
            pkg, tail = parts[i], "/".join(parts[i + 1:])
        else:  # the user's own script
            return f"{Path(path).name}:{f.get('line', '?')} {f.get('name', '?')}", Path(path).stem
        if pkg in ("torch", "functorch"):
            continue
        return f"{pkg}/{tail}:{f.get('line', '?')} {f.get('name', '?')}", pkg
    f = frames[0]
    return f"torch: {Path(f.get('filename', '?')).name}:{f.get('line', '?')} {f.get('name', '?')}", "torch"


def tensor_names(model: Any, optimizer: Any = None, device_type: str = "cuda") -> dict[int, str]:
    """{storage address: what holds it} for the tensors on `device_type` that a training step keeps
    across steps: the model's parameters (4-bit base weights, frozen 16- or 32-bit weights, trainable
    weights: LoRA's), the 4-bit weights' scales (their quant_state), buffers, gradients and the
    optimizer's state."""
    import torch

    names: dict[int, str] = {}

    def put(t: Any, label: str) -> None:
        try:
            if hasattr(t, "to_local"):  # a DTensor (preset F): the rank's shard
                t = t.to_local()
            if isinstance(t, torch.Tensor) and t.device.type == device_type:
                names.setdefault(t.untyped_storage().data_ptr(), label)
        except (RuntimeError, NotImplementedError, TypeError):  # a subclass without a storage of its own: unnamed
            pass

    params = list(model.parameters()) if model is not None else []
    for p in params:
        put(p.grad, "gradients")
    opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    for st in (getattr(opt, "state", None) or {}).values():
        for v in st.values():
            put(v, "optimizer state")
    for m in model.modules() if model is not None else ():
        qs = getattr(getattr(m, "weight", None), "quant_state", None)
        if qs is not None:  # bitsandbytes' QuantState; another quantizer's state has other fields
            state2 = getattr(qs, "state2", None)
            for t in (getattr(qs, "absmax", None), getattr(qs, "code", None), getattr(qs, "offset", None),
                      getattr(state2, "absmax", None), getattr(state2, "code", None)):
                put(t, "4-bit scales")
    for p in params:
        four_bit = type(p).__name__ == "Params4bit" or p.dtype == torch.uint8
        put(p, "trainable weights (LoRA)" if p.requires_grad else "4-bit base weights" if four_bit
            else f"frozen {8 * p.element_size()}-bit weights")
    for b in model.buffers() if model is not None else ():
        put(b, "buffers")
    return names


def _live_blocks(snapshot: dict, device: int) -> dict[int, int]:
    """{address: bytes} of device `device`'s blocks live at the snapshot ("active_allocated"). Raises
    ValueError naming segment j and block k (0-based, as the pickle's segments[j]["blocks"][k]) for
    one that is not a mapping, or a live block whose address or size is not a whole number >= 0."""
    live: dict[int, int] = {}
    segments = snapshot.get("segments")
    segments = [] if segments is None else segments
    if not isinstance(segments, list):
        raise ValueError(f"memory snapshot: segments is a {type(segments).__name__}, not a list")
    for j, seg in enumerate(segments):
        if not isinstance(seg, dict) or not isinstance(seg.get("blocks", []), list):
            raise ValueError(f"memory snapshot: segment {j} (0-based) is not a mapping with a list of blocks")
        if seg.get("device", device) != device:
            continue
        for k, b in enumerate(seg.get("blocks", [])):
            if not isinstance(b, dict):
                raise ValueError(f"memory snapshot: segment {j}'s block {k} (0-based) is not a mapping")
            if b.get("state") != "active_allocated":
                continue
            if bad := [f for f in ("address", "size") if type(b.get(f)) is not int or b[f] < 0]:
                raise ValueError(f"memory snapshot: segment {j}'s block {k} (0-based, live) has no whole number "
                                 f">= 0 for {' or '.join(bad)}")
            live[b["address"]] = b["size"]
    return live


def split(snapshot: dict, device: int, allocated_at_start: int, names: dict[int, str],
          allocated_at_end: int | None = None) -> dict:
    """The step's peak and what was live then, from `snapshot` (torch.cuda.memory._snapshot(), taken
    at the step's end with the history recorded since its start), `allocated_at_start` and
    `allocated_at_end` (bytes, torch.cuda.memory_allocated() as the recording began and as the
    snapshot was taken) and `names` (tensor_names() at the end). The history gives requested bytes:
    each is counted as its block (block_bytes; the snapshot's own size for a block still live).
    Returns {"peak_mib", "at_event", "events", "start_mib", "end_mib", "replay_gap_mib" (torch's
    count at the end less the replay's: 0 when every block was placed), "truncated" (the history
    holds MAX_ENTRIES events: its start was dropped), "rows": [(held
    by, package, MiB, blocks)], biggest first}. Raises ValueError for a snapshot without device
    `device`'s history, with an alloc or free event whose addr or size is not a whole number >= 0,
    or with a damaged segment or live block (_live_blocks), each named by its index."""
    traces = snapshot.get("device_traces") if isinstance(snapshot, dict) else None
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise ValueError("memory snapshot: no device_traces list of per-GPU histories (torch.cuda.memory._snapshot() "
                         "with the history recorded has one)")
    if device >= len(traces):
        raise ValueError(f"memory snapshot: no allocator history for GPU {device} ({len(traces)} recorded)")
    truncated = len(traces[device]) >= MAX_ENTRIES
    trace = []  # the allocations and frees, checked as they are picked out
    last: dict[int, tuple[str, int]] = {}  # address -> (its last alloc or free, entry number)
    for i, e in enumerate(traces[device]):
        if not isinstance(e, dict) or not isinstance(e.get("action"), str):  # torch's entries always name their action
            raise ValueError(f"memory snapshot: GPU {device}'s history entry {i} (0-based) has no action")
        if e["action"] not in ("alloc", "free_requested"):
            continue
        # torch always gives both; a hand-made or damaged history may not
        if bad := [k for k in ("addr", "size") if type(e.get(k)) is not int or e[k] < 0]:
            raise ValueError(f"memory snapshot: GPU {device}'s history entry {i} ({e['action']}; 0-based, as "
                             f"memory_viz and the pickle's device_traces[{device}] count) has no "
                             f"whole number >= 0 for {' or '.join(bad)}")
        frames = [] if e.get("frames") is None else e["frames"]
        if not isinstance(frames, list) or not all(isinstance(f, dict) and isinstance(f.get("filename", ""), str)
                                                  for f in frames):
            raise ValueError(f"memory snapshot: GPU {device}'s history entry {i} ({e['action']}; 0-based) has frames "
                             "that are not a list of mappings with a text filename")
        before = last.get(e["addr"])
        if before is not None and before[0] == e["action"]:  # the allocator alternates them per address
            twice = "allocated" if e["action"] == "alloc" else "freed"
            raise ValueError(f"memory snapshot: GPU {device}'s history entry {i} (0-based) has address {e['addr']} "
                             f"{twice} again with no {'free' if twice == 'allocated' else 'alloc'} since entry "
                             f"{before[1]}: a damaged history")
        last[e["addr"]] = (e["action"], i)
        trace.append(e)
    active_end = _live_blocks(snapshot, device)

    unfreed: dict[int, int] = {}  # address -> index of an alloc not freed by the end
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            unfreed[e["addr"]] = i
        else:
            unfreed.pop(e["addr"], None)
    exact = {i: active_end[a] for a, i in unfreed.items() if a in active_end}  # block sizes the snapshot gives

    def walk(stop: int | None, start: int):
        live: dict[int, tuple[int, int]] = {}  # address -> (index of its alloc event, block bytes)
        freed_before: dict[int, int] = {}  # blocks from before the step freed so far: address -> bytes
        total, peak, at = start, start, -1
        for i, e in enumerate(trace[:stop]):
            if e["action"] == "alloc":
                live[e["addr"]] = (i, exact.get(i) or block_bytes(e["size"]))
                total += live[e["addr"]][1]
            elif e["addr"] in live:
                total -= live.pop(e["addr"])[1]
            else:
                freed_before[e["addr"]] = block_bytes(e["size"])
                total -= freed_before[e["addr"]]
            if total > peak:
                peak, at = total, i
        return live, freed_before, total, peak, at

    before = "before the step"
    if truncated and allocated_at_end is not None:
        # The history lost the step's start: counting on from the step's first count would drift by
        # every lost event. Anchor on torch's count at the end instead; what the kept events did
        # not make is from before them.
        allocated_at_start = allocated_at_end - walk(None, 0)[2]
        if allocated_at_start < 0:
            raise ValueError(f"memory snapshot: GPU {device}'s kept history allocates {-allocated_at_start / 2**20:,.1f} "
                             "MiB more than torch counted at the step's end: the history is not this step's")
        before = "before the kept history"
    live_end, freed_all, total_end, peak, at = walk(None, allocated_at_start)
    live, freed_by_peak, _, _, _ = walk(at + 1, allocated_at_start)
    rows: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])

    def add(key: tuple[str, str], size: int) -> None:
        rows[key][0] += size
        rows[key][1] += 1

    for addr, (i, size) in live.items():
        same = live_end.get(addr, (None,))[0] == i  # the very allocation still live at the end: named by its tensor
        if same and addr in names:
            add((f"in the step: {names[addr]}", "-"), size)
        else:
            w, pkg = where(trace[i].get("frames") or [])
            add((f"in the step: {w}", pkg), size)
    traced_before = 0
    for addr, size in active_end.items():  # blocks from before the step that are still live at its end
        if addr not in live_end:
            add((f"{before}: {names.get(addr, 'other')}", "-"), size)
            traced_before += size
    for addr, size in freed_all.items():  # freed between the peak and the end
        if addr not in freed_by_peak:
            add((f"{before}: freed after the peak", "-"), size)
            traced_before += size
    before_at_peak = allocated_at_start - sum(freed_by_peak.values())
    if before_at_peak - traced_before > 0:  # blocks the snapshot no longer lists (a lost history's, say)
        add((f"{before}: not in the snapshot", "-"), before_at_peak - traced_before)
    out = sorted(((k[0], k[1], v[0] / 2**20, v[1]) for k, v in rows.items()), key=lambda r: -r[2])
    gap = 0.0 if allocated_at_end is None else (allocated_at_end - total_end) / 2**20
    return {"peak_mib": peak / 2**20, "at_event": at + 1, "events": len(trace), "start_mib": allocated_at_start / 2**20,
            "end_mib": total_end / 2**20, "replay_gap_mib": gap, "truncated": truncated, "rows": out}


def markdown(s: dict, step: int, run_peak_mib: float | None = None) -> str:
    """split()'s result as the table memory-step<N>.md holds."""
    mark = f"{100 * s['at_event'] / s['events']:.0f}% of the way" if s["events"] else "at the start"
    lines = [f"## Memory at the peak of step {step} (rank 0; the CUDA allocator's history)", "",
             f"This step's peak: **{s['peak_mib']:,.0f} MiB** allocated, at allocator event {s['at_event']:,} of "
             f"{s['events']:,} ({mark} through the step); {s['start_mib']:,.0f} MiB at its start, "
             f"{s['end_mib']:,.0f} MiB after its optimizer step"
             + (f"; the run's peak so far (torch.cuda.max_memory_allocated): {run_peak_mib:,.0f} MiB"
                if run_peak_mib is not None else "")
             + ".", ""]
    if abs(s.get("replay_gap_mib", 0.0)) >= 1:
        lines += [f"The replay ends {s['replay_gap_mib']:+,.1f} MiB from torch's own count after the step (blocks bigger "
                  "than their requests: set expandable_segments:True in PYTORCH_CUDA_ALLOC_CONF, the launcher's "
                  "default): the peak and the rows are off by about that much.", ""]
    if s["truncated"]:
        lines += [f"The history kept only the last {MAX_ENTRIES:,} events: the step's start is missing. The "
                  "count is anchored on torch's own after the step, so the peak is the kept events' (the "
                  "step's own may lie in the lost start: compare the run's peak), its 'start' is where the "
                  "kept events begin, and 'before the kept history' rows are what the kept events did not make.", ""]
    lines += ["| held by | package | MiB | blocks |", "| --- | --- | --- | --- |"]
    before = [r for r in s["rows"] if r[0].startswith("before")]
    during = [r for r in s["rows"] if not r[0].startswith("before")]
    for r in before + during[:TOP]:
        lines.append(f"| {r[0][:160]} | {r[1]} | {r[2]:,.1f} | {r[3]:,} |")
    if len(during) > TOP:
        rest = during[TOP:]
        lines.append(f"| in the step: {len(rest)} other places | - | {sum(r[2] for r in rest):,.1f} | "
                     f"{sum(r[3] for r in rest):,} |")
    return "\n".join(lines) + "\n"


def stop_recording() -> None:
    """Switch the allocator's history off; nothing when it cannot keep one (cudaMallocAsync)."""
    import torch

    try:
        torch.cuda.memory._record_memory_history(enabled=None)
    except Exception:  # noqa: BLE001, S110  nothing was recording
        pass


class Recorder:
    """One step's recording: start() as the step begins, finish() after its optimizer step."""

    def __init__(self):
        self.start_bytes: int | None = None

    def start(self) -> None:
        import torch

        torch.cuda.synchronize()
        # Off first: torch keeps the history of a recording already on (a user's own), which the
        # replay would take for this step's. That recording ends here (said in docs/speed.md).
        torch.cuda.memory._record_memory_history(enabled=None)
        self.start_bytes = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, context="alloc", stacks="python")

    def finish(self, stem: Path, step: int, model: Any = None, optimizer: Any = None) -> str:
        """Stop recording; write `<stem>.json`, `.md` and `.pickle`; return the table."""
        import torch

        torch.cuda.synchronize()
        end_bytes = torch.cuda.memory_allocated()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        s = split(snap, torch.cuda.current_device(), self.start_bytes, tensor_names(model, optimizer),
                  allocated_at_end=end_bytes)
        self.start_bytes = None
        run_peak = torch.cuda.max_memory_allocated() / 2**20
        stem.parent.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".json").write_text(json.dumps({**s, "step": step, "run_peak_mib": run_peak}, indent=1))
        with open(stem.with_suffix(".pickle"), "wb") as f:
            pickle.dump(snap, f)
        md = markdown(s, step, run_peak)
        stem.with_suffix(".md").write_text(md)
        return md


class MemoryStep(TrainerCallback):
    """Record optimizer step `step` (1-based) on rank 0; write the split into `out_dir`."""

    def __init__(self, step: int, out_dir: Path, rank: int = 0):
        self.step, self.out_dir, self.rank = step, Path(out_dir), rank
        self.rec: Recorder | None = None

    def on_step_begin(self, args, state, control, **kw):
        import torch

        if state.global_step + 1 != self.step or self.rank != 0 or not torch.cuda.is_available():
            return
        self.rec = Recorder()
        try:
            self.rec.start()
        except Exception as e:  # noqa: BLE001  cudaMallocAsync has no history: said, and the run goes on
            self.rec = None
            self._off(e)

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        # before zero_grad: the gradients are still there to be named
        if self.rec is not None:
            rec, self.rec = self.rec, None
            try:
                print(rec.finish(self.out_dir / f"memory-step{self.step}", self.step, model, optimizer), flush=True)
            except Exception as e:  # noqa: BLE001  a diagnosis must never end the run it watches
                self._off(e)

    def _off(self, e: Exception) -> None:
        stop_recording()
        print(f"note: TUNELEDGER_MEMORY_STEP={self.step}: no memory split ({type(e).__name__}: {e})", flush=True)

    on_step_end = on_optimizer_step  # a Trainer without on_optimizer_step: after zero_grad, gradients unnamed
