#!/usr/bin/env bash
# The whatif predictions of docs/whatif.md, from the committed H200 ledgers; each command's output
# is the .txt of its name. Run from the repository root: bash bench/results/whatif-2026-12-02/run.sh
set -u
cd "$(dirname "$0")/../../.."
OUT=bench/results/whatif-2026-12-02
PY=${PY:-.venv/bin/python}
S=bench/results/h200-2026-11-30-scaling
run() {  # name, then the arguments of `tuneledger whatif`
  local name=$1; shift
  { echo "\$ tuneledger whatif $*"; $PY -m tuneledger whatif "$@" 2>&1; echo "(exit $?)"; } > "$OUT/$name.txt"
}
# 1. The field report's 8x RTX 4090 (PCIe 4.0, no NVLink): its full run is 278,024 records = 17,377 steps, a save every 200.
run field-8x4090-from-1gpu $S/dryrun-1gpu.json --gpus 8x4090-pcie --steps 17377 --save-steps 200 --json $OUT/field-8x4090-from-1gpu.json
run field-8x4090-from-2gpu $S/dryrun-2gpu.json --gpus 8x4090-pcie --steps 17377 --save-steps 200 --json $OUT/field-8x4090-from-2gpu.json
run field-8x4090-from-session3-C bench/results/h200-2026-12-01-session3/call3/run-eta-C-1gpu/dryrun.json --gpus 8x4090-pcie --steps 17377 --save-steps 200
# sensitivity, not a prediction: the same with a host 1.5x faster per launch than the lent VM
run field-8x4090-fast-host-sensitivity $S/dryrun-1gpu.json --gpus $OUT/4090-fast-host.yaml --steps 17377 --save-steps 200
# 2. 1 H200 -> 2 H200, against the committed 2-GPU ledger of the same call
run h200-1-to-2 $S/dryrun-1gpu.json --gpus 2xH200-sxm --against $S/dryrun-2gpu.json
# 3. Other boxes from the same ledger (no measurement to check them against)
run other-4xA100-80g-nvlink $S/dryrun-1gpu.json --gpus 4xA100-80g-nvlink
run other-8xH100-sxm $S/dryrun-1gpu.json --gpus 8xH100-sxm
run other-1xH200-sxm $S/dryrun-1gpu.json --gpus 1xH200-sxm
# 4. Bad input
run bad-unknown-gpu $S/dryrun-1gpu.json --gpus 8x5090
run bad-does-not-fit $S/dryrun-1gpu.json --gpus 8x4090-pcie --preset C
# 5. The field report's parts against the prediction (docs/whatif.md's table)
$PY - "$OUT/field-8x4090-from-1gpu.json" "$OUT/field-8x4090-from-2gpu.json" > "$OUT/field-errors.md" <<'PY'
import json, sys
field = {"A s/step": 1.10, "A forward+backward per micro-batch": 0.45, "A beyond the micro-batches (the report's 'all-reduce')": 0.20,
         "A tokens/s, 8 GPUs": 9800, "C s/step": 0.96}
print("| part | field report | predicted from " + " | predicted from ".join(p.split("/")[-1].removesuffix(".json").split("from-")[1] for p in sys.argv[1:]) + " |")
print("| --- | --- |" + " --- |" * len(sys.argv[1:]))
preds = [{p["preset"]: p for p in json.load(open(f))["predictions"]} for f in sys.argv[1:]]
def parts(p):
    a, c = p["A"], p["C"]
    return {"A s/step": a["s_per_step"], "A forward+backward per micro-batch": a["micro_s"],
            "A beyond the micro-batches (the report's 'all-reduce')": a["s_per_step"] - a["ga"] * a["micro_s"],
            "A tokens/s, 8 GPUs": a["tokens_per_s"], "C s/step": c["s_per_step"]}
rows = [parts(p) for p in preds]
for k, v in field.items():
    cells = [f"{r[k]:,.3f} ({(r[k] - v) / v * 100:+.1f}%)" if v < 100 else f"{r[k]:,.0f} ({(r[k] - v) / v * 100:+.1f}%)" for r in rows]
    print(f"| {k} | {v:,} | " + " | ".join(cells) + " |")
gib = 2**30
cells = [f"A {p['A']['memory']['total'] / gib:.1f} GiB, B {p['B']['memory']['total'] / gib:.1f} GiB, C {p['C']['memory']['total'] / gib:.1f} GiB allocated; B + 1 GiB outside the allocator = {(p['B']['memory']['total'] + gib) / 1e9:.1f} GB" for p in preds]
print("| memory per card | 13.4-13.9 GB (nvidia-smi, the run the report calls C) | " + " | ".join(cells) + " |")
PY
echo "wrote $OUT"
