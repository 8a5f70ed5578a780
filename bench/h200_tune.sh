#!/usr/bin/env bash
# One device call (one H200): issue 25's `tuneledger tune` on the SYNTHETIC Qwen2.5-7B and the 400
# field-length conversations, under a budget that leaves the call's 10 minutes room to return.
# Presets A-D are always candidates (tune's rule 1), so the pick is compared with them in this call.
# The default space is micro-batch 2 x 8, checkpointing off, packed, plus the presets (A, B with
# checkpointing on, C padded): 5 candidates, the one new point being C packed (padding-free). At
# ~80-130 s a candidate (model load and compile included) the budget may stop it before the last;
# tune.md lists what was not measured, and tune never starts a candidate it has no time left for.
# Needs (carried): .whl (bench/device_env.sh), .usite, .carry/alpaca_fieldlen.json.
#   BUDGET=8m MB=2,8 GC=off PACKING=on bash bench/h200_tune.sh
# CPU smoke of the plumbing: DEVICE_ENV=0 MODEL=/tmp/tiny CONFIG=configs/tiny.yaml FLAGS=--cpu bash bench/h200_tune.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
BUDGET=${BUDGET:-8m}
MB=${MB:-2,8}
GC=${GC:-off}
PACKING=${PACKING:-on}
CONFIG=${CONFIG:-configs/qwen2.5-7b-qlora.yaml}
DATASET=${DATASET:-$([ -f .carry/alpaca_fieldlen.json ] && echo .carry/alpaca_fieldlen.json)}
FLAGS=${FLAGS:---nproc 1}
mkdir -p "$OUT"
source bench/device_env.sh   # environment, carried wheels (or DEVICE_ENV=0: a CPU smoke), $TL, $MODEL, synth_model
t0=$(date +%s)
LOG=$OUT/machine.log
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$LOG"; }
{ nvidia-smi 2>/dev/null || echo "no nvidia-smi"; echo "host: $(nproc) CPUs, $(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2), load $(cut -d" " -f1-3 /proc/loadavg)"; } >> "$LOG" 2>&1
synth_model "$LOG"
rm -rf /tmp/run-tune
stamp "tune: micro-batches $MB, gc $GC, packing $PACKING, budget $BUDGET"
$TL tune $CONFIG model_name_or_path=$MODEL ${DATASET:+dataset=$DATASET} cache_dir=/tmp/cache run_name=tune \
  output_dir=/tmp/run-tune lora_dropout=0 --micro-batches "$MB" --gc "$GC" --packing "$PACKING" --budget "$BUDGET" $FLAGS \
  > "$OUT/tune.log" 2>&1
stamp "tune exit $?: $(grep -m1 '^\*\*Finding' "$OUT/tune.log" | cut -c1-200)"
for f in tune.md tune.json tune.png; do cp "/tmp/run-tune/tune/$f" "$OUT/" 2>/dev/null; done
# Each candidate's ledger and log in one archive (no weights): $OUT returns at most 8 files.
tar czf "$OUT/cands.tgz" --exclude='checkpoint-*' --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' \
  -C /tmp/run-tune tune 2>/dev/null
stamp done
