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
#   EXPECT_REVISION  the commit the image's org.opencontainers.image.revision label must name
#   FULL_DRYRUN=0    `make dryrun PRESET=A` in the fresh clone instead of every preset (faster)
# docker-compose.yml is used as it is: it must start on a Docker without the NVIDIA runtime, which
# is what every machine running this has. What only a GPU machine proves: the GPU overlays
# (docker-compose.gpu.yml, .cdi.yml) starting containers, NVML rows, memlock under the NVIDIA runtime.
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
export COMPOSE
unset COMPOSE_FILE COMPOSE_PROJECT_NAME TUNELEDGER_GPU
docker=${DOCKER:-docker}
project=tuneledger-smoke
work=$(mktemp -d)
projects=()  # compose projects of the fresh clones: name:folder
cleanup() {
    rc=$?
    [ $rc = 0 ] || for p in "${projects[@]}"; do (cd "${p#*:}" && $COMPOSE -p "${p%%:*}" logs --tail 20 2>/dev/null) || true; done
    $COMPOSE -p "$project" -f "$root/docker-compose.yml" down -t 5 >/dev/null 2>&1 || true
    for p in "${projects[@]}"; do (cd "${p#*:}" && $COMPOSE -p "${p%%:*}" down -t 5 >/dev/null 2>&1) || true; done
    rm -f "$root/.Dockerfile.legacy" "$root/.Dockerfile.quant.legacy"
    rm -rf "$work" 2>/dev/null || true
    exit $rc
}
trap cleanup EXIT

step "compose: docker-compose.yml as it is, with scratch folders"
# As root, run the containers as the image's own user (1000); otherwise as the caller.
if [ "$(id -u)" = 0 ]; then uid=1000 gid=1000; else uid=$(id -u) gid=$(id -g); fi
mkdir -p "$work/models" "$work/runs" "$work/cache" "$work/data"
[ "$(id -u)" != 0 ] || chown "$uid:$gid" "$work/models" "$work/runs" "$work/cache"
data=${DATA_DIR:-$root/../shared/data}
if [ -f "$data/alpaca_zh_demo.json" ]; then data=$(cd "$data" && pwd); else data=$work/data; fi
export IMAGE HOST_UID=$uid HOST_GID=$gid DATA_DIR=$data MODELS_DIR=$work/models RUNS_DIR=$work/runs \
    CACHE_DIR=$work/cache MONITOR_INTERVAL=2 TENSORBOARD_PORT=16006
dc() { $COMPOSE -p "$project" -f "$root/docker-compose.yml" "$@"; }
run() { dc run --rm -T trainer "$@"; }
http_ok() { "$py" -c "import urllib.request; r = urllib.request.urlopen('$1', timeout=10); print('  HTTP', r.status, '$1')"; }

# ---- a fresh clone, as a user gets it: no runs/, no .env, nothing set ------------------------------
clone=$work/clone
git clone -q "$root" "$clone"
cproject=tuneledger-clone
projects+=("$cproject:$clone")
fresh() { (cd "$clone" && env -u HOST_UID -u HOST_GID -u DATA_DIR -u MODELS_DIR -u RUNS_DIR -u CACHE_DIR \
    -u MONITOR_INTERVAL -u TENSORBOARD_PORT COMPOSE_PROJECT_NAME=$cproject "$@"); }

step "fresh clone: docker compose up -d monitor (issues 11.3, 11.7): healthy within a minute, writing rows"
[ ! -e "$clone/runs" ] || fail "the clone has runs/ already"
# Plain compose runs the services as 1000:1000 unless .env says otherwise; a user with another uid
# writes HOST_UID/HOST_GID there first (docs/container.md), as root or uid 1000 nothing is needed.
svc_uid=1000
if [ "$(id -u)" != 0 ] && [ "$(id -u)" != 1000 ]; then
    printf 'HOST_UID=%s\nHOST_GID=%s\n' "$(id -u)" "$(id -g)" >"$clone/.env"
    svc_uid=$(id -u)
    echo "  .env: HOST_UID=$(id -u) HOST_GID=$(id -g) (this user is not 1000)"
fi
fresh $COMPOSE up -d monitor
mon=$(fresh $COMPOSE ps -q monitor)
health=
for i in $(seq 60); do
    health=$($docker inspect -f '{{.State.Health.Status}}' "$mon")
    [ "$health" = healthy ] && break
    sleep 1
