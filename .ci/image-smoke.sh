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
#   FULL_DRYRUN=1    `make dryrun` of every preset in the fresh clone; default PRESET=A (the sweep
#                    of every preset runs in `make test`; here the container path is what is tested)
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

step "GPU or CPU (issue 11.1): this engine has no NVIDIA runtime, so make picks docker-compose.yml alone"
facts=$(docker/engine-facts)
echo "  docker/engine-facts: $facts"
[ "${facts%% *}" = gpu=none ] || fail "engine-facts on an engine without NVIDIA: $facts"
said=$(make -n stats 2>&1 | grep '^tuneledger:' || true)
echo "  make says: $said"
case "$said" in *"without the NVIDIA runtime: CPU only; compose files docker-compose.yml;"*) ;; *) fail "make's choice: $said";; esac
# The other engines, through a stand-in \`docker\` that answers `info` as they would.
stub() {  # stub DIR INFO_JSON: a docker that answers `info` with INFO_JSON and fails everything else
    mkdir -p "$1"
    printf '%s\n' "$2" >"$1/info.json"
    printf '#!/bin/sh\ncase "$1" in info) cat "%s/info.json";; *) exit 1;; esac\n' "$1" >"$1/docker"
    chmod +x "$1/docker"
}
stub "$work/nvidia" '{"Runtimes":{"io.containerd.runc.v2":{"path":"runc"},"nvidia":{"path":"nvidia-container-runtime"}},"SecurityOptions":["name=seccomp,profile=builtin"]}'
mkdir -p "$work/cdi-specs" && printf 'cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices: []\n' >"$work/cdi-specs/nvidia.yaml"
stub "$work/cdi" '{"Runtimes":{"runc":{"path":"runc"}},"CDISpecDirs":["'"$work/cdi-specs"'"],"SecurityOptions":[]}'
stub "$work/rootless" '{"Runtimes":{"runc":{"path":"runc"}},"SecurityOptions":["name=seccomp,profile=builtin","name=rootless"]}'
for kind in nvidia cdi; do
    said=$(PATH="$work/$kind:$PATH" make -n dryrun 2>&1 | grep '^tuneledger:' || true)
    echo "  $kind engine: $said"
    case "$said" in *"compose files docker-compose.yml + docker-compose.$([ $kind = nvidia ] && echo gpu || echo cdi).yml;"*) ;; *) fail "make's choice on a $kind engine: $said";; esac
    out=$(PATH="$work/$kind:$PATH" make -n dryrun 2>&1)
    grep -q 'configs/qwen2.5-7b-qlora.yaml' <<<"$out" || fail "$kind engine: dryrun is not the GPU job"
done
vals=$(env -u HOST_UID -u HOST_GID PATH="$work/rootless:$PATH" make --eval 'print-%: ; @echo $*=$($*)' print-HOST_UID print-HOST_GID print-MEMLOCK 2>/dev/null | grep '=' | tr '\n' ' ')
echo "  rootless engine: $vals"
want_memlock=$(l=$(ulimit -Hl); [ "$l" = unlimited ] && echo -1 || echo $((l * 1024)))
[ "$vals" = "HOST_UID=0 HOST_GID=0 MEMLOCK=$want_memlock " ] || fail "rootless: want HOST_UID=0 HOST_GID=0 MEMLOCK=$want_memlock"
vals=$(env -u HOST_UID -u HOST_GID make --eval 'print-%: ; @echo $*=$($*)' print-HOST_UID print-HOST_GID 2>/dev/null | grep '=' | tr '\n' ' ')
[ "$vals" = "HOST_UID=$(id -u) HOST_GID=$(id -g) " ] || fail "make's default user: $vals, want yours"
echo "  rootful engine: $vals (yours)"
for files in "" docker-compose.gpu.yml docker-compose.cdi.yml; do
    env -u MEMLOCK $COMPOSE -f docker-compose.yml ${files:+-f $files} config >"$work/config.yml"
    "$py" - "$work/config.yml" "${files:-docker-compose.yml alone}" <<'PY'
