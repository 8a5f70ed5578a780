#!/usr/bin/env bash
# Smoke tests of a built tuneledger image, through docker-compose.yml, on a machine without GPUs.
# Used by .ci/image-build.sh (CI's Debian stand-in) and .github/workflows/image.yml (the CUDA base).
#   IMAGE=tuneledger:ci .ci/image-smoke.sh
# Environment:
#   IMAGE     the image to test (required)
#   DATA_DIR  a folder with alpaca_zh_demo.json and alpaca_en_demo.json: `stats` must give the known
#             counts (../shared/data by default); without one, `stats` runs on the packaged demo data
#   COMPOSE   docker-compose (default when installed) or "docker compose"
#   PYTHON    a Python with PyYAML (default .venv/bin/python, else python3)
# The compose file is used as is, less what a machine without a GPU runtime cannot start: the GPU
# device reservations and the memlock ulimit.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
start=$(date +%s)
step() { printf '\n=== smoke: %s (%ss)\n' "$*" "$(( $(date +%s) - start ))"; }
fail() { echo "smoke: FAIL: $*" >&2; exit 1; }
: "${IMAGE:?set IMAGE to the image to test}"
py=${PYTHON:-$root/.venv/bin/python}
[ -x "$py" ] || py=python3
if [ -z "${COMPOSE:-}" ]; then
    if command -v docker-compose >/dev/null 2>&1; then COMPOSE=docker-compose; else COMPOSE="docker compose"; fi
fi
docker=${DOCKER:-docker}
project=tuneledger-smoke
work=$(mktemp -d)
cleanup() {
    rc=$?
    [ ! -f "$work/compose.yml" ] || $COMPOSE -p "$project" -f "$work/compose.yml" down -t 5 >/dev/null 2>&1 || true
    rm -rf "$work" 2>/dev/null || true
    exit $rc
}
trap cleanup EXIT

step "compose: docker-compose.yml with scratch folders, less the GPU reservation"
# As root, run the containers as the image's own user (1000); otherwise as the caller.
if [ "$(id -u)" = 0 ]; then uid=1000 gid=1000; else uid=$(id -u) gid=$(id -g); fi
mkdir -p "$work/models" "$work/runs" "$work/cache" "$work/data"
[ "$(id -u)" != 0 ] || chown "$uid:$gid" "$work/models" "$work/runs" "$work/cache"
data=${DATA_DIR:-$root/../shared/data}
if [ -f "$data/alpaca_zh_demo.json" ]; then data=$(cd "$data" && pwd); else data=$work/data; fi
export IMAGE HOST_UID=$uid HOST_GID=$gid DATA_DIR=$data MODELS_DIR=$work/models RUNS_DIR=$work/runs \
    CACHE_DIR=$work/cache MONITOR_INTERVAL=2 TENSORBOARD_PORT=16006
$COMPOSE -f docker-compose.yml config >"$work/compose.full.yml"
"$py" - "$work/compose.full.yml" "$work/compose.yml" <<'PY'
import sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
for name, svc in doc["services"].items():
    svc.pop("build", None)  # built already
    if (svc.get("ulimits") or {}).pop("memlock", None) is not None:
        print(f"  {name}: ulimit memlock removed (a sandboxed engine may refuse to raise it)")
    res = (svc.get("deploy") or {}).get("resources") or {}
    if (res.pop("reservations", None) or {}).get("devices"):
        print(f"  {name}: GPU reservation removed (no GPU runtime here)")
    if not res:
        svc.pop("deploy", None)
yaml.safe_dump(doc, open(sys.argv[2], "w"), sort_keys=False)
PY
dc() { $COMPOSE -p "$project" -f "$work/compose.yml" "$@"; }
run() { dc run --rm -T trainer "$@"; }
http_ok() { "$py" -c "import urllib.request; r = urllib.request.urlopen('$1', timeout=10); print('  HTTP', r.status, '$1')"; }

step "tuneledger --version; the build record against the image's labels; the attention backend"
run tuneledger --version
run cat /opt/venv/tuneledger-image.json >"$work/record.json"
$docker image inspect "$IMAGE" --format '{{json .Config.Labels}}' >"$work/labels.json"
"$py" - "$work/record.json" "$work/labels.json" <<'PY'
import json, sys
rec, labels = (json.load(open(p)) for p in sys.argv[1:3])
print("  " + ", ".join(f"{k}={v}" for k, v in rec.items()))
want = {"io.tuneledger.cuda": rec["torch_cuda"], "io.tuneledger.torch": rec["torch"].split("+")[0],
        "io.tuneledger.flash-attn": rec["flash-attn"] or "none",
        **{f"io.tuneledger.{k}": rec[k] for k in ("transformers", "peft", "accelerate", "bitsandbytes", "datasets")}}
