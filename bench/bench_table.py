"""`make bench`'s table: tuneledger's dry-run ledgers beside the peers' rows, from one call on one GPU.

    python bench/bench_table.py OUT_DIR NAME=RUN_DIR ... [--peers unsloth.json hf.json]

Each NAME=RUN_DIR is a `tuneledger dryrun` output folder (dryrun.json). The peers' JSON are the
rows of bench/peer_unsloth.py and bench/baseline_hf.py. Writes OUT_DIR/bench.md and bench.json,
one row each: engine, preset, levers, tokens_per_s_mean (the window's tokens over its wall time:
what a whole run pays), tokens_per_s_median (tokens per step at the median step), mfu (on the mean
step: 6 N tokens/s / the GPU's measured bf16 matmul rate, 8 N with checkpointing; N = the
weights a token passes through in matmuls, the ledger's `matmul_params`), peak_alloc_gib,
gpu_busy_share (NVML utilisation over the measured window; the peers are not sampled) and
first_losses; each row's ratio to the fastest peer of its preset on the mean step; and the loss
check against the preset's plain path (LOSS_TOL). The JSON's host_probe_us (µs per torch op call,
probes.host_probe_us) says how fast the host ran for each tuneledger row: rows of a host-bound
preset compare only where it agrees.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from tuneledger.ledger import mfu  # noqa: E402
from tuneledger.speed import levers_line  # noqa: E402


def ledger_rows(name: str, run: Path) -> list[dict]:
    led = json.loads((run / "dryrun.json").read_text())
    out = []
    for p in led["presets"]:
        if "s_per_step" not in p:
            out.append({"engine": "tuneledger", "run": name, "preset": p.get("preset"), "error": p.get("skipped")})
            continue
        model = p["model"]
        levers = dict(model.get("levers") or {})
        levers.pop("compile_stats", None)
        mean = p.get("tokens_per_s_mean") or p["tokens_per_s"]
        peak = p.get("peak_tflops_measured")
        out.append({
            "engine": "tuneledger", "run": name, "preset": p["preset"], "levers": levers,
            "micro_batch": p["micro_batch"], "gradient_checkpointing": p["gradient_checkpointing"], "packing": p["packing"],
            "tokens_per_s_mean": round(mean), "tokens_per_s_median": round(p["tokens_per_s"]),
            "mfu": mfu(mean, model["matmul_params"], p["gradient_checkpointing"], led["world_size"], peak * 1e12 if peak else None),
            "peak_alloc_gib": round(max(m["peak_allocated"] or 0 for m in p["memory_mib"]) / 1024, 1),
            "gpu_busy_share": (p.get("gpu_window") or {}).get("util_mean_pct", None),
            "first_losses": p.get("step_losses") or [], "matmul_params": model["matmul_params"], "peak_tflops": peak,
            "host_probe_us": p.get("host_probe_us"),  # the host's speed during this row (probes.host_probe_us)
        })
    return out


def peer_rows(path: Path, n_params: int | None, peak: float | None) -> list[dict]:
    out = []
    for r in json.loads(path.read_text()):
        engine = r.get("engine", "transformers+peft+bitsandbytes")
        if "error" in r:
            out.append({"engine": engine, "run": path.stem, "preset": r["preset"], "error": r["error"]})
            continue
        gc = bool(r.get("gc"))
        out.append({
            "engine": engine, "run": path.stem, "preset": r["preset"],
            "levers": {"padded": not r.get("packed"), "lora_dropout": r.get("lora_dropout")},
            "micro_batch": r["micro_batch"], "gradient_checkpointing": gc, "packing": bool(r.get("packed")),
            "tokens_per_s_mean": round(r["tokens_per_s"]), "tokens_per_s_median": round(r.get("tokens_per_s_median") or 0) or None,
            "mfu": mfu(r["tokens_per_s"], n_params, gc, 1, peak * 1e12) if n_params and peak else None,
            "peak_alloc_gib": round(r["peak_allocated_mib"] / 1024, 1), "gpu_busy_share": None,
            "first_losses": r.get("first_losses") or [],
        })
    return out


def ratios(rows: list[dict]) -> None:
    peers = [r for r in rows if r["engine"] != "tuneledger" and "error" not in r]
    for r in rows:
        if "error" in r:
            continue
        same = [p for p in peers if p["preset"] == r["preset"]] or peers
        best = max(same, key=lambda p: p["tokens_per_s_mean"], default=None)
        r["ratio_to_fastest_peer"] = round(r["tokens_per_s_mean"] / best["tokens_per_s_mean"], 3) if best else None
        r["fastest_peer"] = f"{best['engine']} {best['preset']}" if best else None


# Largest relative difference of a step loss from the plain path's, over the steps both made.
# 1e-3: more than 10x what varlen + Liger + the fused LoRA moved the first 10 losses on an H200
# (8.4e-5) and far below a known-wrong path (the compiled fused projection, whose loss stopped
# falling: 2.4e-2); bench/results/h200-2026-12-01-levers.
LOSS_TOL = 1e-3


def loss_checks(rows: list[dict]) -> None:
    """Each tuneledger row against its preset's plain row (a run named *plain*, else the first of
    the preset) at the same lora_dropout: the same seed and data order must give the same losses."""
    ours = [r for r in rows if r["engine"] == "tuneledger" and "error" not in r]
    for r in rows:
        if "error" in r:
            continue
        if r["engine"] != "tuneledger":
            r["loss_check"] = "n/a (its own data order and schedule)"
            continue
        same = [o for o in ours if o["preset"] == r["preset"] and o["levers"].get("lora_dropout") == r["levers"].get("lora_dropout")]
        ref = next((o for o in same if "plain" in o["run"]), same[0] if same else None)
        n = min(len(ref["first_losses"]), len(r["first_losses"])) if ref else 0
        if ref is None or ref is r or not n:
            r["loss_check"] = "reference"
            continue
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["first_losses"][:n], ref["first_losses"][:n]))
        r["loss_check"] = f"{'ok' if diff <= LOSS_TOL else 'DIFFERS'} {diff:.1e} vs {ref['run']} over {n} steps"


def ratio(r: dict) -> str:
    return f"{r['ratio_to_fastest_peer']} ({r['fastest_peer']})" if r.get("ratio_to_fastest_peer") is not None else "- (no peer)"


def markdown(rows: list[dict]) -> str:
    head = ("| engine | run | preset | mb | GC | levers | tokens/s mean step | median step | x fastest peer (mean) "
            "| MFU (mean) | peak alloc GiB | GPU busy | first losses | loss check |")
    lines = [head, "|" + " --- |" * 14]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['engine']} | {r['run']} | {r['preset']} | failed: {r['error']} |" + " |" * 10)
            continue
        busy = f"{r['gpu_busy_share']:.0f}%" if r["gpu_busy_share"] is not None else "-"
        mfu_text = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        lines.append(
            f"| {r['engine']} | {r['run']} | {r['preset']} | {r['micro_batch']} | {'on' if r['gradient_checkpointing'] else 'off'} "
            f"| {levers_line(r['levers'])} | {r['tokens_per_s_mean']:,} | {r['tokens_per_s_median'] or 0:,} | {ratio(r)} "
            f"| {mfu_text} | {r['peak_alloc_gib']} | {busy} | {', '.join(f'{x:.3f}' for x in r['first_losses'][:6])} "
            f"| {r['loss_check']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out = Path(argv[0])
    runs, peers = [], []
    args = argv[1:]
    if "--peers" in args:
        i = args.index("--peers")
        runs, peers = args[:i], args[i + 1:]
    else:
        runs = args
    rows = []
    for item in runs:
        name, sep, run = item.partition("=")
        if not sep or not run:
            print(f"bench_table: {item!r} is not NAME=RUN_DIR", file=sys.stderr)
            return 2
        if (Path(run) / "dryrun.json").is_file():
            rows += ledger_rows(name, Path(run))
        else:
            rows.append({"engine": "tuneledger", "run": name, "preset": "?", "error": f"no {run}/dryrun.json"})
    ours = next((r for r in rows if r.get("matmul_params")), {})
    for p in peers:
        if Path(p).is_file():
            rows += peer_rows(Path(p), ours.get("matmul_params"), ours.get("peak_tflops"))
        else:
            rows.append({"engine": "peer", "run": Path(p).stem, "preset": "?", "error": f"no {p}"})
    ratios(rows)
    loss_checks(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(rows, indent=1))
    (out / "bench.md").write_text(markdown(rows))
    print(markdown(rows))
    return 0 if any("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
