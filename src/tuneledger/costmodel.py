"""The cost model behind `tuneledger whatif`: a measured dry-run row split into parts, each part
moved to other hardware by the quantity that bounds it. Seconds per micro-batch unless said.

  tokens     t = tokens_per_step x mb / G real tokens per micro-batch; processed p = t x pad, pad 1
             when packed or mb 1, else (mean + sd x c_mb) / mean (a padded micro-batch runs at its
             longest sample; c_b = expected max of b standard normals; sd = (p95 - median) / 1.645
             of the ledger's sample lengths)
  FLOPs      F = p x (4N + 6P), + p x (2N + 2P) with gradient checkpointing: forward 2N + 2P; the
             frozen 4-bit weights get only the input gradient, 2N; LoRA input and weight gradients
             4P; recompute is one more forward. N = matmul parameters (lm_head in, embedding out),
             P = trainable LoRA parameters
  matmul     F / (peak x e), e = the matmul efficiency a profile measured against the bf16 peak
             measured on that GPU (F_profile / (matmul kernel s x measured peak)); the target runs
             at the same e of its peak: the ledger's measured peak x the ratio of the two GPUs'
             measured bf16 rates (target_peak; the datasheet ratio where a figure is missing)
  attention  p x u x a: u = 3 token-units (forward 1, backward 2), 4 with recompute; a = the
             profile's attention kernel s per processed token-unit; x BW_src / BW_tgt
  other      the same for the profile's elementwise, fused Triton and other kernels (memory-bound)
  dequant    passes x 2.5 B x N4 / (BW x eff): NF4 read (0.5 B) and bf16 written (2 B) per 4-bit
             weight per pass, passes = 2 (forward, backward) + 1 with recompute, eff measured
  host       launches x cost per launch: launches from the profile (x 4/3 with recompute); cost
             from the row itself when it is host-bound (the micro-batch took the host's time),
             else the median over the ledger's host-bound rows; on the target / host_speed
  idle       a GPU-bound row whose GPU idled (NVML busy < 100%): the measured micro-batch less
             max(GPU, host) there, host gaps between kernels, on the target / host_speed and x
             min(1, GPU_src / GPU_tgt): a slower GPU's longer kernels fill them
  micro      E[max(GPU, host)] + idle: launches are asynchronous, so the slower side sets the pace;
             the GPU time is normal around its mean (sync wait's sd), drawn (rank_steps); + what
             the measured micro-batch held beyond the model there

A GPU-bound row's busy time (its measured micro-batch x NVML's busy share) replaces the
profile's sum on the measured GPU: what the profile's kernels leave of it goes into `other`, so
the model is exact where it was measured.

Per step: ga x micro + all-reduce + sync wait + optimizer + data wait.
  all-reduce  ring: 2(n-1)/n x 4P bytes (fp32 LoRA gradients) / (link GB/s x efficiency), plus
              2(n-1) hops x latency x ceil(4P / 25 MiB) DDP buckets; counted in full, not overlapped
              with the backward (the field report's 2 x 0.45 + 0.20 = 1.10 s adds it in full)
  sync wait   E[the slowest of n ranks' step] - E[a rank's step], a step = ga micro-batches of
              max(GPU, host), the GPU time normal with sd = v x cv / sqrt(mb), v = the
              token-proportional GPU time of a micro-batch (matmul, attention, other), cv = sd /
              mean of sample lengths (drawn, rank_steps; about c_n x sd x sqrt(ga) when the GPU
              paces, c_n = expected_max(n)): a host-paced micro-batch's time is set by its
              launches, not its lengths; + the ledger's measured
              wait less the model's for its own GPUs, x c_n / c_n_src x sqrt(ga / ga_src) when it
              was measured between ranks (none on one GPU), as is on one rank (its last micro-batch's
              extra, a cost per step); none measured with accumulation 1 on several ranks: it is
              inside the micro-batch, so the model's there is taken off
  optimizer   the measured optimizer time split into its kernels (the profile's optimizer kernels
              per trainable parameter, x P, x BW_profile / BW) and the rest, host time between them
              (/ host_speed on the target): on the H200 the kernels are 3.4 of ~10 ms, so scaling the
              whole by bandwidth would price host time as memory traffic; without a profiled optimizer
              row, measured x BW_src / BW_tgt.  data wait  measured (the host's dataloader)

Memory per GPU (bytes): static = N4 x q + 2 x (base - N4) + 16 x P, q = 0.5 + 1/64 + 4/(64 x 256)
(NF4 with double quantization: an 8-bit absmax per 64 weights, an fp32 one per 256 of those) or
0.5 + 4/64 without; base - N4 = embedding, lm_head, norms in bf16; 16 B = LoRA's fp32 weight,
gradient and Adam's two moments. Activations = (the row's peak allocated - static) x p_tgt / p_src.
It fits when static + activations <= memory - 1 GiB (hwtable.Hardware.usable_gib).
"""

