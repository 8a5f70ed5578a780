#!/usr/bin/env bash
# One device call (one H200): issue 19's levers, each measured by the project's own dry-run on the
# SYNTHETIC Qwen2.5-7B and the 400 field-length conversations, in one call:
#   the GPU run of tests/test_speed.py (packing isolation per attention backend, fused LoRA);
#   preset D plain (sdpa, no Liger, peft's LoRA) -> D with the defaults (auto) -> D + regional compile
#   -> D with lora_dropout 0.05 -> C with the defaults -> C + compile; a sync-debug step on D.
# Needs (carried, never committed): .whl (bench/device_env.sh), .usite (bitsandbytes from
# ../shared/tools/make_unsloth_site.sh), .carry/alpaca_fieldlen.json (bench/make_fieldlen_data.py).
#   bash bench/h200_levers.sh            # on the device, from the repository root
set -uo pipefail
OUT=${OUT:-/tmp/out}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-3}
DEADLINE=${DEADLINE:-555}
RUNS=${RUNS:-"Dplain Dauto Cauto Dcompile Ddrop Ccompile"}
CONFIG=${CONFIG:-configs/qwen2.5-7b-qlora.yaml}
DATASET=${DATASET:-.carry/alpaca_fieldlen.json}
FLAGS=${FLAGS:-}
mkdir -p "$OUT" /tmp/logs
if [ "${DEVICE_ENV:-1}" = 1 ]; then
  source bench/device_env.sh
  export PYTHONPATH=$PYTHONPATH:$PWD/.usite   # bitsandbytes (cuda130 only) from the Unsloth folder
else  # CPU smoke of the plumbing: DEVICE_ENV=0 MODEL=/tmp/tiny CONFIG=configs/tiny.yaml FLAGS=--cpu
  export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  TL=${TL:-python3 -m tuneledger}
  synth_model() { :; }
fi
t0=$(date +%s)
LOG=/tmp/logs/machine.log
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$LOG"; }
left() { echo $(( DEADLINE - ($(date +%s) - t0) )); }
{ nvidia-smi; ${PY:-python3} -c "import torch, transformers, peft, bitsandbytes, datasets, liger_kernel; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'peft', peft.__version__, 'bnb', bitsandbytes.__version__, 'datasets', datasets.__version__)"; } >> "$LOG" 2>&1
synth_model "$LOG"
stamp "tests/test_speed.py on the GPU"
timeout 120 ${PY:-python3} -m pytest -q -p no:cacheprovider tests/test_speed.py > /tmp/logs/test_speed_gpu.log 2>&1
stamp "pytest exit $?: $(tail -1 /tmp/logs/test_speed_gpu.log)"
JOB="$CONFIG model_name_or_path=$MODEL dataset=$DATASET cache_dir=/tmp/cache dryrun_steps=$STEPS dryrun_warmup_steps=$WARMUP"
PLAIN="flash_attn=sdpa enable_liger_kernel=false fused_lora=false lora_dropout=0"
AUTO="lora_dropout=0"
table=()
for r in $RUNS; do
  case $r in
    Dplain) p=D; o="$PLAIN";; Dauto) p=D; o="$AUTO";; Dcompile) p=D; o="$AUTO torch_compile=true";;
    Ddrop) p=D; o="lora_dropout=0.05";; Cauto) p=C; o="$AUTO";; Ccompile) p=C; o="$AUTO torch_compile=true";;
    Cplain) p=C; o="$PLAIN";;
  esac
  l=$(left); if [ "$l" -lt 60 ]; then stamp "$r skipped: $l s left"; continue; fi
  cap=150; case $r in *compile) cap=230;; esac; [ $(( l - 25 )) -lt $cap ] && cap=$(( l - 25 ))
  stamp "$r: dryrun --preset $p $o (at most $cap s)"
  env $([ "$r" = Dauto ] && echo TUNELEDGER_SYNC_DEBUG=$(( WARMUP + 2 ))) timeout -k 10 -s INT $cap \
    $TL dryrun $JOB run_name=$r output_dir=/tmp/run-$r $o --preset $p --nproc 1 --no-fit-check $FLAGS > /tmp/logs/dryrun-$r.log 2>&1
  stamp "$r exit $?: $(grep -E "^preset $p:" /tmp/logs/dryrun-$r.log | head -1 | cut -c1-160)"
  table+=("$r=/tmp/run-$r")
done
${PY:-python3} bench/levers_table.py "$OUT/levers.md" "${table[@]}" > /dev/null 2>&1
cat "$OUT/levers.md"
grep -h -B2 -A6 "Warning: called a synchronizing" /tmp/logs/dryrun-Dauto.log 2>/dev/null | head -80 > /tmp/logs/syncs.log
stamp "syncs warned in one D step: $(grep -c 'called a synchronizing' /tmp/logs/dryrun-Dauto.log 2>/dev/null)"
cp "$LOG" /tmp/logs/test_speed_gpu.log "$OUT/"
tar czf "$OUT/levers-runs.tgz" -C /tmp logs $(cd /tmp && ls -d run-*/dryrun.json run-*/dryrun.md 2>/dev/null)
stamp done
