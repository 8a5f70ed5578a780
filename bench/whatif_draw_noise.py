"""How much whatif's drawn steps (costmodel.rank_steps, DRAWS steps with seed 0) move a prediction:
the same predictions with seeds 0-5, and the sd over them (ms). Run from the repository root:
    .venv/bin/python bench/whatif_draw_noise.py > bench/results/whatif-2026-12-07/draw-noise.txt
"""

import argparse
from pathlib import Path

import numpy as np

from tuneledger import whatif
from tuneledger.hwtable import parse_gpus

CASES = [("bench/results/whatif-2026-12-04/tune-cand1-A-dryrun.json", "A"),
         ("bench/results/whatif-2026-12-07/tune-cand2-B-dryrun.json", "B"),
         ("bench/results/whatif-2026-12-04/tune-cand3-C-dryrun.json", "C"),
         ("bench/results/h200-2026-11-30-scaling/dryrun-1gpu.json", "A"),
         ("bench/results/h200-2026-11-30-scaling/dryrun-1gpu.json", "C")]


def main() -> None:
    hw, n = parse_gpus("8x4090-pcie")
    args = argparse.Namespace(preset=None, profile=None, source_gpu=None, steps=None, save_steps=None, against=None,
                              json=None, gpus="8x4090-pcie")
    seeded = np.random.default_rng
    print("s/step on 8x4090-pcie, draws seeded 0-5 | sd (ms)")
    for ledger, preset in CASES:
        got = []
        for seed in range(6):
            np.random.default_rng = lambda _s, seed=seed: seeded(seed)  # costmodel draws with seed 0
            _, preds, _ = whatif.predict_all(whatif.load_ledger(Path(ledger)), args, hw, n)
            got.append(next(p["s_per_step"] for p in preds if p["preset"] == preset))
        np.random.default_rng = seeded
        print(f"{ledger} {preset}: {' '.join(f'{g:.4f}' for g in got)} | {np.std(got) * 1e3:.2f}")


if __name__ == "__main__":
    main()
