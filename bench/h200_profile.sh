#!/usr/bin/env bash
# One device call: the step profile (src/tuneledger/profile.py) of presets with the default levers,
# each a short dry-run of the SYNTHETIC Qwen2.5-7B on the field-length data; step PROFILE_STEP is
# profiled (after WARMUP steps, so compiling is done). Writes $OUT/profile-<run>.md/.json and logs.
#   RUNS="C:auto D:auto C:nocompile" bash bench/h200_profile.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; WARMUP=${WARMUP:-3}; STEPS=${STEPS:-3}; PROFILE_STEP=${PROFILE_STEP:-5}
RUNS=${RUNS:-"C:auto D:auto"}
CONFIG=${CONFIG:-configs/qwen2.5-7b-qlora.yaml}
DATASET=${DATASET:-$([ -f .carry/alpaca_fieldlen.json ] && echo .carry/alpaca_fieldlen.json)}
source bench/device_env.sh
mkdir -p "$OUT" /tmp/logs
synth_model /tmp/logs/machine.log
for run in $RUNS; do
  p=${run%%:*}; v=${run#*:}
  case $v in auto) o="";; nocompile) o="torch_compile=false";; *) o="$v";; esac
  d=/tmp/prof-$p-$v; rm -rf $d
  echo "[$SECONDS s] profile $p $v"
  TUNELEDGER_PROFILE_STEP=$PROFILE_STEP timeout -k 10 200 $TL dryrun $CONFIG model_name_or_path=$MODEL ${DATASET:+dataset=$DATASET} \
    cache_dir=/tmp/cache lora_dropout=0 $o dryrun_steps=$STEPS dryrun_warmup_steps=$WARMUP run_name=prof-$p-$v output_dir=$d \
    --preset $p --nproc 1 --no-fit-check > $OUT/dryrun-prof-$p-$v.log 2>&1
  echo "[$SECONDS s] exit $?: $(grep -E "^preset $p:" $OUT/dryrun-prof-$p-$v.log | head -1 | cut -c1-120)"
  # The dry-run's worker writes into its preset's folder (<output_dir>/dryrun/<preset>/).
  f=$(find $d -name "profile-step$PROFILE_STEP.md" | head -1)
  [ -n "$f" ] && cp "$f" $OUT/profile-$p-$v.md && cp "${f%.md}.json" $OUT/profile-$p-$v.json
  head -30 $OUT/profile-$p-$v.md 2>/dev/null
done
