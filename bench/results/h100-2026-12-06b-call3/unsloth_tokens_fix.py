"""Unsloth's tokens/s in session 42's calls 2 and 3, corrected.

bench/peer_unsloth.py --profile (UNSLOTH_PROFILE=1) ran its profiled step after the timed window
but before reading the window's token counter, so that step's tokens were counted over the
window's time (fixed since). The peer's data order is deterministic (bench/baseline_hf.batches:
seed 42, micro-batch 2, accumulation 8), so the counted tokens are known exactly: the window is
steps 5-18 (4 warm-up, 14 timed), the profiled step is step 19. Reads the tokenized cache that
`tuneledger stats configs/qwen2.5-7b-qlora.yaml dataset=.carry/alpaca_fieldlen.json` makes (the
same records the device's dry-run cached: 25 steps per epoch, 10,723 tokens per step on average).

    python bench/results/h100-2026-12-06b-call3/unsloth_tokens_fix.py CACHE_DIR
"""
import sys

import datasets
import torch

ds = datasets.load_from_disk(sys.argv[1]).select_columns(["input_ids"])
order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(42)).tolist()
lens = [len(ds[j]["input_ids"]) for j in order]
steps, i = [], 0
while len(steps) < 19:
    steps.append(sum(lens[(i + k) % len(lens)] for k in range(16)))
    i += 16
timed, profiled = sum(steps[4:18]), steps[18]
f = timed / (timed + profiled)
print(f"timed window {timed:,} tokens, profiled step {profiled:,}: reported tokens/s x {f:.4f}")
for call, mean, median in (("call 2", 8968, 9028), ("call 3", 10020, 10008)):
    print(f"{call}: Unsloth C {mean:,} -> {mean * f:,.0f} (mean step), {median:,} -> {median * f:,.0f} (median step)")
