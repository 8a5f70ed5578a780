#!/usr/bin/env bash
# One device call (one H200): issue 24, preset F (FSDP2 over the 4-bit base) against DDP on the
# SYNTHETIC Qwen2.5-7B and the 400 field-length conversations, world size 1:
#   1. `tuneledger train preset=B` (DDP) and `preset=F`, 20 steps each, logging every step, dropout 0,
#      the same seed and data order: the first 20 losses side by side (fsdp-losses.md), tokens/s
#      of both (each train.json), F's per-GPU peak;
#   2. `tuneledger dryrun --preset F`: F's ledger (DDP's per-GPU peak beside F's predicted one).
# Needs (carried, never committed): .whl and .usite (bench/device_env.sh), .carry/alpaca_fieldlen.json.
#   bash bench/h200_fsdp.sh                       # on the device, from the repository root
# CPU smoke of the plumbing (.venv-quant: torch 2.13; no device, tiny model, 2 gloo ranks):
#   DEVICE_ENV=0 PY=.venv-quant/bin/python MODEL=/tmp/tiny CONFIG=configs/tiny.yaml FLAGS="--cpu --nproc 2" \
#   DATASET=src/tuneledger/data/demo.jsonl EXTRA="max_samples=80 cutoff_len=128 global_batch_size=4 report_to=none" \
#   OUT=/tmp/out-fsdp bash bench/h200_fsdp.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
STEPS=${STEPS:-20}
CONFIG=${CONFIG:-configs/qwen2.5-7b-qlora.yaml}
DATASET=${DATASET:-.carry/alpaca_fieldlen.json}
EXTRA=${EXTRA:-}
FLAGS=${FLAGS:---nproc 1}
DEADLINE=${DEADLINE:-560}
mkdir -p "$OUT" /tmp/logs
source bench/device_env.sh   # environment, carried wheels (or DEVICE_ENV=0: a CPU smoke), $TL, $MODEL, synth_model
t0=$(date +%s)
LOG=$OUT/machine.log
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$LOG"; }
left() { echo $(( DEADLINE - ($(date +%s) - t0) )); }
{ nvidia-smi 2>/dev/null | head -15; ${PY:-python3} -c "import torch, transformers, peft, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)"; } >> "$LOG" 2>&1
synth_model "$LOG"
JOB="$CONFIG model_name_or_path=$MODEL dataset=$DATASET cache_dir=/tmp/cache max_steps=$STEPS save_steps=$STEPS logging_steps=1 lora_dropout=0 plot_loss=false $EXTRA"
for p in B F; do
  l=$(left); [ "$l" -lt 100 ] && { stamp "train $p skipped: $l s left"; continue; }
  rm -rf /tmp/runs/$p   # a machine kept warm keeps the last call's run, which would count as finished
  stamp "train preset $p ($STEPS steps; at most $(( l - 60 )) s)"
  s=$(date +%s.%N)
  timeout -k 10 $(( l - 60 )) $TL train $JOB preset=$p output_dir=/tmp/runs/$p $FLAGS > /tmp/logs/train-$p.log 2>&1
  rc=$?
  stamp "train $p exit $rc in $(python3 -c "import sys; print(f'{float(sys.argv[1]) - float(sys.argv[2]):.1f}')" "$(date +%s.%N)" "$s") s (the shell's clock): $(grep -E '^done:' /tmp/logs/train-$p.log)"
done
${PY:-python3} - "$OUT/fsdp-losses.md" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
rows, out = {}, []
for p in ("B", "F"):
    run = Path("/tmp/runs") / p
    ckpts = sorted(run.glob("checkpoint-*"), key=lambda c: int(c.name.split("-")[1]))
    if not ckpts:
        out.append(f"- preset {p}: no checkpoint (see train-{p}.log)")
        continue
    hist = json.loads((ckpts[-1] / "trainer_state.json").read_text())["log_history"]
    res = json.loads((run / "train.json").read_text())
    rows[p] = {h["step"]: h["loss"] for h in hist if "loss" in h}
    r0 = res["ranks"][0]
    # Steady steps (the first 3 are warm-up): tokens of every rank over each step's own time.
    per_step = []
    for i in range(3, len(r0["steps"])):
        tok = sum(r["cum_tokens"][i] - r["cum_tokens"][i - 1] for r in res["ranks"])
        per_step.append((tok, r0["steps"][i]["step_s"]))
    mean = sum(t for t, _ in per_step) / sum(s for _, s in per_step) if per_step else float("nan")
    med = sorted(t / s for t, s in per_step)[len(per_step) // 2] if per_step else float("nan")
    out.append(f"- preset {p}: {res.get('global_step')} steps; {mean:,.0f} tokens/s on the mean step, {med:,.0f} on the "
               f"median (steps 4-{len(r0['steps'])}); peak allocated {r0.get('peak_allocated_mib')} MiB per GPU; "
               f"{res['model'].get('levers', {}).get('sharding', 'DDP: one whole copy per rank')}")
if len(rows) == 2:
    steps = sorted(set(rows["B"]) & set(rows["F"]))
    worst = max(abs(rows["B"][s] - rows["F"][s]) for s in steps)
    out += ["", f"max |loss B - loss F| over steps {steps[0]}-{steps[-1]}: {worst:.2e}", "",
            "| step | DDP (B) | F | difference |", "| --- | --- | --- | --- |"]
    out += [f"| {s} | {rows['B'][s]:.5f} | {rows['F'][s]:.5f} | {rows['F'][s] - rows['B'][s]:+.2e} |" for s in steps]
text = "\n".join(["# Preset F (FSDP2) against DDP (preset B), world size 1, the same seed and data", "", *out, ""])
Path(sys.argv[1]).write_text(text)
print(text)
EOF
l=$(left)
if [ "$l" -gt 120 ]; then
  stamp "dryrun preset F (at most $(( l - 20 )) s)"
  rm -rf /tmp/runs/dry
  timeout -k 10 $(( l - 20 )) $TL dryrun $CONFIG model_name_or_path=$MODEL dataset=$DATASET cache_dir=/tmp/cache \
    output_dir=/tmp/runs/dry dryrun_steps=8 dryrun_warmup_steps=2 lora_dropout=0 $EXTRA --preset F $FLAGS \
    > /tmp/logs/dryrun-F.log 2>&1
  stamp "dryrun F exit $?"
  cp /tmp/runs/dry/dryrun.md "$OUT/dryrun-F.md" 2>/dev/null; cp /tmp/runs/dry/dryrun.json "$OUT/dryrun-F.json" 2>/dev/null
else
  stamp "dryrun F skipped: $l s left"
fi
tar czf "$OUT/logs.tgz" -C /tmp logs 2>/dev/null
stamp "done"