import sys, yaml
services = yaml.safe_load(open(sys.argv[1]))["services"]
def devices(s):
    return ((s.get("deploy") or {}).get("resources", {}).get("reservations") or {}).get("devices") or []
got = {n: [d.get("driver") for d in devices(s)] for n, s in services.items()}
want_driver = "nvidia" if "gpu" in sys.argv[2] else "cdi" if "cdi" in sys.argv[2] else None
want = {n: ([want_driver] if want_driver and n != "tensorboard" else []) for n in services}
memlock = {n: (s.get("ulimits") or {}).get("memlock") for n, s in services.items()}
assert got == want, (got, want)
assert memlock["trainer"] == (-1 if want_driver else None), memlock
print(f"  {sys.argv[2]}: GPU reservations {got}; trainer memlock {memlock['trainer']}")
PY
done
echo "  not proven here: that a GPU overlay starts a container (needs the NVIDIA toolkit)"

step "make image's builder (issue 11.4): BuildKit with buildx or a client before 23, else the legacy builder"
printf '#!/bin/sh\necho "compose $* DOCKER_BUILDKIT=$DOCKER_BUILDKIT TRAINER_DOCKERFILE=${TRAINER_DOCKERFILE:-} IMAGE_REVISION=$IMAGE_REVISION IMAGE_CREATED=$IMAGE_CREATED"\n' >"$work/fake-compose"
chmod +x "$work/fake-compose"
builder() {  # builder CLIENT_VERSION HAS_BUILDX
    mkdir -p "$work/client-$1-$2"
    printf '#!/bin/sh\ncase "$1" in version) echo %s;; buildx) exit %s;; *) exit 1;; esac\n' "$1" "$([ "$2" = yes ] && echo 0 || echo 1)" \
        >"$work/client-$1-$2/docker"
    chmod +x "$work/client-$1-$2/docker"
    PATH="$work/client-$1-$2:$PATH" COMPOSE="$work/fake-compose" docker/build trainer 2>&1
}
out=$(builder 28.2.2 no)
grep -q 'has no buildx plugin' <<<"$out" && grep -q 'docker-buildx-plugin' <<<"$out" && grep -q 'docker-buildx (Debian, Ubuntu)' <<<"$out" \
    && grep -q 'DOCKER_BUILDKIT=0 TRAINER_DOCKERFILE=.Dockerfile.legacy' <<<"$out" || { echo "$out"; fail "no-buildx fallback"; }
! grep -q -- '--mount' .Dockerfile.legacy || fail ".Dockerfile.legacy still has --mount"
[ "$(grep -c '^RUN' .Dockerfile.legacy)" = "$(grep -c '^RUN' Dockerfile)" ] || fail ".Dockerfile.legacy lost a RUN"
echo "  client 28.2.2 without buildx: legacy builder, says which package brings buildx; .Dockerfile.legacy has no --mount"
grep -q "DOCKER_BUILDKIT=1 TRAINER_DOCKERFILE= IMAGE_REVISION=$(git rev-parse HEAD 2>/dev/null)" <<<"$(builder 28.2.2 yes)" || fail "buildx present: not BuildKit"
grep -q 'DOCKER_BUILDKIT=1' <<<"$(builder 20.10.24 no)" || fail "client 20.10: not BuildKit"
echo "  with buildx, and a 20.10 client without it: BuildKit; IMAGE_REVISION is the checkout's commit"
IMAGE_PYTHON=/opt/py/bin/python3.10 IMAGE_PYTHON_APT_PACKAGES="libssl3 zlib1g" $COMPOSE -f docker-compose.yml config >"$work/config.yml"
"$py" - "$work/config.yml" <<'PY'
import sys, yaml
args = yaml.safe_load(open(sys.argv[1]))["services"]["trainer"]["build"]["args"]
assert (args["PYTHON"], args["PYTHON_APT_PACKAGES"]) == ("/opt/py/bin/python3.10", "libssl3 zlib1g"), args
print(f"  compose passes IMAGE_PYTHON and IMAGE_PYTHON_APT_PACKAGES as build args PYTHON={args['PYTHON']}, PYTHON_APT_PACKAGES={args['PYTHON_APT_PACKAGES']!r}")
PY