from __future__ import annotations

import math
import re
import statistics

GIB = 2**30
BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb
# Where the profile is: bench/results/h200-2026-12-01-session3/call2 (one H200, commit 4d425ff).
DEFAULT_PROFILE = {
    "where": "bench/results/h200-2026-12-01-session3/call2/prof/dryrun-prof-C-auto.log: step 5 of preset C on one "
             "H200 (compiled levers; tokens and peak from the same call's C ledger, call2/lev/run-Cauto)",
    "micro_batch": 2, "gradient_accumulation_steps": 8, "world_size": 1, "gradient_checkpointing": False, "packing": False,
    "tokens_per_step": 10806.6, "peak_tflops_measured": 777.65, "memory_gbs": 4800.0,
    "matmul_params": 7070619136, "trainable_params": 161480704, "total_params": 7777097216,
    "length": {"mean": 670.2, "median": 682, "p95": 959},
    "categories_ms": {"matmul": 631.2, "attention": 157.1, "dequant": 127.9, "fused Triton": 79.9, "other": 35.1,
                      "elementwise": 15.8, "optimizer": 3.4, "idle": 1769.3},
    "launches": 41129,
}
OTHER_CATEGORIES = ("elementwise", "fused Triton", "other")


def expected_max(n: int) -> float:
    """E[max of n independent standard normals] (0 for n = 1; 0.564 for 2, 1.424 for 8), by
    numerical integration of x n phi(x) Phi(x)^(n-1)."""
    if n <= 1:
        return 0.0
    nd, h = statistics.NormalDist(), 0.01
    return sum(x * n * nd.pdf(x) * nd.cdf(x) ** (n - 1) * h for x in (i * h for i in range(-800, 801)))


def length_sd(length: dict) -> float:
    """sd of sample lengths (tokens) from the ledger's summary: (p95 - median) / 1.645."""
    return max(0.0, (length.get("p95", 0) - length.get("median", 0)) / 1.645)


def pad_factor(mb: int, packing: bool, length: dict) -> float:
    """Processed / real tokens of a micro-batch: 1 packed or alone, else (mean + sd c_mb) / mean."""
    if packing or mb <= 1 or not length.get("mean"):
        return 1.0
    return (length["mean"] + length_sd(length) * expected_max(mb)) / length["mean"]


def flops_per_token(n_mm: float, n_lora: float, gc: bool) -> float:
    """Training FLOPs per processed token of a frozen base with LoRA (module doc)."""
    return 4 * n_mm + 6 * n_lora + (2 * n_mm + 2 * n_lora if gc else 0.0)


def params(model: dict) -> dict:
    """N (matmul), P (trainable), N4 (4-bit: the matmul weights but lm_head), bf16 rest, from a
    ledger's `model` block; lm_head is taken as large as the embedding (untied, Qwen2.5-7B)."""
    n_mm, p, total = model["matmul_params"], model["trainable_params"], model["total_params"]
    base = total - p
    lm_head = max(0, base - n_mm)
    return {"N": n_mm, "P": p, "N4": n_mm - lm_head, "rest": base - (n_mm - lm_head), "base": base}


