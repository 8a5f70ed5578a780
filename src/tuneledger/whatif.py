"""`tuneledger whatif`: the same job on hardware you don't have, from a dry-run measured on hardware
you do: s/step, tokens/s, memory per GPU, the 24 GB question and the whole command's ETA, each with
its parts.

    tuneledger whatif DRYRUN.json --gpus 8x4090-pcie [--preset A] [--profile PROFILE] [--steps N]
                      [--save-steps N] [--against OTHER.json] [--json OUT.json]

--gpus is COUNTxKIND (hardware/*.yaml: 4090-pcie, A100-80g-nvlink, H100-sxm, H200-sxm) or a YAML
file of the same fields plus `count` (hwtable.YAML_FORM). The cost model and its formulas are
costmodel.py's docstring: matmul from FLOPs at the measured matmul efficiency, attention, dequant
and the other memory-bound kernels by bytes and bandwidth, the ring all-reduce of the fp32 LoRA
gradients, host time per kernel launch, memory from the 4-bit weights, LoRA state and the measured
activations. The kernel split is --profile (a profile table: `make bench`'s profile-<preset>.md or
a dry-run log holding one), else the committed one named in costmodel.DEFAULT_PROFILE.

--steps and --save-steps set the run the ETA is for (default: the ledger's own); the start-up parts,
saves and finish are carried over as measured (host and disk side). --against compares with a
ledger measured on the target (the 1 -> 2 H200 check in docs/whatif.md).

Presets that cannot be predicted are left out with a line saying why: not measured by the dry-run,
FSDP (preset F), or a global batch that the target's GPU count does not divide (16 on 3 GPUs).
Every input (the ledger, --gpus, --preset, --against's ledger, --json's folder) is checked before
anything is printed.

Exit codes: 0 predicted (presets that do not fit are said, with the one that would); 2 bad input
(a ledger, a GPU name or a YAML that cannot be used, naming the file, line and field; a --json path
whose folder is missing or not writable), no preset or not the asked --preset can be predicted on
the target, or the asked --preset (or every preset predicted) does not fit the target's memory; 1
the --json write failed after the path was checked (a full disk), in one line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from tuneledger import costmodel as cm
from tuneledger import whatif_ledger
from tuneledger.eta import STARTUP, n_saves
from tuneledger.files import disk_full, write_text_atomic
from tuneledger.hwtable import Hardware, WhatifError, for_ledger_gpu, is_yaml, known_line, parse_gpus, source_kind
from tuneledger.ledger import fmt_h
from tuneledger.words import count_at_least, plural



def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("whatif", help="predict s/step, tokens/s, memory and ETA of a dry-run's job on other GPUs",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("ledger", help="a dry-run's dryrun.json")
    p.add_argument("--gpus", required=True, help="COUNTxKIND (8x4090-pcie, 4xA100-80g-nvlink, 8xH100-sxm, 2xH200-sxm) or a YAML")
    p.add_argument("--preset", help="one preset of the ledger (default: every measured one)")
    p.add_argument("--profile", help="a profile table (profile-<preset>.md or a dry-run log holding one)")
    p.add_argument("--source-gpu", help="the measured GPU's entry when the table does not know it (a kind or a YAML)")
    p.add_argument("--steps", type=count_at_least(1), help="optimizer steps of the run the ETA is for (default: the ledger's)")
    p.add_argument("--save-steps", type=count_at_least(1), help="a checkpoint every N steps (default: the ledger's save_steps)")
    p.add_argument("--against", help="a ledger measured on the target: predicted vs measured, per preset")
    p.add_argument("--json", help="write the predictions here as JSON")
    p.set_defaults(func=run)


def load_ledger(path: Path) -> dict:
    """A dry-run ledger, checked for what the model reads. Raises WhatifError naming the field."""
    try:
        led = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise WhatifError(f"{path}: cannot read the dry-run ledger ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise WhatifError(f"{path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg}); a dry-run writes dryrun.json") from None
    except UnicodeDecodeError as e:  # a binary file: not a ledger at all
        raise WhatifError(f"{path}: not a text file (byte {e.start}: {e.reason}); a dry-run writes dryrun.json as "
                          "UTF-8 JSON") from None
    if not isinstance(led, dict) or not isinstance(led.get("presets"), list) or not led["presets"]:
        raise WhatifError(f"{path}: no 'presets' list of measured rows: not a dry-run ledger (runs/<run>/dryrun.json)")
    if led.get("backend") == "gloo" or not led.get("gpu"):
        raise WhatifError(f"{path}: measured on a CPU (gloo processes): there are no GPU timings to scale from. Give "
                          "a dry-run's ledger from a GPU (the repository holds H200 ones: "
                          "bench/results/h200-2026-11-30-scaling/dryrun-1gpu.json)")
    # A preset the dry-run did not measure (interrupted, out of memory, ruled out) has nothing to scale:
    # it is left out and said, and `--preset` naming it says why.
    led["not_measured"] = {str(r.get("preset", "?")): r["skipped"] for r in led["presets"] if isinstance(r, dict) and "skipped" in r}
    led["presets"] = [r for r in led["presets"] if not (isinstance(r, dict) and "skipped" in r)]
    if not led["presets"]:
        raise WhatifError(f"{path}: no preset was measured ("
                          + "; ".join(f"{k}: {v}" for k, v in led["not_measured"].items()) + "): nothing to scale from")
    try:
        whatif_ledger.check(led, path)  # every field the model reads, typed: one line naming the row and field
    except ValueError as e:
        raise WhatifError(str(e)) from None
    return led


def source_gpu(led: dict, spec: str | None) -> Hardware:
    """The measured GPU's entry: --source-gpu's (a kind or a YAML, as --gpus reads them), else the
    table's entry for the ledger's GPU name. Raises WhatifError."""
    if spec:
        hw = source_kind(spec)
        known = for_ledger_gpu(led["gpu"])
        if known is not None and known.name != hw.name:
            # The calibration divides the ledger's measured TFLOP/s by this entry's peak: another
            # card's peak makes every prediction wrong by their ratio (a trial got "480% of the datasheet's").
            why = f"the ledger was measured on {led['gpu']!r}, which the table knows as {known.name}"
            if not is_yaml(spec):
                raise WhatifError(f"--source-gpu {spec}: {why}; --source-gpu is for a GPU the table does not know, or "
                                  "a YAML of your own figures for it (leave it out here)")
            print(f"WARNING: --source-gpu {spec}: {why}; the prediction uses your file's figures for it",
                  file=sys.stderr, flush=True)
        return hw
    hw = for_ledger_gpu(led["gpu"])
    if hw is None:
        raise WhatifError(f"the ledger's GPU {led['gpu']!r} is not in the table; say which it is with --source-gpu. {known_line()}")
    return hw


def profile_rates(args: argparse.Namespace, led: dict, src_hw: Hardware) -> dict:
    if not args.profile:
        return cm.rates(cm.DEFAULT_PROFILE)
    path = Path(args.profile)
    try:
        return cm.rates(cm.parse_profile(path.read_text(encoding="utf-8"), str(path), led, src_hw.memory_gbs))
    except OSError as e:
        raise WhatifError(f"{path}: cannot read the profile ({e.strerror or e})") from None
    except ValueError as e:
        raise WhatifError(str(e)) from None


def eta(pred: dict, row: dict, steps: int | None, save_steps: int | None) -> dict:
    """The whole `train` command on the target: start-up parts, compile and finish as the ledger
    measured them (host and disk), every step at the predicted s/step, saves at the measured save."""
    e = row.get("eta") or {}
    total = steps or e.get("total_steps") or 0
    every = save_steps or row["config"].get("save_steps") or 0
    parts = e.get("parts") or {}
    start = {k: float(parts.get(k) or 0.0) for k in STARTUP} if parts else None
    saves = n_saves(total, every)
    save_s = float(row.get("save_s") or e.get("save_s") or 0.0)
    out = {"total_steps": total, "steps_s": total * pred["s_per_step"], "checkpoints": saves, "save_s": save_s,
           "saves_s": saves * save_s, "startup_s": sum(start.values()) if start else None, "startup": start,
           "finish_s": float(parts.get("finish_s") or 0.0) if parts else None}
    out["total_s"] = out["steps_s"] + out["saves_s"] + (out["startup_s"] or 0.0) + (out["finish_s"] or 0.0)
    return out


def _g(b: float) -> str:
    return f"{b / cm.GIB:.1f}"


def describe(pred: dict, src: dict, hw: Hardware, e: dict) -> list[str]:
    """The lines of one prediction: every part, so the reader sees why."""
    n, p, st, g = pred["gpus"], pred, pred["step"], pred["gpu"]
    ar, mem = pred["allreduce"], pred["memory"]
    lines = [f"preset {p['preset']}: micro-batch {p['micro_batch']} x {plural(n, 'GPU')} x accumulation {p['ga']} = global batch "
             f"{src['G']}; gradient checkpointing {'on' if p['gc'] else 'off'}; packing {'on' if p['packing'] else 'off'}",
             f"  {p['s_per_step']:.3f} s/step = {plural(p['ga'], 'micro-batch', 'micro-batches')} x {p['micro_s']:.3f} + all-reduce {st['allreduce']:.3f} "
             f"+ sync wait {st['sync_wait']:.3f} + optimizer {st['optimizer']:.3f} + data wait {st['data_wait']:.3f}",
             f"  {p['tokens_per_s']:,.0f} tokens/s ({p['tokens_per_s_per_gpu']:,.0f} per GPU) over {src['row']['tokens_per_step']:,.0f} "
             f"real tokens a step"]
    host = (f"host {p['host_s']:.3f}" if p["host_s"] is not None else "host unknown (no host-bound row to price a launch)")
    idle = ""
    if p["idle_s"]:
        util = src.get("util_pct")
        idle = (f" + idle {p['idle_s']:.3f} (host gaps: the measured GPU was busy {util:.0f}% of its micro-batch; "
                f"a slower GPU's kernels fill them)" if util is not None else f" + idle {p['idle_s']:.3f}")
    lines.append(f"  micro-batch {p['micro_s']:.3f} s = max(GPU {p['gpu_s']:.3f}, {host}){idle}: {p['bound']}-bound")
    flops = p["tokens_processed"] * cm.flops_per_token(src["params"]["N"], src["params"]["P"], p["gc"])
    lines.append(f"    GPU = matmul {g['matmul']:.3f} ({flops:.3g} FLOP at {p['matmul_tflops']:.1f} TFLOP/s) + attention "
                 f"{g['attention']:.3f} + dequant {g['dequant']:.3f} + other memory-bound {g['other']:.3f}"
                 f" ({p['tokens_processed']:,.0f} tokens processed, {p['tokens_real']:,.0f} real)")
    if p["host_s"] is not None:
        lines.append(f"    host = {p['launches']:,.0f} launches x {p['launch_cost_s'] * 1e6:.1f} µs / host_speed {hw.host_speed:g}")
    if n > 1:
        lines.append(f"  all-reduce {ar['s']:.3f} = ring 2x{n - 1}/{n} x {4 * src['params']['P'] / 1e6:,.0f} MB / ({hw.link_gbs:g} GB/s x "
                     f"{hw.allreduce_efficiency:g}) {ar['bandwidth_s']:.3f} + {plural(ar['buckets'], 'bucket')} x {2 * (n - 1)} hops x "
                     f"{hw.link_latency_us:g} µs {ar['latency_s']:.3f}; not overlapped with the backward")
    fit = ("DOES NOT FIT" if not p["fits"] else "fits, BORDERLINE: within the memory model's error (docs/whatif.md)"
           if borderline(p) else "fits") + f" ({p['usable_gib']:g} GiB usable of {hw.memory_gb:g})"
    parts = " + ".join(f"{k.replace('_', ' ')} {_g(v)}" for k, v in mem.items()
                       if k not in ("activations_measured", "measured_peak", "total"))
    lines.append(f"  memory per GPU {_g(mem['total'])} GiB allocated at peak = {parts}; {fit}; the card also holds "
                 f"~1 GiB outside the allocator (CUDA context, cuBLAS, NCCL)")
    start = (f"start-up {fmt_h(e['startup_s'])} + " if e["startup_s"] is not None else "")
    tail = "" if e["startup_s"] is not None else " (start-up: not in this ledger, written before the ETA had parts)"
    lines.append(f"  ETA of `train`, {plural(e['total_steps'], 'step')}: {fmt_h(e['total_s'])} = {start}{e['total_steps']:,} x "
                 f"{p['s_per_step']:.3f} s + {plural(e['checkpoints'], 'save')} x {e['save_s']:.1f} s"
                 + (f" + finish {e['finish_s']:.1f} s" if e["finish_s"] is not None else "") + tail)
    return lines


# The memory model's error on the committed checks is up to about 6% (docs/whatif.md): a
# prediction this close to the usable memory is said to be borderline, not a plain fit.
BORDERLINE = 0.06


def borderline(p: dict) -> bool:
    """True when a fitting prediction's peak is within BORDERLINE of the usable memory."""
    return bool(p["fits"]) and p["memory"]["total"] > (1 - BORDERLINE) * p["usable_gib"] * 2**30


