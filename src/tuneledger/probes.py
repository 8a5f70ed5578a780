"""What the worker measures, and how (dry-run and train alike): the probes behind the ledger.

- `Clock` and `StepTimer`: CUDA events (no host sync) at each micro-batch boundary, before and
  after the optimizer and at step end, read once after training;
- `host_probe_us`: the host's speed at what a host-bound step is made of, sampled by StepTimer at
  the first step and every HOST_PROBE_EVERY steps, so a dry-run and its train can be compared;
- `EvalCounter`: eval micro-batches per rank; `SyncDebug`: TUNELEDGER_SYNC_DEBUG=N warns at every
  host-device sync of step N;
- `bench_matmul_tflops` (the MFU denominator) and `bench_allreduce` (the gradient's all-reduce),
  timed in the dry-run after its steps;
- `replay_order`: the dry-run's steps are real steps of the full run, replayed from their
  positions in its data order.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from tuneledger import quiet

quiet.install()  # before transformers imports bitsandbytes, which logs at import
from transformers import TrainerCallback  # noqa: E402

if TYPE_CHECKING:
    from tuneledger.trainer import LedgerTrainer


class Clock:
    """Timestamps on the GPU's timeline (CUDA events) or the host's (CPU runs). Resolved lazily."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


HOST_PROBE_EVERY = 10  # steps; a probe takes ~5 ms of host time, 0.03% of a 1.6 s step at this rate
HOST_PROBE_OPS = 2000


def host_probe_us(ops: int = HOST_PROBE_OPS) -> float:
    """Host speed: µs per torch operator call on a 1-element CPU tensor, over `ops` calls (~5 ms).

    A host-bound step is Python and torch's dispatcher launching kernels; this times the same
    path without the GPU, so a slower or busier host (a VM's neighbours, a lower clock) shows as a
    larger figure. It measures the host, not the job: compare it between runs on one machine.
    """
    a, b = torch.ones(1), torch.zeros(1)
    t = time.perf_counter()
    for _ in range(ops):
        torch.add(a, b, out=a)
    return (time.perf_counter() - t) / ops * 1e6


class StepTimer(TrainerCallback):
    """Per optimizer step: micro-batch times (forward+backward), optimizer time, host data wait.

    The last micro-batch of a step carries DDP's gradient all-reduce (and any wait for a slower
    rank); the others run under `no_sync`. `summary()` synchronises once and returns lists in s.
    `host_probe` holds {"after_step", "us"} samples of host_probe_us (µs), taken after the step's
    end mark and before the next step's data wait starts, so no measured part holds them.
    """

    def __init__(self, clock: Clock, device: torch.device | None = None, probe_every: int = HOST_PROBE_EVERY):
        self.clock = clock
        self.device = device
        self.probe_every = probe_every
        self.host_probe: list[dict] = []
        self.steps: list[dict] = []
        self._cur: dict | None = None
        self._host_end: float | None = None
        self.save_s: list[float] = []
        self.saves: list[dict] = []  # {"after_step": steps done, "s": seconds, "wall_end": UTC s}

    def on_step_begin(self, args, state, control, **kw):
        now = time.perf_counter()
        # Host time between steps: the Trainer fetches the next step's micro-batches here.
        wait = now - self._host_end if self._host_end is not None else 0.0
        self._cur = {"marks": [self.clock.mark()], "data_wait_s": wait, "wall_begin": time.time()}

    def on_substep_end(self, args, state, control, **kw):
        if self._cur:
            self._cur["marks"].append(self.clock.mark())

    def on_pre_optimizer_step(self, args, state, control, **kw):
        if self._cur:
            self._cur["marks"].append(self.clock.mark())
            self._cur["n_micro"] = len(self._cur["marks"]) - 1

    def on_step_end(self, args, state, control, **kw):
        if self._cur:
            self._cur["marks"].append(self.clock.mark())
            self._cur["wall_end"] = time.time()  # UTC seconds, to join the GPU monitor's samples
            if self.device is not None and self.device.type == "cuda":
                # Cumulative: a step where it grows is one where the allocator freed its cache and
                # retried (a stall of seconds, from fragmentation). A host-side counter, no sync.
                self._cur["alloc_retries"] = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)
            self.steps.append(self._cur)
            self._cur = None
            if self.probe_every and (len(self.steps) - 1) % self.probe_every == 0:
                self.host_probe.append({"after_step": len(self.steps), "us": round(host_probe_us(), 3)})
        self._host_end = time.perf_counter()

    def on_save(self, args, state, control, **kw):
        now = time.perf_counter()
        self.save_s.append(now - self._host_end)
        self.saves.append({"after_step": len(self.steps), "s": now - self._host_end, "wall_end": time.time()})
        self._host_end = now  # the next step's data wait starts after the save, not before it

    def summary(self) -> list[dict]:
        """Per step: step_s, micro_s (list), optimizer_s, data_wait_s (host), and t_begin/t_end,
        the step's bounds in s since the first step began (so a window's wall time includes the
        gaps between steps)."""
        if self.clock.cuda:
            torch.cuda.synchronize()
        out = []
        origin = self.steps[0]["marks"][0] if self.steps else None
        for s in self.steps:
            m, n = s["marks"], s["n_micro"]
            micro = [self.clock.seconds(m[i], m[i + 1]) for i in range(n)]
            out.append({"step_s": self.clock.seconds(m[0], m[-1]), "micro_s": micro,
                        "optimizer_s": self.clock.seconds(m[n], m[-1]), "data_wait_s": s["data_wait_s"],
                        "t_begin": self.clock.seconds(origin, m[0]), "t_end": self.clock.seconds(origin, m[-1]),
                        "wall_begin": s["wall_begin"], "wall_end": s["wall_end"], "alloc_retries": s.get("alloc_retries")})
        return out