step "any HOST_UID/HOST_GID builds (issue 11.2): the image's add-user step, with IDs the base has and has not"
# The user of UID must end with GID as its group, a reused one too (it printed gid=1000 for
# "1000 100" and gid=0 for "0 100" and passed: issue 21.18).
for ids in "0 0" "1000 100" "4242 100" "4242 4242" "0 100"; do
    out=$($docker run --rm --user 0 --entrypoint sh "$IMAGE" -c "tuneledger-add-user $ids >/dev/null \
        && u=\$(getent passwd ${ids%% *} | cut -d: -f1) && echo \"\$(id -u \$u):\$(id -g \$u) \$(id \$u)\"") \
        || fail "add-user $ids"
    echo "  HOST_UID/GID $ids: ${out#* }"
    [ "${out%% *}" = "${ids% *}:${ids#* }" ] || fail "add-user $ids: the user is ${out%% *}, not ${ids% *}:${ids#* }"
done

step "tuneledger --version; the build record against the image's labels; the attention backend"
run tuneledger --version
run cat /opt/venv/tuneledger-image.json >"$work/record.json"
$docker image inspect "$IMAGE" --format '{{json .Config.Labels}}' >"$work/labels.json"
"$py" - "$work/record.json" "$work/labels.json" "$(docker/lock-hash trainer)" <<'PY'
import json, sys
rec, labels = (json.load(open(p)) for p in sys.argv[1:3])
print("  " + ", ".join(f"{k}={v}" for k, v in rec.items()))
want = {"io.tuneledger.cuda": rec["torch_cuda"], "io.tuneledger.torch": rec["torch"].split("+")[0],
        "io.tuneledger.flash-attn": rec["flash-attn"] or "none",
        **{f"io.tuneledger.{k}": rec[k] for k in ("transformers", "peft", "accelerate", "bitsandbytes", "datasets")}}
bad = [f"{k}: label {labels.get(k)!r}, installed {v!r}" for k, v in want.items() if labels.get(k) != v]
if not rec["python"].startswith(labels.get("io.tuneledger.python", "?") + "."):
    bad.append(f"python: label {labels.get('io.tuneledger.python')!r}, installed {rec['python']!r}")
# The locks' hash (issue 21.18): the label make image computed on the checkout, the hash of the
# files the build installed, and this checkout's must be one.
here = sys.argv[3]
if not (labels.get("io.tuneledger.locks.sha256") == rec.get("locks_sha256") == here):
    bad.append(f"locks: label {labels.get('io.tuneledger.locks.sha256')!r}, installed {rec.get('locks_sha256')!r}, "
               f"this checkout {here!r} (docker/lock-hash trainer)")
if bad:
    sys.exit("labels disagree with the image: " + "; ".join(bad))
