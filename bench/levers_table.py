"""One table from several dry-run ledgers (each a run of one preset with some levers changed).

    python bench/levers_table.py OUT.md NAME=RUN_DIR [NAME=RUN_DIR ...]

Per run: s/step (median; window mean), tokens/s (median step; mean step), peak allocated GiB, the
levers that ran, and the step losses; then each run's largest relative loss difference from the
first run (the reference) over the steps both made.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(out: str, runs: list[str]) -> None:
    rows = []
    lines = ["| run | preset | s/step (median; mean) | tokens/s (median step; mean step) | peak alloc GiB | levers |",
             "| --- | --- | --- | --- | --- | --- |"]
    losses = []
    for item in runs:
        name, _, run = item.partition("=")
        f = Path(run) / "dryrun.json"
        if not f.is_file():
            lines.append(f"| {name} | no ledger ({f}) | | | | |")
            continue
        for p in json.loads(f.read_text())["presets"]:
            if "s_per_step" not in p:
                lines.append(f"| {name} | {p.get('preset')} skipped: {p.get('skipped')} | | | | |")
                continue
            peak = max(m["peak_allocated"] or 0 for m in p["memory_mib"]) / 1024
            lev = p["model"].get("levers") or {}
            lines.append(f"| {name} | {p['preset']} | {p['s_per_step']:.3f}; {p['s_per_step_window_mean']:.3f} | "
                         f"{p['tokens_per_s']:,.0f}; {(p.get('tokens_per_s_mean') or 0):,.0f} | {peak:.1f} | "
                         + "; ".join(f"{k}: {v}" for k, v in lev.items()) + " |")
            steps = p.get("step_losses") or []
            rows.append((name, p["preset"], steps))
    lines += ["", "| run | step losses | max relative difference from the first run of its preset |", "| --- | --- | --- |"]
    first: dict[str, list[float]] = {}
    for name, preset, steps in rows:
        base = first.setdefault(preset, steps)
        n = min(len(base), len(steps))
        diff = max((abs(a - b) / abs(b) for a, b in zip(steps[:n], base[:n]) if b), default=0.0)
        losses.append(f"| {name} | {', '.join(f'{x:.4f}' for x in steps)} | {diff:.2e} over {n} steps |")
    text = "\n".join(lines + losses) + "\n"
    Path(out).write_text(text)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