def rates(prof: dict) -> dict:
    """A profile's per-unit costs on its own GPU: e (matmul efficiency vs the measured peak), s per
    processed token-unit for attention and for the other memory-bound kernels, dequant's share of
    the bandwidth, launches per micro-batch without recompute. Module doc for the units."""
    gc, n_micro = prof["gradient_checkpointing"], prof["gradient_accumulation_steps"]
    cat = {k: v / 1e3 for k, v in prof["categories_ms"].items()}
    p = prof["tokens_per_step"] / prof["world_size"] * pad_factor(prof["micro_batch"], prof["packing"], prof["length"])
    units = 3 + gc
    pr = params(prof)
    flops = p * flops_per_token(pr["N"], pr["P"], gc)
    passes = 2 + gc
    dq_pass = cat.get("dequant", 0.0) / (n_micro * passes)
    return {"e": flops / (cat["matmul"] * prof["peak_tflops_measured"] * 1e12),
            "attention_s_per_unit": cat.get("attention", 0.0) / (p * units),
            "other_s_per_unit": sum(cat.get(k, 0.0) for k in OTHER_CATEGORIES) / (p * units),
            "dequant_eff": (2.5 * pr["N4"] / dq_pass / (prof["memory_gbs"] * 1e9)) if dq_pass else 1.0,
            "optimizer_s_per_param": cat.get("optimizer", 0.0) / pr["P"] if pr["P"] else 0.0,
            "launches_per_micro": prof["launches"] / n_micro / (units / 3), "N": pr["N"], "peak_tflops": prof["peak_tflops_measured"], "profile_gbs": prof["memory_gbs"],
            "where": prof.get("where", "")}


def host_bound(row: dict) -> bool:
    """The ledger's own verdict; without one, GPU busy under 75% of the window (diagnose.py's rule)."""
    verdict = (row.get("diagnosis") or {}).get("bottleneck")
    if verdict:
        return verdict == "host-bound"
    util = (row.get("gpu_window") or {}).get("util_mean_pct")
    return util is not None and util < 75


def _overheads(row: dict) -> dict:
    s = row["split"]
    return {k: float(s.get(k) or 0.0) for k in ("allreduce_s", "sync_wait_s", "optimizer_s", "data_wait_s")}


def micro_parts(p: float, gc: bool, pr: dict, r: dict, peak_tflops: float, bw_gbs: float) -> dict:
    """GPU seconds of one micro-batch of p processed tokens on a GPU of this peak and bandwidth."""
    units = 3 + gc
    scale = pr["N"] / r["N"]  # per-token kernel work grows with the model's size
    bw = r["profile_gbs"] / bw_gbs  # the rates were measured on the profile's GPU
    return {"matmul": p * flops_per_token(pr["N"], pr["P"], gc) / (peak_tflops * 1e12 * r["e"]),
            "attention": p * units * r["attention_s_per_unit"] * scale * bw,
            "other": p * units * r["other_s_per_unit"] * scale * bw,
            "dequant": (2 + gc) * 2.5 * pr["N4"] / (bw_gbs * 1e9 * r["dequant_eff"])}


