#!/usr/bin/env bash
# The CI image build: the real Dockerfile and docker-compose.yml, on the CI machine (no GPU, no
# container registry, PyPI and Debian's archive only).
#   1. installs Debian's docker.io engine, docker-compose and debootstrap; starts dockerd with its
#      own data root and socket, and stops it by its pid at the end, whatever happens;
#   2. makes the base image locally: debootstrap Debian bookworm, plus this machine's CA store and
#      its Python 3.10 (Debian 12 has none), passed in through BASE_IMAGE;
#   3. builds the Dockerfile with PyPI's torch 2.5.1 (CUDA 12.4; PyTorch's cu121 index is out of
#      reach here) and without flash-attn (no GitHub here);
#   4. smoke-tests the image through the compose file: --version, the build record, synth-model,
#      preflight, `stats` on the shared alpaca data against the known counts, the SDPA fallback, the
#      monitor sidecar (stays up, records "no GPU" rows), TensorBoard, and that no mirror setting
#      given to the build is left in the image.
# Needs root, and .venv (make venv) for its YAML and JSON checks. Prints a time for every step.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
start=$(date +%s)
step() { printf '\n=== image: %s (%ss)\n' "$*" "$(( $(date +%s) - start ))"; }
fail() { echo "image: FAIL: $*" >&2; exit 1; }
py=$root/.venv/bin/python
[ -x "$py" ] || fail "no .venv: run make venv first"
[ "$(id -u)" = 0 ] || fail "needs root (apt-get, dockerd, debootstrap)"
data=$(cd "$root/../shared/data" 2>/dev/null && pwd) || fail "../shared/data not found"
python310=${PYTHON310_PREFIX:-$HOME/.pyenv/versions/3.10.13}
[ -x "$python310/bin/python3.10" ] || fail "no Python 3.10 at $python310 (set PYTHON310_PREFIX)"

step "install Debian's docker.io, docker-compose, debootstrap"
need=()
for pair in dockerd:docker.io docker-compose:docker-compose debootstrap:debootstrap; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${pair%%:*}" ] || need+=("${pair#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
docker=/usr/bin/docker  # Debian's client: BuildKit built in (another docker on PATH may want buildx)
/usr/sbin/dockerd --version
docker-compose --version

work=$(mktemp -d /var/tmp/tuneledger-ci.XXXXXX)
dockerd_pid=
project=tuneledger-ci
cleanup() {
    rc=$?
    set +e
    if [ -n "$dockerd_pid" ]; then
        [ -f "$work/compose.yml" ] && docker-compose -p "$project" -f "$work/compose.yml" down -t 5 >/dev/null 2>&1
        kill "$dockerd_pid" 2>/dev/null && wait "$dockerd_pid" 2>/dev/null
        echo "image: dockerd (pid $dockerd_pid) stopped"
        ip link delete docker0 2>/dev/null
    fi
    rm -rf "$work"
    exit $rc
}
trap cleanup EXIT

step "start dockerd (its own data root and socket)"
/usr/sbin/dockerd --data-root "$work/docker" --exec-root "$work/exec" -H "unix://$work/docker.sock" \
    --pidfile "$work/docker.pid" >"$work/dockerd.log" 2>&1 &
dockerd_pid=$!
export DOCKER_HOST=unix://$work/docker.sock DOCKER_BUILDKIT=1 COMPOSE_DOCKER_CLI_BUILD=1
for _ in $(seq 60); do $docker info >/dev/null 2>&1 && break; sleep 0.5; done
$docker info >/dev/null 2>&1 || { tail -20 "$work/dockerd.log"; fail "dockerd did not start"; }
echo "dockerd $($docker version --format '{{.Server.Version}}') up, pid $dockerd_pid"

step "base image: debootstrap Debian bookworm + this machine's CA store + Python 3.10"
rootfs=$work/rootfs
debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >"$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log"; fail "debootstrap"; }
# The CI network may re-sign TLS: the build's `apt-get install ca-certificates` folds these in.
mkdir -p "$rootfs/usr/local/share/ca-certificates"
cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/" 2>/dev/null || true
cp -a "$python310" "$rootfs/opt/python3.10"
echo /opt/python3.10/lib > "$rootfs/etc/ld.so.conf.d/python3.10.conf"
chroot "$rootfs" /sbin/ldconfig
tar -C "$rootfs" -c . | $docker import - tuneledger-ci/base:bookworm >/dev/null
rm -rf "$rootfs"
$docker image ls tuneledger-ci/base