class EvalCounter(TrainerCallback):
    """Eval micro-batches this rank ran: under DDP every rank evaluates its shard (the ledger shows it)."""

    def __init__(self):
        self.batches = 0

    def on_prediction_step(self, args, state, control, **kw):
        self.batches += 1


class SyncDebug(TrainerCallback):
    """Diagnosis: TUNELEDGER_SYNC_DEBUG=N warns (with the stack) at every host-device sync during
    step N, so a step's needless syncs can be found (torch.cuda.set_sync_debug_mode)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step + 1 == self.step:
            torch.cuda.set_sync_debug_mode("warn")

    def on_step_end(self, args, state, control, **kw):
        torch.cuda.set_sync_debug_mode(0)


def bench_matmul_tflops(device: torch.device, n: int = 8192, iters: int = 10) -> float | None:
    """Measured dense bf16 matmul rate of this GPU (TFLOP/s, 2 n^3 per product, median of `iters`),
    the MFU denominator. Random data: zeros run faster and would flatter the peak."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n**3 / sorted(times)[len(times) // 2] / 1e12


def bench_allreduce(nbytes: int, device: torch.device, iters: int = 20) -> dict:
    """Time an all-reduce of `nbytes` (the gradient size) on the training process group.

    Bus bandwidth follows nccl-tests (PERFORMANCE.md): busbw = bytes / t * 2 (n - 1) / n, in GB/s.
    Returns {} on a single rank.
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {}
    n = dist.get_world_size()
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    for _ in range(3):
        dist.all_reduce(x)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    t = times[len(times) // 2]
    return {"bytes": x.numel() * 4, "median_s": t, "algbw_gbs": x.numel() * 4 / t / 1e9,
            "busbw_gbs": x.numel() * 4 / t / 1e9 * 2 * (n - 1) / n}


def replay_order(trainer: LedgerTrainer, ds: Any, total_steps: int, steps_per_epoch: int, warmup: int, measured: int) -> list[int]:
    """Make `trainer` run the real run's own steps: its first `warmup`, then `measured` from evenly
    spaced positions of the rest (eta.step_positions). Returns the positions (0-based steps).

    The real order is read from the Trainer's own training dataloader (accelerate's seedable
    sampler, set to each epoch as the Trainer's loop sets it), before it is dealt to ranks. Step k
    of an epoch is that order's slice [k G, (k+1) G) at global batch G: ranks take micro-batches in
    turn from it. Those slices, one after another and read in order, give every rank the same
    micro-batches, collated the same way, as the real run has at those steps.
    """
    from tuneledger.eta import step_positions

    args = trainer.args
    g = args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps
    positions = step_positions(total_steps, steps_per_epoch, len(ds) // g, warmup, measured)
    loader = trainer.get_train_dataloader()
    batches = getattr(loader.batch_sampler, "batch_sampler", loader.batch_sampler)  # under BatchSamplerShard
    sampler = batches.sampler
    orders: dict[int, list[int]] = {}
    picked: list[int] = []
    for pos in positions:
        epoch, k = divmod(pos, steps_per_epoch)
        if epoch not in orders:
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            orders[epoch] = list(sampler)
        picked += orders[epoch][k * g:(k + 1) * g]
    trainer.train_dataset = ds.select(picked)
    trainer.replay = True
    return positions


def forget_compiled_code() -> list[str]:
    """Drop what this process holds of its compiled code, so the next call loads it from inductor's
    on-disk cache as a new process (the train) does: dynamo's frames and guards
    (torch._dynamo.reset()), and inductor's loaded wrapper modules and Triton kernels, which a
    reset alone keeps (PyCodeCache, CompiledTritonKernels). With only the reset, the probe predicted
    7.2-12.3 s of compile on one H200 where `train` then took 11.2-14.2 (three ETA calls, the
    latest bench/results/h200-2026-12-04/call9-etaD), short in each. Returns the caches cleared
    (those this torch has)."""
    from torch import _dynamo

    _dynamo.reset()
    cleared = ["dynamo"]
    import torch._inductor.async_compile as async_compile
    import torch._inductor.codecache as codecache

    # The C++ caches hold compile_cpp_wrapper's loaded wrappers (a loaded extension module stays
    # in sys.modules, so its warm load is still a lower bound; not yet checked by an ETA call).
    for owner, name in ((codecache, "PyCodeCache"), (async_compile, "CompiledTritonKernels"),
                        (codecache, "CppWrapperCodeCache"), (codecache, "CppPythonBindingsCodeCache"),
                        (codecache, "CppCodeCache")):
        cache = getattr(owner, name, None)
        if cache is not None and callable(getattr(cache, "cache_clear", None)):
            cache.cache_clear()
            cleared.append(name)
    return cleared


def time_warm_compile(trainer: LedgerTrainer, micro_batches: int = 3) -> dict | None:
    """What compiling costs a train that runs after this dry-run (s): the train finds this run's
    kernels in inductor's cache (launch puts it under cache_dir), so it traces and loads, but
    does not generate or build them again (preset D on an H200: 14 s against the dry-run's 27 s,
    bench/results/h200-2026-12-01-session3).

    Measured, not guessed: the compiled code is dropped (forget_compiled_code: dynamo's and
    inductor's in-memory copies; the on-disk cache stays), the CUDA allocator's cache emptied (a
    train starts with none), and the dry-run's first `micro_batches` micro-batches run forward and backward twice
    (varying in shape, as the run's first steps, which compiled once per shape and then with dynamic
    shapes). The first pass pays the warm compile, the second none: compile_s is their difference.
    Gradients are zeroed afterwards and no optimizer step is taken. Returns {"compile_s",
    "first_pass_s", "second_pass_s", "micro_batches", "forgot": the caches dropped}, or None when the run has no batches.
    """
    from contextlib import nullcontext

    model = trainer.model_wrapped
    batches = []
    for b in trainer.get_train_dataloader():
        batches.append(trainer._prepare_inputs(b))
        if len(batches) == micro_batches:
            break
    if not batches:
        return None
    cuda = next(model.parameters()).is_cuda

    def one_pass() -> float:
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        # Every rank runs the same passes; no_sync keeps DDP from all-reducing these gradients.
        with model.no_sync() if hasattr(model, "no_sync") else nullcontext():
            for b in batches:
                trainer.compute_loss(model, b).backward()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t

    model.train()
    forgot = forget_compiled_code()
    if cuda:  # a train starts with an empty allocator: its first steps pay the cudaMalloc calls too
        torch.cuda.empty_cache()
    first = one_pass()
    second = one_pass()
    model.zero_grad(set_to_none=True)
    return {"compile_s": max(0.0, first - second), "first_pass_s": first, "second_pass_s": second,
            "micro_batches": len(batches), "forgot": forgot}