def analyze(led: dict, row: dict, r: dict, src_gbs: float) -> dict:
    """Split one measured row into the parts of the module doc, on its own GPU.

    Returns tokens (real, processed per micro-batch), gpu parts (s), host (s), launches, the
    per-launch cost, whether host-bound, the calibration of a GPU-bound row, and the measured
    per-step overheads. r: rates() of a profile; src_gbs: the measured GPU's memory bandwidth."""
    mb, n_micro = row["micro_batch"], row["split"]["micro_batches_per_step"]
    G = row["config"]["global_batch_size"]
    gc, packing = bool(row["gradient_checkpointing"]), bool(row["packing"])
    length = led.get("stats", {}).get("length", {})
    pr = params(row["model"])
    t = row["tokens_per_step"] * mb / G
    p = t * pad_factor(mb, packing, length)
    over = _overheads(row)
    compute = max(0.0, row["s_per_step"] - sum(over.values())) / n_micro
    peak_meas = row.get("peak_tflops_measured") or r["peak_tflops"]
    parts = micro_parts(p, gc, pr, r, peak_meas, src_gbs)
    launches = r["launches_per_micro"] * (4 / 3 if gc else 1)
    hb = host_bound(row)
    modeled = sum(parts.values())
    calib = None
    idle = 0.0
    util = (row.get("gpu_window") or {}).get("util_mean_pct")
    if not hb:  # the GPU set the pace: its busy share of the measured time is the GPU's
        busy = util / 100 if util else 1.0  # unknown (null) or 0: all of it, as before NVML's share was read
        idle = compute * (1.0 - busy)  # gaps in which the GPU waited on the host
        gpu_time = compute - idle
        rest = gpu_time - parts["matmul"]
        mem = modeled - parts["matmul"]
        if rest >= mem:
            parts["other"] += rest - mem
        else:
            f = max(rest, 0.0) / mem if mem else 0.0
            parts = {k: (v if k == "matmul" else v * f) for k, v in parts.items()}
            if rest < 0:
                parts = {k: v * gpu_time / parts["matmul"] if k == "matmul" else 0.0 for k, v in parts.items()}
        calib = gpu_time / modeled if modeled else None
    return {"preset": row["preset"], "micro_batch": mb, "ga": n_micro, "world": led.get("world_size", 1), "G": G,
            "gc": gc, "packing": packing, "tokens_real": t, "tokens_processed": p, "length": length, "params": pr,
            "rates": r, "gpu": parts, "compute_micro_s": compute, "host_bound": hb, "launches": launches,
            "host_s": compute if hb else None, "idle_s": idle, "overheads": over, "sync_measured": row["split"].get("sync_wait_s"),
            "calibration": calib,
            "util_pct": util, "src_gbs": src_gbs,
            "peak_measured": peak_meas, "row": row}


def ledger_launch_cost(sources: list[dict]) -> float | None:
    """Seconds per kernel launch on the measured host: the median over host-bound rows."""
    costs = [s["host_s"] / s["launches"] for s in sources if s["host_bound"] and s["launches"]]
    return statistics.median(costs) if costs else None


def target_micro_batch(preset: str, mb: int, G: int, n: int) -> int:
    """Preset D's cap on other world sizes (config.resolve): the largest micro-batch up to mb that
    divides G / n; other presets keep theirs."""
    if preset != "D":
        return mb
    per_rank = G // n
    fits = [m for m in range(min(mb, per_rank), 0, -1) if per_rank and per_rank % m == 0]
    return fits[0] if fits else 1


def allreduce_s(n: int, grad_bytes: float, link_gbs: float, eff: float, latency_us: float) -> dict:
    """Ring all-reduce of grad_bytes over n GPUs (module doc): {"s", "bandwidth_s", "latency_s", "buckets"}."""
    if n <= 1:
        return {"s": 0.0, "bandwidth_s": 0.0, "latency_s": 0.0, "buckets": 0}
    buckets = math.ceil(grad_bytes / BUCKET_BYTES)
    bw = 2 * (n - 1) / n * grad_bytes / (link_gbs * eff * 1e9)
    lat = buckets * 2 * (n - 1) * latency_us * 1e-6
    return {"s": bw + lat, "bandwidth_s": bw, "latency_s": lat, "buckets": buckets}