def load_against(path: Path, hw: Hardware, n: int) -> dict:
    """--against's ledger, read and checked before anything is predicted. Raises WhatifError when it
    is not a GPU dry-run's ledger (load_ledger), or was measured on other GPUs or another count."""
    led = load_ledger(path)
    for i, r in enumerate(led["presets"]):  # what the comparison reads beside what the model reads
        if r.get("tokens_per_s") is None:
            raise WhatifError(f"--against {path}: presets[{i}] (preset {r['preset']}) tokens_per_s: missing (a "
                              "dry-run's dryrun.json has it: was the ledger cut short or edited?)")
    if led.get("world_size") != n or hw.gpu.lower() not in str(led.get("gpu", "")).lower():
        raise WhatifError(f"--against {path} was measured on {led.get('world_size')} x {led.get('gpu')}, and this "
                          f"prediction is for {n} x {hw.gpu}: an error needs the same GPUs, as many; give --gpus "
                          f"{led.get('world_size')}x<that GPU's name> or a ledger measured on {n} x {hw.gpu}")
    return led


def against(preds: list[dict], led: dict, path: Path) -> list[str]:
    """Predicted beside measured for each preset both have: (predicted - measured) / measured. `led`
    is load_against's."""
    rows = {r["preset"]: r for r in led["presets"]}
    out = [f"against {path} ({led.get('world_size')} x {led.get('gpu')}): (predicted - measured) / measured",
           "| preset | s/step pred | meas | error | tokens/s pred | meas | error | GiB/GPU pred | meas | error |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in preds:
        r = rows.get(p["preset"])
        if r is None:
            continue
        mem = max(m["peak_allocated"] for m in r["memory_mib"]) * 2**20
        err = lambda a, b: f"{(a - b) / b * 100:+.1f}%"  # noqa: E731
        out.append(f"| {p['preset']} | {p['s_per_step']:.3f} | {r['s_per_step']:.3f} | {err(p['s_per_step'], r['s_per_step'])} "
                   f"| {p['tokens_per_s']:,.0f} | {r['tokens_per_s']:,.0f} | {err(p['tokens_per_s'], r['tokens_per_s'])} "
                   f"| {_g(p['memory']['total'])} | {_g(mem)} | {err(p['memory']['total'], mem)} |")
        p["against"] = {"s_per_step": r["s_per_step"], "tokens_per_s": r["tokens_per_s"], "memory": mem}
    return out


FSDP_WHY = "it ran FSDP, which whatif does not model (DDP presets A-D only)"


def holds(led: dict) -> str:
    """The measured presets of a ledger, for an error: 'A, B, C, D' ('F (FSDP)' marked)."""
    return ", ".join(r["preset"] + (" (FSDP)" if r["config"].get("fsdp") else "") for r in led["presets"])


def predict_all(led: dict, args: argparse.Namespace, hw: Hardware, n: int) -> tuple[list[dict], list[dict], dict]:
    """Every row that can run on n GPUs of `hw`: (sources, predictions, the context printed at the
    top). The context's "left_out" maps each measured preset that cannot to why (FSDP, or a global
    batch that n GPUs do not divide). Raises WhatifError when none can."""
    src_hw = source_gpu(led, args.source_gpu)
    r = profile_rates(args, led, src_hw)
    # FSDP (preset F) shards the base and all-gathers it every layer: not this model's DDP arithmetic.
    rows = [row for row in led["presets"] if not row["config"].get("fsdp")]
    if not rows:
        raise WhatifError("every preset of the ledger ran FSDP (preset F): whatif models DDP presets (A-D) only")
    left_out = {row["preset"]: FSDP_WHY for row in led["presets"] if row["config"].get("fsdp")}
    sources = [cm.analyze(led, row, r, src_hw.memory_gbs) for row in rows]
    cost = cm.ledger_launch_cost(sources)
    cfg = led["presets"][0]["config"]
    quant = cfg.get("quantization_type", "nf4") if cfg.get("quantization_bit") else None
    # absmax_once keeps the absmax in fp32 after load: the bytes of single quantization (nf4.py).
    # What ran is the levers line's (on by default since 2026-12-06); an older ledger has only the config's.
    once = str(((led["presets"][0].get("model") or {}).get("levers") or {}).get("absmax_once", ""))
    ran_once = once.startswith("on") if once else bool(cfg.get("absmax_once", False))
    double_quant = bool(cfg.get("double_quantization", True)) and not ran_once
    preds, cannot = [], {}
    for s in sources:
        try:
            preds.append(cm.predict(s, src_hw, hw, n, cost, quant, double_quant))
        except ValueError as e:  # the global batch does not divide into micro-batch x n GPUs
            cannot[s["preset"]] = str(e)
            left_out[s["preset"]] = f"it cannot run on {n} x {hw.gpu}: {e}"
    if not preds:
        raise WhatifError(f"--gpus {args.gpus}: no preset of the ledger can run on {n} x {hw.gpu}: "
                          + "; ".join(f"preset {k}: {cannot.get(k, v)}" for k, v in left_out.items()))
    return sources, preds, {"src_hw": src_hw, "rates": r, "launch_cost_s": cost, "left_out": left_out}


def json_out(spec: str) -> Path:
    """--json's file, checked before anything is predicted: not a folder, in a folder that exists and
    may be written. Raises WhatifError naming the path."""
    out = Path(spec)
    folder = out.parent
    if out.is_dir():
        raise WhatifError(f"--json {out}: is a folder; give a file's path (e.g. {out / 'whatif.json'})")
    if not folder.is_dir():
        raise WhatifError(f"--json {out}: the folder {folder} " + ("is not a folder" if folder.exists() else
                                                                   "does not exist; create it or give another path"))
    if not os.access(folder, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise WhatifError(f"--json {out}: cannot write there (no write permission on {out if out.exists() else folder})")
    return out


def check_preset(led: dict, path: Path, asked: str) -> None:
    """--preset names a preset the ledger measured and whatif models. Raises WhatifError saying why
    not, with the presets the ledger holds."""
    rows = {r["preset"]: r for r in led["presets"]}
    if asked in led["not_measured"]:
        raise WhatifError(f"{path}: preset {asked} was not measured ({led['not_measured'][asked]}); it holds {holds(led)}")
    if asked not in rows:
        raise WhatifError(f"{path}: no preset {asked} in this ledger; it holds {holds(led)}"
                          + (" (whatif does not model FSDP's F in any case)" if asked == "F" else ""))
    if rows[asked]["config"].get("fsdp"):
        raise WhatifError(f"{path}: preset {asked}: {FSDP_WHY}; it holds {holds(led)}")


def prepare(args: argparse.Namespace) -> dict:
    """Every input checked, the --against ledger and --json's path among them, then the predictions:
    bad input fails before anything is printed. Raises WhatifError."""
    out = json_out(args.json) if args.json else None
    hw, n = parse_gpus(args.gpus)
    path = Path(args.ledger)
    led = load_ledger(path)
    asked = args.preset.upper() if args.preset else None
    if asked:
        check_preset(led, path, asked)
    other = load_against(Path(args.against), hw, n) if args.against else None
    sources, preds, ctx = predict_all(led, args, hw, n)
    if asked in ctx["left_out"]:
        raise WhatifError(f"--gpus {args.gpus}: preset {asked}: {ctx['left_out'][asked]}; these can: "
                          f"{', '.join(p['preset'] for p in preds)}")
    return {**ctx, "hw": hw, "n": n, "path": path, "led": led, "sources": sources, "preds": preds, "out": out,
            "against": other}


def run(args: argparse.Namespace) -> int:
    try:
        c = prepare(args)
    except WhatifError as e:
        print(f"tuneledger whatif: {e}", file=sys.stderr)
        return 2
    hw, n, path, led, sources, preds = c["hw"], c["n"], c["path"], c["led"], c["sources"], c["preds"]
    for name, why in led["not_measured"].items():
        print(f"whatif: preset {name} left out: the dry-run did not measure it ({why})", file=sys.stderr)
    for name, why in c["left_out"].items():
        print(f"whatif: preset {name} left out: {why}", file=sys.stderr)
    r, src_hw = c["rates"], c["src_hw"]
    share = sources[0]["peak_measured"] / src_hw.bf16_tflops
    print(f"whatif: {path}, measured on {led.get('world_size')} x {led['gpu']} ({led.get('date', '?')[:10]}"
          f"{', SYNTHETIC model' if led.get('synthetic') else ''})")
    print(f"  -> {n} x {hw.gpu} ({hw.name}: {hw.bf16_tflops:g} TFLOP/s dense bf16, {hw.memory_gb:g} GB, {hw.memory_gbs:,.0f} GB/s; "
          f"{hw.link}, {hw.link_gbs:g} GB/s x {hw.allreduce_efficiency:g}; figures and sources: {hw.where})")
    print(f"kernel split: {r['where']}; matmul at {r['e']:.1%} of the measured bf16 peak, {share:.1%} of the datasheet's "
          f"on the measured GPU; on the target {r['e']:.1%} of each preset's peak: {cm.target_peak(sources[0]['peak_measured'], src_hw, hw)[1]}")
    hb = [s["preset"] for s in sources if s["host_bound"]]
    if c["launch_cost_s"]:
        print(f"host: {c['launch_cost_s'] * 1e6:.1f} µs per kernel launch (median of this ledger's host-bound presets "
              f"{', '.join(hb)}: their micro-batch time / launches), / host_speed {hw.host_speed:g} on the target")
    wanted = [p for p in preds if not args.preset or p["preset"] == args.preset.upper()]
    rows = {s["preset"]: s for s in sources}
    for p in wanted:
        s = rows[p["preset"]]
        p["eta"] = eta(p, s["row"], args.steps, args.save_steps)
        print()
        print("\n".join(describe(p, s, hw, p["eta"])))
    fitting = sorted((p for p in preds if p["fits"]), key=lambda p: p["s_per_step"])
    print()
    for p in wanted:
        if not p["fits"]:
            alt = (f"preset {fitting[0]['preset']} would fit ({_g(fitting[0]['memory']['total'])} GiB, "
                   f"{fitting[0]['s_per_step']:.3f} s/step{', borderline' if borderline(fitting[0]) else ''})"
                   if fitting else "no predicted preset fits")
            roomy = [f for f in fitting if not borderline(f)]
            if fitting and borderline(fitting[0]) and roomy:  # the fastest with memory to spare, too
                alt += f"; with room: preset {roomy[0]['preset']} ({_g(roomy[0]['memory']['total'])} GiB, {roomy[0]['s_per_step']:.3f} s/step)"
            print(f"preset {p['preset']} does not fit {n} x {hw.gpu}: {_g(p['memory']['total'])} GiB per GPU against "
                  f"{hw.usable_gib:g} GiB usable; {alt}")
    if any(not p["fits"] for p in wanted):
        print()
    print(f"predicted for {n} x {hw.gpu} (not measured):")
    print(f" preset  GPUs  mb x acc  s/step  tokens/s  bound  GiB/GPU  fits  ETA")
    for p in wanted:
        print(f" {p['preset']:>6}  {n:>4}  {p['micro_batch']:>2} x {p['ga']:<3}  {p['s_per_step']:6.3f}  {p['tokens_per_s']:8,.0f}  "
              f"{p['bound']:>5}  {_g(p['memory']['total']):>7}  {('edge' if borderline(p) else 'yes') if p['fits'] else 'NO':>4}  "
              f"{fmt_h(p['eta']['total_s'])}")
    if c["against"] is not None:
        print("\n" + "\n".join(against(wanted, c["against"], Path(args.against))))
    if c["out"] is not None:
        try:  # whole or not at all: a full disk leaves no half file (files.write_text_atomic)
            write_text_atomic(c["out"], json.dumps({"ledger": str(path), "gpus": args.gpus, "hardware": hw.name, "count": n,
                                                    "kernel_split": r, "predictions": wanted}, indent=1, default=str))
        except OSError as e:
            print(f"tuneledger whatif: --json {c['out']}: cannot write the predictions ({e.strerror or e}); they are "
                  "printed above only" + (". Free space there (`df -h`)" if disk_full(e) else ""), file=sys.stderr)
            return 1
    if (args.preset and not wanted[0]["fits"]) or not fitting:
        return 2
    return 0