bad = [f"{k}: label {labels.get(k)!r}, installed {v!r}" for k, v in want.items() if labels.get(k) != v]
if not rec["python"].startswith(labels.get("io.tuneledger.python", "?") + "."):
    bad.append(f"python: label {labels.get('io.tuneledger.python')!r}, installed {rec['python']!r}")
if bad:
    sys.exit("labels disagree with the image: " + "; ".join(bad))
print("  every io.tuneledger.* label matches what is installed")
PY
run python -c "
import json
from tuneledger.model import attention_backend
want = json.load(open('/opt/venv/tuneledger-image.json'))['attention_on_gpu']
got = attention_backend('auto', 'cuda')
assert got == want, (got, want)
print('  attention on a GPU with flash_attn=auto:', got, '(flash-attn absent: SDPA fallback)' if got == 'sdpa' else '')
"

step "synth-model (tiny random Qwen2, real Qwen2.5 tokenizer, no download) and preflight"
run tuneledger synth-model --arch tiny models/synthetic-tiny
run tuneledger preflight configs/tiny.yaml model_name_or_path=models/synthetic-tiny --cpu

if [ "$data" != "$work/data" ]; then
    step "stats on $data (mounted read-only) against the known counts"
    check_stats() {  # name file records tokens max
        run tuneledger stats configs/tiny.yaml model_name_or_path=models/synthetic-tiny \
            "dataset=data/$2" "run_name=ci-$1" >"$work/stats-$1.log" 2>&1 || { cat "$work/stats-$1.log"; fail "stats $2"; }
        "$py" - "$work/runs/ci-$1/stats.json" "$2" "$3" "$4" "$5" <<'PY'
import json, sys
path, name, records, tokens, longest = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
s = json.load(open(path))
got = (s["records"]["total"], s["records"]["valid"], s["tokens"]["total"], s["length"]["max"])
want = (records, records, tokens, longest)
print(f"  {name}: records {got[0]:,} (valid {got[1]:,}), tokens {got[2]:,}, max {got[3]:,}", "ok" if got == want else f"WANT {want}")
sys.exit(got != want)
PY
    }
    check_stats zh alpaca_zh_demo.json 1000 154874 565
    check_stats en alpaca_en_demo.json 999 194198 682
else
    step "stats on the packaged demo data (no DATA_DIR with the alpaca demos here)"
    run tuneledger stats configs/tiny.yaml model_name_or_path=models/synthetic-tiny run_name=ci-demo >"$work/stats.log" 2>&1 \
        || { cat "$work/stats.log"; fail "stats"; }
    tail -3 "$work/stats.log"
fi

step "compose up monitor (no GPU: stays up, records 'no GPU' rows) and tensorboard"
if run tuneledger monitor --help >/dev/null 2>&1; then services="monitor tensorboard"; else
    echo "  SKIPPED monitor: this tree has no \`tuneledger monitor\` verb yet"; services=tensorboard; fi
dc up -d $services
sleep 9
for svc in $services; do
    state=$($docker inspect -f '{{.State.Status}} restarts={{.RestartCount}}' "$(dc ps -q "$svc")")
    echo "  $svc: $state"
    [ "$state" = "running restarts=0" ] || { dc logs --tail 30 "$svc"; fail "$svc did not stay up"; }
done
if [ "$services" != tensorboard ]; then
    dc logs --tail 5 monitor
    "$py" - "$work/runs/monitor" <<'PY'
import csv, sys
from pathlib import Path
files = sorted(Path(sys.argv[1]).glob("*.csv"))
rows = [r for f in files for r in csv.DictReader(open(f))]
print(f"  {', '.join(f.name for f in files)}: {len(rows)} rows")
for r in rows[:2]:
    print(f"    {r['timestamp']} host={r['host']} status={r['status']} error={r['error']}")
ok = len(rows) >= 2 and all(r["status"] == "unavailable" and "no GPU" in r["error"] for r in rows)
sys.exit(0 if ok else "monitor: want at least 2 rows, all 'unavailable' with 'no GPU' in error")
PY
fi
http_ok http://127.0.0.1:16006/ || { dc logs --tail 30 tensorboard; fail "tensorboard does not answer"; }
dc down -t 5 >/dev/null 2>&1

step "passed"