def memory(src: dict, p_tgt: float, quant: str | None, double_quant: bool) -> dict:
    """Peak allocated bytes per GPU on the target (module doc): static parts and activations."""
    pr, row = src["params"], src["row"]
    q = (0.5 + 1 / 64 + 4 / (64 * 256) if double_quant else 0.5 + 4 / 64) if quant else 2.0
    static = {"weights_4bit" if quant else "weights_bf16": pr["N4"] * q, "weights_bf16_rest": 2.0 * pr["rest"],
              "lora_weights_grads_adam": 16.0 * pr["P"]}
    peak = max(m["peak_allocated"] for m in row["memory_mib"]) * 2**20
    act_src = max(0.0, peak - sum(static.values()))
    act = act_src * p_tgt / src["tokens_processed"]
    return {**static, "activations": act, "activations_measured": act_src, "measured_peak": peak,
            "total": sum(static.values()) + act}


def target_peak(src_peak: float, src_hw, hw) -> tuple[float, str]:
    """The target's bf16 matmul peak (TFLOP/s) from the peak a ledger's row measured on its GPU
    (src_peak), and how, in words that hold for every row. Both entries have
    `bf16_tflops_measured` (public records of one torch.mm benchmark): src_peak x their ratio, so
    the ledger's own conditions carry over and the same GPU predicts itself. Only the target has
    one: that figure. Else the datasheet ratio bf16_tflops / src_hw.bf16_tflops: a data-centre card
    reaches 79-85% of its datasheet like the H200, a GeForce card boosts past its own (an RTX 4090
    reaches 0.98-1.05 of 165.2), which is why the measured figures come first."""
    if hw.bf16_tflops_measured and src_hw.bf16_tflops_measured:
        return (src_peak * hw.bf16_tflops_measured / src_hw.bf16_tflops_measured,
                f"the row's measured peak x {hw.bf16_tflops_measured:g} / {src_hw.bf16_tflops_measured:g} "
                f"({hw.name} / {src_hw.name}, measured bf16 rates: bf16_tflops_measured)")
    if hw.bf16_tflops_measured:
        return hw.bf16_tflops_measured, f"{hw.bf16_tflops_measured:g} TFLOP/s, {hw.name}'s measured bf16 rate"
    return (src_peak * hw.bf16_tflops / src_hw.bf16_tflops,
            f"the row's measured peak x {hw.bf16_tflops:g} / {src_hw.bf16_tflops:g} (datasheet peaks; {hw.name} has "
            f"no bf16_tflops_measured)")


DRAWS = 2000  # steps drawn per (ranks, micro-batches) shape; fixed seed: the same shape, the same draws


def rank_steps(gpu: dict, host: float | None, cv: float, mb: int, n: int, ga: int) -> tuple[float, float, float]:
    """The micro-batches of a step on n ranks, each max(G, host) with G its GPU time, normal around
    sum(gpu) with sd = the token-proportional parts (matmul, attention, other) x cv / sqrt(mb)
    (host None: unknown, the GPU paces). Returns (the mean micro-batch s, the wait for the slowest
    rank s = E[max over ranks of a rank's sum] - E[a rank's sum], the share of micro-batches the GPU
    paces). Drawn (DRAWS steps, seed 0), not approximated: with the same draws for every input, a
    faster host or GPU never gives a longer step, which the normal approximation of a sum of maxima
    did not keep."""
    import numpy as np

    g = sum(gpu.values())
    sd = (gpu["matmul"] + gpu["attention"] + gpu["other"]) * cv / math.sqrt(mb)
    z = np.random.default_rng(0).standard_normal((DRAWS, n, ga))
    t = g + sd * z
    paced = 1.0 if host is None else float((t > host).mean())
    if host is not None:
        t = np.maximum(t, host)
    rank = t.sum(axis=2)  # (DRAWS, n): each rank's micro-batches of a step
    return float(rank.mean()) / ga, float(rank.max(axis=1).mean() - rank.mean()), paced


def optimizer_s(measured: float, r: dict, P: float, src_gbs: float, hw) -> float:
    """The optimizer step on the target (module doc): `measured` s on the ledger's GPU of `src_gbs`
    GB/s, its kernels from the profile's rate r["optimizer_s_per_param"] (s per trainable parameter
    on a GPU of r["profile_gbs"]) x P, the rest host time / hw.host_speed. The same GPU and host
    give `measured` back."""
    per = r.get("optimizer_s_per_param") or 0.0
    kernels = per * P * r["profile_gbs"] / src_gbs
    if not per or measured <= kernels:  # nothing left for the host: all of it moves with the bandwidth
        return measured * src_gbs / hw.memory_gbs
    return (measured - kernels) / hw.host_speed + per * P * r["profile_gbs"] / hw.memory_gbs


