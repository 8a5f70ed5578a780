#!/usr/bin/env bash
# whatif at the code of 2026-12-07: the target's matmul peak is its measured figure where its
# hardware entry has one (bf16_tflops_measured: public torch.mm records; an RTX 4090 reaches 164.8
# TFLOP/s, not the 79% of its datasheet that an H200 reaches). Every prediction of docs/whatif.md,
# each command's output in the .txt of its name. From the repository root, on a CPU (seconds):
#   bash bench/results/whatif-2026-12-07/run.sh
set -u
cd "$(dirname "$0")/../../.."
OUT=bench/results/whatif-2026-12-07
PY=${PY:-.venv/bin/python}
S=bench/results/h200-2026-11-30-scaling   # November: presets A-D, eager stack, 1 and 2 H200s
D=bench/results/whatif-2026-12-04         # December: tune's A and C (compiled layers, Liger, fused LoRA), one H200
run() {  # name, then the arguments of `tuneledger whatif`
  local name=$1; shift
  { echo "\$ tuneledger whatif $*"; $PY -m tuneledger whatif "$@" 2>&1; echo "(exit $?)"; } > "$OUT/$name.txt"
}
# 1. The field report's 8x RTX 4090 (PCIe 4.0, no NVLink): 17,377 steps, a save every 200.
run field-8x4090-from-1gpu $S/dryrun-1gpu.json --gpus 8x4090-pcie --steps 17377 --save-steps 200 --json $OUT/field-8x4090-from-1gpu.json
run field-8x4090-from-2gpu $S/dryrun-2gpu.json --gpus 8x4090-pcie --steps 17377 --save-steps 200 --json $OUT/field-8x4090-from-2gpu.json
run field-8x4090-A-from-december $D/tune-cand1-A-dryrun.json --gpus 8x4090-pcie --steps 17377 --save-steps 200 --json $OUT/field-8x4090-A-from-december.json
run field-8x4090-B-from-december $OUT/tune-cand2-B-dryrun.json --gpus 8x4090-pcie --steps 17377 --save-steps 200 --json $OUT/field-8x4090-B-from-december.json
run field-8x4090-C-from-december $D/tune-cand3-C-dryrun.json --gpus 8x4090-pcie --steps 17377 --save-steps 200 --json $OUT/field-8x4090-C-from-december.json
# 2. 1 H200 -> 2 H200, against the committed 2-GPU ledger of the same call
run h200-1-to-2 $S/dryrun-1gpu.json --gpus 2xH200-sxm --against $S/dryrun-2gpu.json
# 3. Other boxes (nothing to check them against)
run other-4xA100-80g-nvlink $S/dryrun-1gpu.json --gpus 4xA100-80g-nvlink
run other-8xH100-sxm $S/dryrun-1gpu.json --gpus 8xH100-sxm
run bad-does-not-fit $S/dryrun-1gpu.json --gpus 8x4090-pcie --preset C
# 4. The field report's parts beside the predictions. "overlapped": a sensitivity, not the model: the
# same step if DDP hid the all-reduce behind the last micro-batch's backward but its last bucket.
$PY - "$OUT" > "$OUT/field-errors.md" <<'PY'
import json, sys
out = sys.argv[1]
load = lambda name: {p["preset"]: p for p in json.load(open(f"{out}/{name}.json"))["predictions"]}
nov1, nov2 = load("field-8x4090-from-1gpu"), load("field-8x4090-from-2gpu")
dec = {**load("field-8x4090-A-from-december"), **load("field-8x4090-B-from-december"), **load("field-8x4090-C-from-december")}
def overlapped(p):
    ar = p["allreduce"]
    last = ar["s"] / ar["buckets"] if ar["buckets"] else 0.0
    return p["s_per_step"] - ar["s"] + last
def e(pred, field):
    return f"{pred:,.3f} ({(pred - field) / field * 100:+.1f}%)" if field < 100 else f"{pred:,.0f} ({(pred - field) / field * 100:+.1f}%)"
rows = [("A s/step", 1.10, lambda s: s["A"]["s_per_step"]),
        ("A forward+backward per micro-batch", 0.45, lambda s: s["A"]["micro_s"]),
        ("A beyond the micro-batches (the report's 'all-reduce')", 0.20, lambda s: s["A"]["s_per_step"] - s["A"]["ga"] * s["A"]["micro_s"]),
        ("A tokens/s, 8 GPUs", 9800, lambda s: s["A"]["tokens_per_s"]),
        ("C s/step (micro-batch 2, checkpointing off)", 0.96, lambda s: s["C"]["s_per_step"]),
        ("B s/step (micro-batch 2, checkpointing on: the field's C if its checkpointing stayed on)", 0.96, lambda s: s["B"]["s_per_step"]),
        ("A s/step, all-reduce overlapped (sensitivity)", 1.10, lambda s: overlapped(s["A"])),
        ("C s/step, all-reduce overlapped (sensitivity)", 0.96, lambda s: overlapped(s["C"]))]
print("| part | field report | from the November 1-GPU ledger | from the November 2-GPU ledger | from the December ledgers |")
print("| --- | --- | --- | --- | --- |")
for name, field, get in rows:
    print(f"| {name} | {field:,} | " + " | ".join(e(get(s), field) for s in (nov1, nov2, dec)) + " |")
gib = 2**30
print("| memory per card, allocated (+1 GiB outside the allocator) | 13.4-13.9 GB (nvidia-smi) | " + " | ".join(
    f"A {s['A']['memory']['total'] / gib:.1f}, B {s['B']['memory']['total'] / gib:.1f} ({(s['B']['memory']['total'] + gib) / 1e9:.1f} GB), "
    f"C {s['C']['memory']['total'] / gib:.1f} GiB" for s in (nov1, nov2, dec)) + " |")
print()
print("| bound on the 4090 | A | B | C |")
print("| --- | --- | --- | --- |")
for label, s in (("November 1-GPU", nov1), ("December", dec)):
    print(f"| {label} | " + " | ".join(f"{s[k]['bound']} (GPU {s[k]['gpu_s']:.3f} s, host {'unknown' if s[k]['host_s'] is None else format(s[k]['host_s'], '.3f') + ' s'}" + (f", idle {s[k]['idle_s']:.3f} s" if s[k]['idle_s'] else '') + ")" for k in "ABC") + " |")
PY
echo "wrote $OUT"