step "docker build (BASE_IMAGE=the local base, PyPI's torch, no flash-attn)"
# APT_MIRROR and PIP_TRUSTED_HOST are canaries: working values that must not be left in the image.
apt_canary=http://deb.debian.org:80
pip_canary=ci-canary.invalid
build_start=$(date +%s)
$docker build --progress=plain -t tuneledger:ci \
    --build-arg BASE_IMAGE=tuneledger-ci/base:bookworm \
    --build-arg PYTHON=/opt/python3.10/bin/python3.10 \
    --build-arg "PYTHON_APT_PACKAGES=libssl3 libffi8 libsqlite3-0 libbz2-1.0 liblzma5 zlib1g libreadline8 libncursesw6 libexpat1 libnsl2 libuuid1 libcrypt1" \
    --build-arg APT_MIRROR=$apt_canary \
    --build-arg PIP_INDEX_URL=https://pypi.org/simple \
    --build-arg PIP_TRUSTED_HOST=$pip_canary \
    --build-arg TORCH_INDEX_URL= --build-arg TORCH_CUDA=12.4 \
    --build-arg FLASH_ATTN_WHEEL_URL= --build-arg FLASH_ATTN_VERSION=none \
    . 2>&1 | tee "$work/build.log" | grep -E '^#[0-9]+ (\[|DONE|ERROR)|^#[0-9]+ [0-9.]+ (---|torch\.|torch C|  [a-z_-]+ +[^ ]|No broken|ERROR|error)' \
    || { tail -40 "$work/build.log"; fail "docker build"; }
grep -q 'writing image' "$work/build.log" || { tail -40 "$work/build.log"; fail "docker build"; }
echo "image built in $(( $(date +%s) - build_start ))s: $($docker image ls tuneledger:ci --format '{{.Size}}')"
$docker image inspect tuneledger:ci --format '{{range $k, $v := .Config.Labels}}{{println $k "=" $v}}{{end}}'

step "compose: docker-compose.yml with CI's folders, less the GPU reservation"
export IMAGE=tuneledger:ci HOST_UID=1000 HOST_GID=1000 DATA_DIR=$data \
    MODELS_DIR=$work/models RUNS_DIR=$work/runs CACHE_DIR=$work/cache MONITOR_INTERVAL=2 TENSORBOARD_PORT=16006
mkdir -p "$work/models" "$work/runs" "$work/cache"
chown 1000:1000 "$work/models" "$work/runs" "$work/cache"
docker-compose -f docker-compose.yml config >"$work/compose.full.yml"
# No GPU runtime here: drop the device reservations (and the build section: the image is built).
# This sandbox may not raise RLIMIT_MEMLOCK either (a GPU host's Docker can): drop memlock too.
"$py" - "$work/compose.full.yml" "$work/compose.yml" <<'PY'
import sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
for name, svc in doc["services"].items():
    svc.pop("build", None)
    if svc.get("ulimits", {}).pop("memlock", None) is not None:
        print(f"  {name}: ulimit memlock removed")
    res = svc.get("deploy", {}).get("resources", {})
    if res.pop("reservations", {}).get("devices"):
        print(f"  {name}: GPU reservation removed")
    if not res:
        svc.pop("deploy", None)
yaml.safe_dump(doc, open(sys.argv[2], "w"), sort_keys=False)
PY
dc() { docker-compose -p "$project" -f "$work/compose.yml" "$@"; }
run() { dc run --rm -T trainer "$@"; }