def predict(src: dict, src_hw, hw, n: int, launch_cost: float | None, quant: str | None = "nf4",
            double_quant: bool = True) -> dict:
    """One measured row (analyze()) on n GPUs of `hw` (hwtable.Hardware); src_hw is the measured GPU's
    entry. The target's matmul peak is target_peak's (so the same GPU predicts itself). Returns the shape, every
    part (s), s/step, tokens/s, memory (bytes) and whether it fits. Raises ValueError when the global
    batch does not divide into micro-batch x GPUs."""
    G, pr, r = src["G"], src["params"], src["rates"]
    mb = target_micro_batch(src["preset"], src["micro_batch"], G, n)
    if G % (mb * n):
        raise ValueError(f"global batch {G} is not a multiple of micro-batch {mb} x {n} GPU{'s' if n != 1 else ''}")
    ga = G // (mb * n)
    peak, peak_from = target_peak(src["peak_measured"], src_hw, hw)
    t = src["tokens_real"] / src["micro_batch"] * mb
    p = t * pad_factor(mb, src["packing"], src["length"])
    ratio = p / src["tokens_processed"]
    bw = src["src_gbs"] / hw.memory_gbs
    gpu = {"matmul": src["gpu"]["matmul"] * ratio * src["peak_measured"] / peak,
           "attention": src["gpu"]["attention"] * ratio * bw, "other": src["gpu"]["other"] * ratio * bw,
           "dequant": src["gpu"]["dequant"] * bw}
    g = sum(gpu.values())
    cost = (src["host_s"] / src["launches"]) if src["host_bound"] else launch_cost
    host = src["launches"] * cost / hw.host_speed if cost else None
    # A GPU-bound row whose GPU idled (NVML busy < 100%): host gaps between its kernels, a host
    # time per micro-batch whatever its size; a slower GPU's longer kernels fill them in proportion.
    g_src = sum(src["gpu"].values())
    src_host = src["host_s"] if src["host_bound"] else src["launches"] * cost if cost else None
    gaps = max(0.0, src["compute_micro_s"] - max(g_src, src_host or 0.0)) if src["idle_s"] else 0.0
    idle = gaps * min(1.0, g_src / g if g else 1.0) / hw.host_speed
    cv = length_sd(src["length"]) / src["length"]["mean"] if src["length"].get("mean") else 0.0
    mean, sync_model, paced = rank_steps(gpu, host, cv, mb, n, ga)
    # What the ledger measured beyond the model on its own GPUs carries over (a GPU predicts itself):
    # the measured micro-batch less the model's mean there, and the measured wait less the model's;
    # with accumulation 1 on several ranks the wait is inside the measured micro-batch (None), so
    # the model's wait there is taken off.
    src_mean, src_model, _ = rank_steps(src["gpu"], src_host, cv, src["micro_batch"], src["world"], src["ga"])
    micro = mean + idle + (src["compute_micro_s"] - gaps - src_mean)
    ar = allreduce_s(n, 4.0 * pr["P"], hw.link_gbs, hw.allreduce_efficiency, hw.link_latency_us)
    gpu_bound = host is None or g >= host
    measured = src["sync_measured"]
    if measured is None:  # accumulation 1 on several ranks: the wait is inside the measured micro-batch
        beyond = -src_model
    elif src["world"] > 1:  # a wait between ranks: it grows as the slowest of n does
        beyond = (measured - src_model) * expected_max(n) / expected_max(src["world"]) * math.sqrt(ga / src["ga"])
    else:  # one rank: what its last micro-batch took beyond the others, a cost per step
        beyond = measured - src_model
    sync = max(0.0, sync_model + beyond)
    over = src["overheads"]
    step = {"micro_batches": ga * micro, "allreduce": ar["s"], "sync_wait": sync,
            "optimizer": optimizer_s(over["optimizer_s"], r, pr["P"], src["src_gbs"], hw), "data_wait": over["data_wait_s"]}
    s_step = sum(step.values())
    tokens_step = src["row"]["tokens_per_step"]
    mem = memory(src, p, quant, double_quant)
    return {"preset": src["preset"], "gpus": n, "hardware": hw.name, "micro_batch": mb, "ga": ga, "gc": src["gc"],
            "packing": src["packing"], "tokens_real": t, "tokens_processed": p, "gpu": gpu, "gpu_s": g,
            "host_s": host, "idle_s": idle, "launches": src["launches"], "launch_cost_s": cost, "micro_s": micro,
            "bound": "GPU" if gpu_bound else "host", "gpu_bound_share": paced, "allreduce": ar, "step": step, "s_per_step": s_step,
            "tokens_per_s": tokens_step / s_step, "tokens_per_s_per_gpu": tokens_step / s_step / n,
            "matmul_tflops": peak * r["e"], "peak_tflops": peak, "peak_from": peak_from, "memory": mem,
            "fits": mem["total"] <= hw.usable_gib * GIB, "usable_gib": hw.usable_gib}


