#!/usr/bin/env bash
# One device call (2 H200s, nvidia-h200-x2): issue 26 item 3, preset F where DDP cannot go. A
# SYNTHETIC Qwen2.5-32B (its exact architecture, random weights) under a per-process cap of 23 GiB
# (memory_cap_gib: torch.cuda.set_per_process_memory_fraction), standing for 24 GB cards:
#   1. DDP (preset B, one whole 4-bit copy per GPU) fails under the cap, and says so;
#   2. F (preset F, FSDP2) trains 10 steps under the same cap: its per-GPU peak;
#   3. F's dry-run under the cap: the ledger's per-GPU peak of DDP (predicted) beside F's.
# Then the 7B: `FLAGS="--nproc 2" bash bench/h200_fsdp.sh` in its own call (F against DDP on 2 GPUs).
# Estimate, not yet measured: 4-bit 32B is ~19 GB with bf16 embeddings; LoRA r=64 on every
# projection is ~0.54B parameters (8.6 GB of fp32 weights, grads and AdamW state): DDP needs ~30 GB
# per GPU, F on 2 ~16 GB. Each rank loads the whole 4-bit copy before it shards (accelerate keeps
# 4-bit weights off the meta device), ~21 GB under the 23 GiB cap: the tightest moment.
# The weights are drawn on GPU 0 and written to /dev/shm (65 GB of bf16; the machine has 256 GB).
#   bash bench/h200x2_fsdp.sh                    # on the device, from the repository root
set -uo pipefail
OUT=${OUT:-/tmp/out}
CAP=${CAP:-23}
DATASET=${DATASET:-.carry/alpaca_fieldlen.json}
DEADLINE=${DEADLINE:-570}
BIG=${BIG:-/dev/shm/synthetic-qwen2.5-32b}
mkdir -p "$OUT" /tmp/logs
source bench/device_env.sh
t0=$(date +%s)
LOG=$OUT/machine.log
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$LOG"; }
left() { echo $(( DEADLINE - ($(date +%s) - t0) )); }
{ nvidia-smi | head -20; nvidia-smi topo -m; } >> "$LOG" 2>&1
if [ ! -f $BIG/config.json ]; then
  stamp "synth-model qwen2.5-32b -> $BIG"
  $TL synth-model --arch qwen2.5-32b $BIG > /tmp/logs/synth.log 2>&1
  stamp "synth exit $?: $(tail -1 /tmp/logs/synth.log)"
fi
JOB="configs/qwen2.5-7b-qlora.yaml model_name_or_path=$BIG dataset=$DATASET cache_dir=/tmp/cache memory_cap_gib=$CAP lora_dropout=0 plot_loss=false logging_steps=1"
stamp "1. DDP (preset B) under the ${CAP} GiB cap, 2 steps"
rm -rf /tmp/runs/ddp32
timeout -k 10 $(( $(left) / 3 )) $TL train $JOB preset=B max_steps=2 save_steps=100 output_dir=/tmp/runs/ddp32 --nproc 2 > /tmp/logs/ddp32.log 2>&1
stamp "DDP exit $?: $(grep -E 'out of memory|does not fit|done:' /tmp/logs/ddp32.log | head -3 | tr '\n' '|')"
stamp "2. F under the ${CAP} GiB cap, 10 steps"
rm -rf /tmp/runs/f32
timeout -k 10 $(( $(left) - 150 )) $TL train $JOB preset=F max_steps=10 save_steps=10 output_dir=/tmp/runs/f32 --nproc 2 > /tmp/logs/f32.log 2>&1
stamp "F exit $?: $(grep -E 'out of memory|done:' /tmp/logs/f32.log | head -2 | tr '\n' '|')"
python3 -c "
import json; r = json.load(open('/tmp/runs/f32/train.json'))
print('F per-GPU peak allocated MiB:', [x['peak_allocated_mib'] for x in r['ranks']], 'reserved:', [x['peak_reserved_mib'] for x in r['ranks']])
" 2>&1 | tee -a "$LOG"
l=$(left)
if [ "$l" -gt 100 ]; then
  stamp "3. F's dry-run under the cap (at most $(( l - 15 )) s)"
  rm -rf /tmp/runs/dry32
  timeout -k 10 $(( l - 15 )) $TL dryrun $JOB output_dir=/tmp/runs/dry32 dryrun_steps=6 dryrun_warmup_steps=2 --preset F --nproc 2 --no-fit-check \
    > /tmp/logs/dry32.log 2>&1
  stamp "dryrun exit $?"
  cp /tmp/runs/dry32/dryrun.md "$OUT/dryrun-F-32b.md" 2>/dev/null; cp /tmp/runs/dry32/dryrun.json "$OUT/dryrun-F-32b.json" 2>/dev/null
fi
tar czf "$OUT/logs.tgz" -C /tmp logs 2>/dev/null
stamp "done"