step "smoke: tuneledger --version, the build record, the SDPA fallback"
run tuneledger --version
run cat /opt/venv/tuneledger-image.json; echo
run python -c "
import json
from tuneledger.model import attention_backend
rec = json.load(open('/opt/venv/tuneledger-image.json'))
assert rec['flash-attn'] is None and rec['attention_on_gpu'] == 'sdpa', rec
got = attention_backend('auto', 'cuda')
assert got == 'sdpa', got
print('no flash-attn in this image: attention on a GPU would be', got)
"

step "smoke: synth-model (tiny random Qwen2, real Qwen2.5 tokenizer) and preflight"
run tuneledger synth-model --arch tiny models/synthetic-tiny
run tuneledger preflight configs/tiny.yaml model_name_or_path=models/synthetic-tiny --cpu

step "smoke: stats on ../shared/data (mounted read-only) against the known counts"
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

step "smoke: docker-compose up monitor (no GPU: must stay up and record 'no GPU' rows) and tensorboard"
if run tuneledger monitor --help >/dev/null 2>&1; then
    dc up -d monitor tensorboard
    sleep 9
    for svc in monitor tensorboard; do
        cid=$(dc ps -q "$svc")
        state=$($docker inspect -f '{{.State.Status}} restarts={{.RestartCount}}' "$cid")
        echo "  $svc: $state"
        [ "$state" = "running restarts=0" ] || { dc logs --tail 30 "$svc"; fail "$svc did not stay up"; }
    done
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
    "$py" -c "import urllib.request; r = urllib.request.urlopen('http://127.0.0.1:16006/', timeout=10); print('  tensorboard: HTTP', r.status)" \
        || { dc logs --tail 30 tensorboard; fail "tensorboard does not answer"; }
    dc down -t 5
else
    echo "  SKIPPED: this tree has no \`tuneledger monitor\` verb yet; tensorboard alone:"
    dc up -d tensorboard && sleep 6
    "$py" -c "import urllib.request; r = urllib.request.urlopen('http://127.0.0.1:16006/', timeout=10); print('  tensorboard: HTTP', r.status)" \
        || { dc logs --tail 30 tensorboard; fail "tensorboard does not answer"; }
    dc down -t 5
fi

step "smoke: no mirror, proxy or token from the build is left in the image"
env_leak=$($docker image inspect tuneledger:ci --format '{{range .Config.Env}}{{println .}}{{end}}' \
    | grep -iE '^(PIP_|APT_|TORCH_INDEX|FLASH_ATTN|HF_TOKEN|HF_ENDPOINT|[a-z_]*proxy)' || true)
[ -z "$env_leak" ] || fail "build settings in the image's environment: $env_leak"
file_leak=$($docker run --rm --user 0 --entrypoint sh tuneledger:ci -c \
    "grep -rIl -e '$pip_canary' -e '${apt_canary#http://}' /etc /root /home /workspace /opt/venv/pyvenv.cfg /opt/venv/pip.conf 2>/dev/null" || true)
[ -z "$file_leak" ] || fail "build settings left in image files: $file_leak"
echo "  image environment and /etc, /root, /home, /workspace, the venv's config: clean"

step "done: image built and smoke-tested"
cat <<'EOF'
What this build proves: the Dockerfile builds from a bare base through its build args; the lock
installs with --require-hashes on Python 3.10 into the venv and `pip check` passes; the pins match
the labels; the CLI, synth-model, preflight and stats run in the image as the non-root user through
docker-compose.yml's volumes and environment; the monitor and TensorBoard services stay up.
What it CANNOT prove, and a GPU machine must (.github/workflows/image.yml builds the real thing):
  - the CUDA base image (nvidia/cuda:12.1.1-cudnn8-runtime-ubuntu22.04): a Debian bookworm stand-in
    was used, with this machine's Python 3.10.13 copied in instead of Ubuntu 22.04's python3.10;
  - torch 2.5.1+cu121 from PyTorch's cu121 index and its hash (unreachable here: PyPI's CUDA 12.4
    build was installed instead), and the flash-attn wheel and its import smoke test (no GitHub);
  - the GPU runtime: the NVIDIA container toolkit, compose's deploy.resources GPU reservations
    (removed here), NCCL, bitsandbytes' CUDA library, and the monitor's real GPU rows.
EOF
