#!/usr/bin/env bash
# The field report's 8x RTX 4090 predicted again from ledgers at the December code (compiled layers,
# Liger, fused LoRA): presets A and C as `tuneledger tune` measured them on one H200 on 2026-12-04
# (bench/results/h200-2026-12-04/call7-tune/cands.tgz: tune/cand-1 and cand-3, 6 steps each, 2 of
# them warm-up), copied here as the two JSON files. Run from the repository root:
#   bash bench/results/whatif-2026-12-04/run.sh
set -u
cd "$(dirname "$0")/../../.."
OUT=bench/results/whatif-2026-12-04
PY=${PY:-.venv/bin/python}
run() {  # name, then the arguments of `tuneledger whatif`
  local name=$1; shift
  { echo "\$ tuneledger whatif $*"; $PY -m tuneledger whatif "$@" 2>&1; echo "(exit $?)"; } > "$OUT/$name.txt"
}
run field-8x4090-A-from-tune $OUT/tune-cand1-A-dryrun.json --gpus 8x4090-pcie --steps 17377 --save-steps 200
run field-8x4090-C-from-tune $OUT/tune-cand3-C-dryrun.json --gpus 8x4090-pcie --steps 17377 --save-steps 200
