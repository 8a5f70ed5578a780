#!/usr/bin/env bash
# One device call on a 2x H200 machine (nvidia-h200-x2), logs under $OUT:
#  1. issue 13: a 2-GPU QLoRA `train` of the SYNTHETIC Qwen2.5-7B gets SIGTERM mid-run (as Slurm or
#     Kubernetes preempt): it must finish its step, save, and exit 0. Then the same run resumes on
#     1 GPU: the log must show the step after the saved one, and the global batch unchanged
#     (accumulation doubles).
#  2. issue 16: a dry-run as 2 nodes x 1 GPU (two launchers, one GPU each, torchrun's c10d
#     rendezvous on 127.0.0.1; NCCL forced onto its socket transport over loopback, as between
#     two hosts), its ledger kept.
# Needs (carried, never committed): .whl (device_env.sh) and .carry/alpaca_fieldlen.json
# (bench/make_fieldlen_data.py). Usage on the device, from the repository root:
#   bash bench/h200_faults.sh
set -uo pipefail
PRESET=${PRESET:-D}
DATASET=${DATASET:-.carry/alpaca_fieldlen.json}
DEADLINE=${DEADLINE:-540}
OUT=${OUT:-/tmp/out}
RUN=/tmp/run-faults
mkdir -p "$OUT"
source bench/device_env.sh
t0=$(date +%s)
LOG=$OUT/faults.log
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$LOG"; }
left() { echo $(( DEADLINE - ($(date +%s) - t0) )); }
{ nvidia-smi -L; nvidia-smi topo -m; python3 -c "import torch, transformers, peft, bitsandbytes; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'bnb', bitsandbytes.__version__)"; } >> "$LOG" 2>&1
synth_model "$LOG"
COMMON="configs/qwen2.5-7b-qlora.yaml model_name_or_path=$MODEL dataset=$DATASET cache_dir=/tmp/cache preset=$PRESET"

# ---- 1. SIGTERM mid-run on 2 GPUs, then resume on 1 -------------------------------------------
TRAIN="$TL train $COMMON run_name=h200-sigterm output_dir=$RUN max_steps=40 save_steps=1000 logging_steps=1"
stamp "train preset $PRESET on 2 GPUs (max_steps 40, no scheduled save before the end); SIGTERM once it has run a few steps"
$TRAIN --nproc 2 > "$OUT/sigterm-2gpu.log" 2>&1 &
pid=$!
for _ in $(seq 1 240); do grep -q "step 1/" "$OUT/sigterm-2gpu.log" 2>/dev/null && break; sleep 1; done
sleep "${TERM_AFTER_S:-6}"
stamp "SIGTERM to the launcher (pid $pid): $(grep -c . "$OUT/sigterm-2gpu.log") log lines so far"
kill -TERM "$pid"
wait "$pid"; rc=$?
stamp "2-GPU train exit $rc (0 = stopped cleanly and saved); checkpoints: $(ls -d $RUN/checkpoint-* 2>/dev/null | xargs -n1 basename | tr '\n' ' ')"
grep -E "SIGTERM|stopping after|stopped by|saved|accumulation|global batch" "$OUT/sigterm-2gpu.log" | tail -6 | tee -a "$LOG"
saved=$(ls -d $RUN/checkpoint-* 2>/dev/null | sed 's/.*-//' | sort -n | tail -1)
stamp "resume on 1 GPU from checkpoint-$saved, 3 more steps"
timeout -k 20 -s TERM "$(( $(left) > 300 ? 200 : $(left) / 2 ))" $TL train $COMMON run_name=h200-sigterm output_dir=$RUN \
  max_steps=$(( ${saved:-0} + 3 )) save_steps=1000 logging_steps=1 --nproc 1 > "$OUT/resume-1gpu.log" 2>&1
stamp "1-GPU resume exit $?"
grep -E "resuming|accumulation|global batch|step [0-9]+/|done:" "$OUT/resume-1gpu.log" | head -12 | tee -a "$LOG"
cp $RUN/train.json "$OUT/sigterm-train.json" 2>/dev/null

# ---- 2. 2 nodes x 1 GPU over loopback -------------------------------------------------------
PORT=$(( 29700 + RANDOM % 200 ))
DRY="$TL dryrun $COMMON run_name=h200-2node output_dir=/tmp/run-2node dryrun_steps=10 dryrun_warmup_steps=3 --preset $PRESET --no-fit-check --nproc 1 --nnodes 2 --rdzv-endpoint 127.0.0.1:$PORT"
# Each node sees one GPU; no P2P or shared memory between them, so NCCL uses its socket transport.
export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo
stamp "dry-run preset $PRESET as 2 nodes x 1 GPU, c10d rendezvous 127.0.0.1:$PORT, NCCL sockets over lo"
budget=$(( $(left) - 20 )); [ "$budget" -gt 1 ] || budget=1
CUDA_VISIBLE_DEVICES=1 timeout -k 10 "$budget" $DRY --node-rank 1 > "$OUT/2node-node1.log" 2>&1 &
CUDA_VISIBLE_DEVICES=0 timeout -k 10 "$budget" $DRY --node-rank 0 > "$OUT/2node-node0.log" 2>&1
stamp "node 0 exit $?"
wait
grep -E "^preset|nodes|NCCL|VERDICT|FINDING|tokens/s" "$OUT/2node-node0.log" | tail -8 | tee -a "$LOG"
cp /tmp/run-2node/dryrun.json "$OUT/2node-dryrun.json" 2>/dev/null
stamp "done"