done
echo "  health: $health after ${i}s; $($docker inspect -f 'restarts={{.RestartCount}}' "$mon")"
fresh $COMPOSE logs --no-color monitor 2>&1 | sed 's/^/    /' | tail -4
[ "$health" = healthy ] || fail "monitor not healthy within a minute"
[ "$($docker inspect -f '{{.RestartCount}}' "$mon")" = 0 ] || fail "monitor restarted"
logs=$(fresh $COMPOSE logs --no-color monitor 2>&1)
grep -q 'runs/ was empty and owned by root' <<<"$logs" || fail "the entrypoint did not say it gave runs/ to the service's user"
grep -q '(until SIGTERM/SIGINT)' <<<"$logs" && ! grep -q 'SIGINT samples' <<<"$logs" || fail "monitor banner"
echo "  runs/ now $(stat -c %u:%g "$clone/runs"), Docker made it as root; banner reads '(until SIGTERM/SIGINT)'"
mounts=$($docker inspect -f '{{range .Mounts}}{{.Destination}} {{end}}' "$mon")
[ "$mounts" = "/workspace/runs " ] || fail "monitor mounts: $mounts, want /workspace/runs only"
echo "  mounts: $mounts"
"$py" - "$clone/runs/monitor" "$(hostname)" "$svc_uid" <<'PY'
import csv, os, sys
from pathlib import Path
folder, host, uid = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
files = sorted(folder.glob("*.csv"))
rows = [r for f in files for r in csv.DictReader(open(f))]
print(f"  {', '.join(f.name for f in files)}: {len(rows)} rows, owner uid {files[0].stat().st_uid}; first: "
      f"{rows[0]['timestamp']} host={rows[0]['host']} status={rows[0]['status']} error={rows[0]['error']}")
assert [f.name[: len(host) + 1] for f in files] == [host + "-"], f"file named for {host}: {files}"
assert all(r["host"] == host for r in rows), "rows carry the real host name"
assert all(r["status"] == "unavailable" and "no GPU" in r["error"] for r in rows), "no-GPU rows"
assert files[0].stat().st_uid == uid, f"written by the service's user ({uid}), not root"
PY
# The healthcheck itself: an old row, or only another host's, is unhealthy.
hc() { $docker exec "$mon" sh -c "rm -rf /tmp/h && mkdir /tmp/h && printf 'timestamp,host,status\n%s,%s,ok\n' \"$1\" \"$2\" >/tmp/h/x.csv && monitor-health /tmp/h"; }
now=$(date -u +%Y-%m-%dT%H:%M:%S.000Z)
out=$(hc 2026-01-01T00:00:00.000Z "$(hostname)") && fail "an old row passed: $out"; echo "  old row: $out"
out=$(hc "$now" other-host) && fail "another host's row passed: $out"; echo "  another host's row: $out"
out=$(hc "$now" "$(hostname)") || fail "a fresh row failed: $out"; echo "  fresh row: $out"

step "fresh clone: make stats, then make dryrun, in the container beside the monitor (issue 11.1)"
t0=$(date +%s)
fresh make stats >"$work/make-stats.log" 2>&1 || { tail -30 "$work/make-stats.log"; fail "make stats"; }
grep -E '^tuneledger:|records|tokens' "$work/make-stats.log" | head -8
grep -q '^tuneledger: Docker without the NVIDIA runtime: CPU only; compose files docker-compose.yml;' "$work/make-stats.log" \
    || fail "make stats: which compose files it chose"
[ -f "$clone/runs/tiny/stats.json" ] || fail "make stats wrote no runs/tiny/stats.json"
echo "  make stats (synth-model, then stats) in the container: $(( $(date +%s) - t0 ))s"
dr_args=()
[ "${FULL_DRYRUN:-1}" = 1 ] || dr_args=(PRESET=A)
t0=$(date +%s)
fresh make dryrun "${dr_args[@]}" >"$work/make-dryrun.log" 2>&1 || { tail -30 "$work/make-dryrun.log"; fail "make dryrun"; }
tail -12 "$work/make-dryrun.log"
ls "$clone"/runs/tiny/dryrun.json >/dev/null || fail "make dryrun wrote no runs/tiny/dryrun.json"
echo "  make dryrun ${dr_args[*]:-(every preset)} in the container: $(( $(date +%s) - t0 ))s"
[ "$($docker inspect -f '{{.State.Health.Status}} {{.RestartCount}}' "$mon")" = "healthy 0" ] || fail "monitor not healthy after the run"

step "a runs/ the monitor cannot fix (another user's, not empty): one message, then it waits instead of looping"
locked=$work/locked
mkdir -p "$locked" && touch "$locked/keep" && chmod 755 "$locked"
(cd "$clone" && HOST_UID=4242 HOST_GID=4242 RUNS_DIR="$locked" COMPOSE_PROJECT_NAME=tuneledger-locked $COMPOSE up -d monitor)
projects+=("tuneledger-locked:$clone")
sleep 20
lmon=$(cd "$clone" && COMPOSE_PROJECT_NAME=tuneledger-locked $COMPOSE ps -q monitor)
llogs=$($docker logs "$lmon" 2>&1)
sed 's/^/    /' <<<"$llogs"
restarts=$($docker inspect -f '{{.RestartCount}}' "$lmon")
grep -q "cannot write to runs/" <<<"$llogs" && grep -q "sudo chown -R 4242:4242 runs" <<<"$llogs" \
    && grep -q "HOST_UID=$(id -u) and HOST_GID=$(id -g)" <<<"$llogs" || fail "the message does not say how to fix it"
[ "$restarts" = 0 ] && [ "$(grep -c 'cannot write' <<<"$llogs")" = 1 ] || fail "restarted $restarts times in 20 s"
echo "  one message in 20 s, restarts=$restarts: it waits 60 s before the restart policy tries again"
(cd "$clone" && COMPOSE_PROJECT_NAME=tuneledger-locked $COMPOSE down -t 2 >/dev/null 2>&1) || true
fresh $COMPOSE down -t 5 >/dev/null 2>&1

step "passed"