_HEAD = re.compile(r"step \d+: ([\d.]+) ms wall \(profiled\), GPU kernels [\d.]+ ms, idle \d+%; ([\d,]+) kernel launches")
_ROW = re.compile(r"^\| ([^|]+?) \| ([\d.]+) \| [\d.]+% \|\s*$")
_SHAPE = re.compile(r"preset (\w+): micro-batch (\d+) x world size (\d+) x gradient accumulation (\d+) = global batch "
                    r"(\d+); gradient checkpointing (on|off); packing (on|off)")


def parse_profile(text: str, where: str, led: dict, memory_gbs: float) -> dict:
    """A profile of the form profile.markdown writes (a profile-*.md, or a dry-run log holding one)
    as DEFAULT_PROFILE's fields. The job profiled is its log's `preset X: micro-batch ...` line; its
    tokens per step and measured peak come from that preset's row of `led` (else the ledger's data).
    Raises ValueError saying what is missing."""
    head = _HEAD.search(text)
    if not head:
        raise ValueError(f"{where}: no 'step N: ... ms wall (profiled), ... kernel launches' line: not a profile table")
    cats = {}
    for line in text[head.end():].splitlines():
        m = _ROW.match(line)
        if m and m.group(1) != "category":
            cats[m.group(1).strip()] = float(m.group(2))
        elif cats and line.startswith("| CPU op"):
            break
    if "matmul" not in cats:
        raise ValueError(f"{where}: the profile table has no matmul row")
    shape = _SHAPE.search(text)
    if not shape:
        raise ValueError(f"{where}: no 'preset X: micro-batch M x world size W x gradient accumulation A = global batch G; "
                         "gradient checkpointing on|off; packing on|off' line says which job was profiled (a dry-run log has it)")
    preset, mb, world, ga, G, gc, pack = shape.groups()
    rows = {r["preset"]: r for r in led["presets"]}
    row = rows.get(preset) or led["presets"][0]
    return {"where": where, "micro_batch": int(mb), "gradient_accumulation_steps": int(ga), "world_size": int(world),
            "gradient_checkpointing": gc == "on", "packing": pack == "on",
            "tokens_per_step": row["tokens_per_step"] if preset in rows else led["stats"]["tokens_per_step"],
            "peak_tflops_measured": row.get("peak_tflops_measured"), "memory_gbs": memory_gbs,
            **{k: row["model"][k] for k in ("matmul_params", "trainable_params", "total_params")},
            "length": led.get("stats", {}).get("length", {}), "categories_ms": cats,
            "launches": int(head.group(2).replace(",", ""))}
