#!/usr/bin/env bash
# One device call (lent 2x H200): issue 14, the dry-run's ETA held against the real train of the
# same job, on 2 GPUs, then on 1 GPU if time is left. Logs, ledgers and a comparison table under $OUT.
#   synthetic Qwen2.5-7B -> the 400 field-length conversations -> per world size:
#   `tuneledger dryrun --preset D` then `tuneledger train preset=D` (>= 100 steps, a save every 40)
#   in the same output folder, so the train writes predicted vs actual (train.json eta_check).
# Needs (carried, never committed): .whl (as for bench/h200_dryrun.sh) and .carry/alpaca_fieldlen.json
# (bench/make_fieldlen_data.py --mean 678, see bench/results/README.md), or .carry/alpaca_zh_demo.json
# and .carry/alpaca_en_demo.json to make it here with the synthetic model's tokenizer (the same ids).
# Usage on the device, from the repository root:
#   bash bench/h200_eta.sh
#   GPUS="2" EPOCHS=5 bash bench/h200_eta.sh          # 2 GPUs only
# CPU smoke (no device, tiny model; checks the script's plumbing, not the numbers):
#   DEVICE_ENV=0 MODEL=/tmp/tiny CONFIG=configs/tiny.yaml DATASET=src/tuneledger/data/demo.jsonl FLAGS=--cpu \
#   GPUS="2" EPOCHS=1 SAVE=3 DRY_STEPS=4 DRY_WARMUP=1 EXTRA="max_samples=32 cutoff_len=128 global_batch_size=8 bf16=false" \
#   OUT=/tmp/out-smoke bash bench/h200_eta.sh
# Every stage runs under `timeout` against DEADLINE (s for the whole script); a train runs only when
# its own dry-run's ETA fits in the time left. $OUT gets 8 files with 2 world sizes (the limit is 8).
set -uo pipefail
GPUS=${GPUS:-2 1}                  # world sizes, in order
PRESET=${PRESET:-D}
EPOCHS=${EPOCHS:-5}                # 25 steps per epoch at global batch 16: 125 steps, as in the issue
EPOCHS_1GPU=${EPOCHS_1GPU:-4}      # 100 steps: 1 GPU is ~1.8x slower per step
SAVE=${SAVE:-40}
DRY_STEPS=${DRY_STEPS:-30}         # the run's first DRY_WARMUP, then the rest drawn across the run
DRY_WARMUP=${DRY_WARMUP:-5}
CONFIG=${CONFIG:-configs/qwen2.5-7b-qlora.yaml}
DATASET=${DATASET:-.carry/alpaca_fieldlen.json}
EXTRA=${EXTRA:-}
FLAGS=${FLAGS:-}
DRYRUN_FLAGS=${DRYRUN_FLAGS:---no-fit-check}   # D needs ~69 GiB: the 24 GB proof would only run it twice
DEADLINE=${DEADLINE:-540}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source bench/device_env.sh   # environment, carried wheels (or DEVICE_ENV=0: a CPU smoke), $TL, $MODEL, synth_model
t0=$(date +%s)
LOG=$OUT/machine.log
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$LOG"; }
left() { echo $(( DEADLINE - ($(date +%s) - t0) )); }
budget() { local l; l=$(left); echo $(( l > 1 ? l : 1 )); }   # timeout 0 would mean no limit

{
  command -v nvidia-smi >/dev/null && { nvidia-smi; nvidia-smi topo -m; }
  echo "host: $(nproc) CPUs, $(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2), load $(cut -d" " -f1-3 /proc/loadavg)"
  python3 -c "import torch, transformers, peft, datasets, accelerate; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'peft', peft.__version__, 'datasets', datasets.__version__, 'accelerate', accelerate.__version__)"
} >> "$LOG" 2>&1
stamp "setup done"
# The host's CPU over the call (the ETA's start-up parts ran 20-30% slower in C's train than in its
# dry-run on 2026-12-03, the steps did not): /proc/stat's cpu line and the load, once a second.
while :; do echo "$(date +%s.%N) $(head -1 /proc/stat) $(cut -d' ' -f1-4 /proc/loadavg)"; sleep 1; done > "$OUT/cpu.log" 2>/dev/null &
CPU_PID=$!
trap 'kill $CPU_PID 2>/dev/null' EXIT
psnap() { ps -eo pid,ppid,pcpu,rss,etimes,args --sort=-pcpu 2>/dev/null | head -12 | cut -c1-160 >> "$LOG"; }
synth_model "$LOG"

if [ ! -f "$DATASET" ]; then
  stamp "making $DATASET from .carry/alpaca_{zh,en}_demo.json with $MODEL's tokenizer"
  python3 bench/make_fieldlen_data.py --tokenizer "$MODEL" --mean 678 --out "$DATASET" \
    .carry/alpaca_zh_demo.json .carry/alpaca_en_demo.json 2>&1 | tail -1 | tee -a "$LOG"
fi