print(f"  every io.tuneledger.* label matches what is installed; the locks' sha256 {here[:16]}... too")
PY
# The OCI labels of where the image came from (issue 11.7).
"$py" - "$work/labels.json" "${EXPECT_REVISION:-}" <<'PY'
import json, sys
from datetime import datetime, timezone
labels, want_rev = json.load(open(sys.argv[1])), sys.argv[2]
oci = {k: labels.get(f"org.opencontainers.image.{k}") for k in ("revision", "created", "source")}
print("  " + ", ".join(f"{k}={v!r}" for k, v in oci.items()))
missing = [k for k, v in oci.items() if v is None]
assert not missing, f"labels missing: {missing}"
assert oci["revision"], "revision is empty"
assert not want_rev or oci["revision"] == want_rev, f"revision {oci['revision']}, want {want_rev}"
created = datetime.strptime(oci["created"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
age_h = (datetime.now(timezone.utc) - created).total_seconds() / 3600
assert -1 < age_h < 48, f"created {oci['created']} is {age_h:.1f} h from now"
assert oci["source"] == "" or oci["source"].startswith("https://"), oci["source"]
PY
run python -c "
import json
from tuneledger.speed import pick_attention
want = json.load(open('/opt/venv/tuneledger-image.json'))['attention_on_gpu']
got, _ = pick_attention('auto', False, 'cuda')  # padded rows; packed ones get a varlen or flex kernel
assert got == want, (got, want)
packed, why = pick_attention('auto', True, 'cuda')
print('  attention on a GPU with flash_attn=auto:', got, '(flash-attn absent: SDPA fallback)' if got == 'sdpa' else '',
      '| packed rows:', packed, '-', why)
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

step "stop_grace_period (issue 11.6): a stopped trainer gets TUNELEDGER_GRACE_S, and SIGTERM reaches the command"
# The command stands in for the trainer's SIGTERM save: it takes 12 s to answer (Docker's default
# grace is 10 s), writes a file and exits 0.
cid=$(dc run -d trainer python -c "
import pathlib, signal, sys, time
def save(*_):
    time.sleep(12)
    pathlib.Path('runs/sigterm-saved').write_text('saved')
    sys.exit(0)
signal.signal(signal.SIGTERM, save)
pathlib.Path('runs/sigterm-ready').write_text('')
time.sleep(600)
" | tail -1)
for _ in $(seq 60); do [ -f "$work/runs/sigterm-ready" ] && break; sleep 1; done
grace=$($docker inspect -f '{{.Config.StopTimeout}}' "$cid")
t0=$(date +%s)
$docker stop "$cid" >/dev/null
took=$(( $(date +%s) - t0 ))
code=$($docker inspect -f '{{.State.ExitCode}}' "$cid")
$docker rm "$cid" >/dev/null
echo "  container StopTimeout ${grace}s; docker stop took ${took}s; exit code $code; saved: $(cat "$work/runs/sigterm-saved" 2>/dev/null || echo no)"
[ "$grace" = 300 ] && [ "$code" = 0 ] && [ -f "$work/runs/sigterm-saved" ] || fail "the SIGTERM save did not finish inside the grace period"

step "tensorboard stays up and answers"
dc up -d tensorboard
sleep 6
state=$($docker inspect -f '{{.State.Status}} restarts={{.RestartCount}}' "$(dc ps -q tensorboard)")
echo "  tensorboard: $state"
[ "$state" = "running restarts=0" ] || { dc logs --tail 30 tensorboard; fail "tensorboard did not stay up"; }
http_ok http://127.0.0.1:16006/ || { dc logs --tail 30 tensorboard; fail "tensorboard does not answer"; }
dc down -t 5 >/dev/null 2>&1

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
t0=$(date +%s)
fresh $COMPOSE up -d monitor
mon=$(fresh $COMPOSE ps -q monitor)
health=
while [ $(( $(date +%s) - t0 )) -le 60 ]; do
    health=$($docker inspect -f '{{.State.Health.Status}}' "$mon")
    [ "$health" = healthy ] && break
    sleep 1
done
echo "  health: $health $(( $(date +%s) - t0 ))s after \`up -d\`; $($docker inspect -f 'restarts={{.RestartCount}}' "$mon")"
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
grep -E '^tuneledger:|records|tokens' "$work/make-stats.log" | head -8 || true
grep -q '^tuneledger: Docker without the NVIDIA runtime: CPU only; compose files docker-compose.yml;' "$work/make-stats.log" \
    || fail "make stats: which compose files it chose"
[ -f "$clone/runs/tiny/stats.json" ] || fail "make stats wrote no runs/tiny/stats.json"
echo "  make stats (synth-model, then stats) in the container: $(( $(date +%s) - t0 ))s"
dr_args=()
[ "${FULL_DRYRUN:-0}" = 1 ] || dr_args=(PRESET=A)
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
