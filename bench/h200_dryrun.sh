#!/usr/bin/env bash
# One device call (lent H200s): issue 2's benchmark, logs under $OUT.
#   synthetic Qwen2.5-7B -> stats on alpaca_zh -> `tuneledger dryrun --preset all` (QLoRA)
#   -> plain HF+peft+bitsandbytes baseline on the same data and presets, in the same call.
# Needs: .whl (bitsandbytes, datasets, ... as wheels for the device's Python) and .carry (the
# alpaca data, copied from ../shared; never committed). Usage on the device:
#   NPROC=2 STEPS=25 bash bench/h200_dryrun.sh
#   NPROC=1 PRESETS=D BASELINE="C D" DRYRUN_FLAGS=--no-fit-check bash bench/h200_dryrun.sh
set -uo pipefail
NPROC=${NPROC:-2}
STEPS=${STEPS:-25}
WARMUP=${WARMUP:-5}
PRESETS=${PRESETS:-all}
BASELINE=${BASELINE-A B C D}   # empty: no baseline
DATASET=${DATASET:-.carry/alpaca_zh_demo.json}
DEADLINE=${DEADLINE:-560}   # s for the whole script: the device call's limit is 600, and the archive must still be written
OUT=${OUT:-/tmp/out}
TAG=${TAG:-${NPROC}gpu}
mkdir -p "$OUT"
source bench/device_env.sh
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }

{
  stamp "machine"; nvidia-smi; nvidia-smi topo -m
  python3 -c "import torch, transformers, peft, bitsandbytes, datasets, accelerate; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'peft', peft.__version__, 'bnb', bitsandbytes.__version__, 'datasets', datasets.__version__, 'accelerate', accelerate.__version__)"
} 2>&1 | tee "$OUT/machine-$TAG.log"

synth_model "$OUT/machine-$TAG.log"
COMMON="configs/qwen2.5-7b-qlora.yaml model_name_or_path=$MODEL dataset=$DATASET run_name=h200-$TAG output_dir=/tmp/run-$TAG cache_dir=/tmp/cache dryrun_steps=$(( STEPS + WARMUP )) dryrun_warmup_steps=$WARMUP"

stamp "dryrun $PRESETS on $NPROC GPU(s)"
left() { echo $(( DEADLINE - ($(date +%s) - t0) )); }
timeout -s INT "${DRYRUN_BUDGET:-$(( $(left) * 65 / 100 ))}" $TL dryrun $COMMON --preset $PRESETS --nproc "$NPROC" ${DRYRUN_FLAGS:-} > "$OUT/dryrun-$TAG.log" 2>&1
stamp "dryrun exit $?"
grep -E "^(preset|VERDICT|FINDING|total steps)" "$OUT/dryrun-$TAG.log"

DATA=$(ls -td /tmp/cache/*/ | head -1)   # the newest cache: the one this dry-run used
if [ -n "$BASELINE" ]; then
stamp "baseline $BASELINE (plain HF + peft + bitsandbytes, same data)"
timeout -s INT "$(left)" python3 -m torch.distributed.run --nproc-per-node "$NPROC" --master-port $((29600 + RANDOM % 1000)) \
  bench/baseline_hf.py --model $MODEL --data "$DATA" --preset $BASELINE --steps "$STEPS" --warmup "$WARMUP" \
  --out "/tmp/run-$TAG/baseline.json" > "$OUT/baseline-$TAG.log" 2>&1
stamp "baseline exit $?"
grep "^baseline " "$OUT/baseline-$TAG.log"
fi
# $OUT returns at most 8 files: the logs, plus everything else of the run in one archive.
cp /tmp/run-$TAG/dryrun.md "$OUT/dryrun-$TAG.md" 2>/dev/null
tar czf "$OUT/run-$TAG.tgz" --exclude='checkpoint-*' --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' -C /tmp "run-$TAG"
stamp "done"