for n in $GPUS; do
  TAG=${TAG_PREFIX:-}${n}gpu
  RUN=/tmp/run-eta-$TAG
  rm -rf "$RUN"                    # a warm machine's earlier run would be resumed, not predicted
  epochs=$EPOCHS; [ "$n" = 1 ] && epochs=$EPOCHS_1GPU
  visible=$(seq -s, 0 $(( n - 1 )))
  JOB="$CONFIG model_name_or_path=$MODEL dataset=$DATASET run_name=eta-$TAG output_dir=$RUN cache_dir=/tmp/cache \
    num_train_epochs=$epochs save_steps=$SAVE dryrun_steps=$DRY_STEPS dryrun_warmup_steps=$DRY_WARMUP $EXTRA"
  if [ "$(left)" -lt 120 ]; then stamp "$TAG: skipped, $(left) s left"; continue; fi

  stamp "$TAG: dryrun --preset $PRESET ($DRY_STEPS steps, $DRY_WARMUP of them the run's first)"
  psnap
  CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-$visible} timeout -k 20 -s INT "$(budget)" \
    $TL dryrun $JOB --preset "$PRESET" --nproc "$n" $DRYRUN_FLAGS $FLAGS > "$OUT/dryrun-$TAG.log" 2>&1
  stamp "$TAG: dryrun exit $?"
  grep -E "^preset $PRESET:" "$OUT/dryrun-$TAG.log" | tee -a "$LOG"
  predicted=$(python3 -c "import json; print(int(json.load(open('$RUN/dryrun.json'))['presets'][0]['eta']['high_s']) + 1)" 2>/dev/null)
  if [ -z "$predicted" ]; then stamp "$TAG: no ETA in $RUN/dryrun.json, no train"; continue; fi
  if [ "$predicted" -gt $(( $(left) - 15 )) ]; then
    stamp "$TAG: train skipped: its ETA (at most $predicted s) does not fit the $(left) s left"; continue
  fi

  stamp "$TAG: train preset=$PRESET, $epochs epochs, a save every $SAVE (predicted at most $predicted s)"
  psnap   # what else runs as the train starts (a dry-run's leftovers?)
  s=$(date +%s.%N)
  CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-$visible} timeout -k 20 -s INT "$(budget)" \
    $TL train $JOB preset="$PRESET" --nproc "$n" $FLAGS > "$OUT/train-$TAG.log" 2>&1
  rc=$?
  python3 -c "print(round($(date +%s.%N) - $s, 1))" > "$RUN/outside_wall_s"   # the command as the shell saw it
  stamp "$TAG: train exit $rc, $(cat "$RUN/outside_wall_s") s from the shell"
  grep -E "^(ETA check|memory peak|done:)" "$OUT/train-$TAG.log" | tee -a "$LOG"
  grep -c "destroy_process_group() was not called" "$OUT/train-$TAG.log" | sed 's/^/destroy_process_group warnings: /' | tee -a "$LOG"
done

# The table: predicted vs actual, whole command and per part, per world size.
python3 - "$OUT/eta-table.md" /tmp/run-eta-${TAG_PREFIX:-}*gpu <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
out, runs = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
lines = ["| GPUs | steps | dry-run: ETA (range) | train: took (from the shell) | error | inside range | steady s/step dry-run / train "
         "| host probe µs/op dry-run / train |",
         "| --- | --- | --- | --- | --- | --- | --- | --- |"]
parts = []
for run in runs:
    f = run / "train.json"
    if not f.is_file():
        lines.append(f"| {run.name} | no train.json | | | | | | |")
        continue
    r = json.loads(f.read_text()); c = r.get("eta_check", {})
    if "total" not in c:
        lines.append(f"| {run.name} | {r['global_step']} | eta_check: {c.get('skipped')} | | | | | |")
        continue
    t, s, h = c["total"], c["steady_s_per_step"], c.get("host_probe_us") or {}
    shell = (run / "outside_wall_s").read_text().strip() if (run / "outside_wall_s").is_file() else "?"
    lines.append(f"| {r['world_size']} | {r['global_step']} | {t['predicted_s']:.1f} ({t['low_s']:.1f}-{t['high_s']:.1f}) "
                 f"| {t['actual_s']:.1f} ({shell}) | {t['error_pct']:+.1f}% | {t['inside_range']} "
                 f"| {s['dryrun_median']:.3f} / {s['train_median']:.3f} | {h.get('dryrun')} / {h.get('train')} |")
    parts += ["", f"{r['world_size']} GPU(s), s: part | predicted | actual | error %", "| --- | --- | --- | --- |"]
    parts += [f"| {k} | {v['predicted_s']} | {v['actual_s']} | {v['error_pct']} |" for k, v in c["parts"].items()]
    parts += [f"other estimators' error on the whole command, %: {c['other_estimators_error_pct']}"]
out.write_text("\n".join(lines + parts) + "\n")
print(out.read_text())
EOF

# 7 files: machine.log, dryrun/train logs per world size, eta-table.md, and the ledgers in one archive
# (no weights: a final adapter of r=64 on 7B is ~0.6 GB, past the 16 MiB a returned file may hold).
tar czf "$OUT/runs.tgz" --exclude='checkpoint-*' --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude='tensorboard' -C /tmp $(cd /tmp && ls -d run-eta-${TAG_PREFIX:-}*gpu 2>/dev/null)
stamp "done"
