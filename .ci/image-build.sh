#!/usr/bin/env bash
# The CI image build: the real Dockerfile and docker-compose.yml, on the CI machine (no GPU, no
# container registry, PyPI and Debian's archive only).
#   1. installs Debian's docker.io engine, docker-compose and debootstrap; starts dockerd with its
#      own data root and socket, and stops it by its pid at the end, whatever happens;
#   2. makes the base image locally: debootstrap Debian bookworm, plus this machine's CA store and
#      its Python 3.10 (Debian 12 has none), passed in through BASE_IMAGE;
#   3. builds the Dockerfile as a user does, `make image` (docker compose build through docker/build:
#      BuildKit where the docker client has it, the legacy builder where it has no buildx), with
#      PyPI's torch 2.5.1 (CUDA 12.4; PyTorch's cu121 index is out of reach here), without
#      flash-attn (no GitHub here), and an https APT_MIRROR on a base without a CA store; then again
#      from the layer cache with HOST_UID/HOST_GID 0:0 and 1000:100 (IDs the base already has);
#   4. smoke-tests it through the compose file (.ci/image-smoke.sh): the CPU/GPU compose choice,
#      --version, labels against the build record, the SDPA fallback, synth-model, preflight,
#      `stats` on the shared alpaca data against the known counts, the SIGTERM grace period,
#      TensorBoard, and from a fresh clone the monitor (healthy, writing rows), `make stats` and
#      `make dryrun`; and checks that no mirror setting given to the build is left in the image.
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

cat <<'EOF'
=== image: what this CI build CANNOT prove (no GPU, no container registry, PyPI and Debian only):
  - the CUDA base image nvidia/cuda:12.1.1-cudnn8-runtime-ubuntu22.04: a debootstrap Debian
    bookworm stand-in is used, with this machine's Python 3.10.13 copied in, not Ubuntu's python3.10;
  - torch 2.5.1+cu121 from PyTorch's cu121 index and its hash: unreachable here, so PyPI's
    torch 2.5.1 (CUDA 12.4) is installed; nor the flash-attn wheel and its import test (no GitHub);
  - the GPU runtime: the NVIDIA container toolkit, the GPU compose overlays (docker-compose.gpu.yml, .cdi.yml: only validated here), NCCL,
    bitsandbytes' CUDA library, the monitor's real GPU rows.
  .github/workflows/image.yml builds the real image (CUDA base, cu121 torch, flash-attn) on GitHub;
  only a GPU machine proves the runtime.
EOF

step "install Debian's docker.io, docker-compose, debootstrap"
need=()
[ -x /usr/sbin/dockerd ] && [ -x /usr/bin/docker ] || need+=(docker.io)
[ -x /usr/bin/docker-compose ] || need+=(docker-compose)
[ -x /usr/sbin/debootstrap ] || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
docker=/usr/bin/docker  # Debian's client, for inspect and run; `make image` uses the docker on PATH
/usr/sbin/dockerd --version
echo "docker on PATH: $(command -v docker) $(docker version --format '{{.Client.Version}}' 2>/dev/null); buildx: $(docker buildx version 2>/dev/null || echo none)"
/usr/bin/docker-compose --version

work=$(mktemp -d /var/tmp/tuneledger-ci.XXXXXX)
dockerd_pid=
had_bridge=$(ip link show docker0 >/dev/null 2>&1 && echo 1 || true)
cleanup() {
    rc=$?
    set +e
    if [ -n "$dockerd_pid" ]; then
        kill "$dockerd_pid" 2>/dev/null && wait "$dockerd_pid" 2>/dev/null
        echo "image: dockerd (pid $dockerd_pid) stopped"
        [ -n "$had_bridge" ] || ip link delete docker0 2>/dev/null  # the bridge it made, not another engine's
    fi
    bash "$root/.ci/rm-tree.sh" "$work"  # unmounts dockerd's exec/netns/default first
    exit $rc
}
trap cleanup EXIT

step "start dockerd (its own data root and socket)"
/usr/sbin/dockerd --data-root "$work/docker" --exec-root "$work/exec" -H "unix://$work/docker.sock" \
    --pidfile "$work/docker.pid" >"$work/dockerd.log" 2>&1 &
dockerd_pid=$!
export DOCKER_HOST=unix://$work/docker.sock DOCKER_BUILDKIT=1
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

step "make image (BASE_IMAGE=the local base, PyPI's torch, no flash-attn, an https APT_MIRROR)"
# APT_MIRROR and PIP_TRUSTED_HOST are canaries: working values that must not be left in the image.
# The https mirror also proves the CA step: the debootstrap base has no CA store.
apt_canary=https://deb.debian.org:443
pip_canary=ci-canary.invalid
build_env=(IMAGE=tuneledger:ci COMPOSE=docker-compose BASE_IMAGE=tuneledger-ci/base:bookworm
    IMAGE_PYTHON=/opt/python3.10/bin/python3.10
    "IMAGE_PYTHON_APT_PACKAGES=libssl3 libffi8 libsqlite3-0 libbz2-1.0 liblzma5 zlib1g libreadline8 libncursesw6 libexpat1 libnsl2 libuuid1 libcrypt1"
    APT_MIRROR=$apt_canary PIP_INDEX_URL=https://pypi.org/simple PIP_TRUSTED_HOST=$pip_canary
    TORCH_INDEX_URL= TORCH_CUDA=12.4 FLASH_ATTN_WHEEL_URL= FLASH_ATTN_VERSION=none)
build_start=$(date +%s)
env "${build_env[@]}" HOST_UID=1000 HOST_GID=1000 make image >"$work/build.log" 2>&1 \
    || { tail -40 "$work/build.log"; fail "make image"; }
grep -E '^tuneledger:|has no buildx|docker-buildx|apt-install:|^(#[0-9]+ [0-9.]+ )?(torch\.|---|  [a-z_-]+ +[^ ])|Successfully built|writing image' "$work/build.log" | head -40 || true
$docker image inspect tuneledger:ci >/dev/null 2>&1 || { tail -40 "$work/build.log"; fail "make image made no tuneledger:ci"; }
echo "image built in $(( $(date +%s) - build_start ))s: $($docker image ls tuneledger:ci --format '{{.Size}}')"
$docker image inspect tuneledger:ci --format '{{range $k, $v := .Config.Labels}}{{println $k "=" $v}}{{end}}'

step "HOST_UID/HOST_GID 0:0 (root-only boxes) and 1000:100 (a GID the base has) build, from the layer cache"
for ids in 0:0 1000:100; do
    t0=$(date +%s)
    env "${build_env[@]}" IMAGE=tuneledger:ci-ids HOST_UID=${ids%:*} HOST_GID=${ids#*:} make image >"$work/build-ids.log" 2>&1 \
        || { tail -30 "$work/build-ids.log"; fail "make image with HOST_UID:HOST_GID $ids"; }
    got=$($docker run --rm tuneledger:ci-ids sh -c 'echo "$(id -u):$(id -g) $(stat -c %u:%g /workspace/runs) $(tuneledger --version)"')
    echo "  $ids: built in $(( $(date +%s) - t0 ))s; runs as, /workspace/runs owner, version: $got"
    [ "${got%% *}" = "$ids" ] || fail "HOST_UID:HOST_GID $ids: the image runs as ${got%% *}"
    grep -E 'add-user:' "$work/build-ids.log" | sed 's/^/    /' | head -3 || true
    $docker rmi tuneledger:ci-ids >/dev/null
done

step "smoke tests through docker-compose.yml (.ci/image-smoke.sh)"
IMAGE=tuneledger:ci DATA_DIR=$data COMPOSE=docker-compose DOCKER=$docker PYTHON=$py EXPECT_REVISION=$(git rev-parse HEAD) \
    bash .ci/image-smoke.sh

step "no mirror, proxy or token from the build is left in the image"
env_leak=$($docker image inspect tuneledger:ci --format '{{range .Config.Env}}{{println .}}{{end}}' \
    | grep -iE '^(PIP_|APT_|TORCH_INDEX|FLASH_ATTN|HF_TOKEN|HF_ENDPOINT|[a-z_]*proxy)' || true)
[ -z "$env_leak" ] || fail "build settings in the image's environment: $env_leak"
file_leak=$($docker run --rm --user 0 --entrypoint sh tuneledger:ci -c \
    "grep -rIl -e '$pip_canary' -e '${apt_canary#http://}' /etc /root /home /workspace /opt/venv/pyvenv.cfg /opt/venv/pip.conf 2>/dev/null" || true)
[ -z "$file_leak" ] || fail "build settings left in image files: $file_leak"
echo "  image environment and /etc, /root, /home, /workspace, the venv's config: clean"

step "done: image built and smoke-tested"
echo "Proven here: make image builds the Dockerfile from a bare base through compose's build args (any"
echo "HOST_UID/HOST_GID, an https apt mirror); the lock installs with --require-hashes on Python 3.10"
echo "and pip check passes; labels match what is installed; on Docker without NVIDIA, make picks the CPU"
echo "compose file, and from a fresh clone the monitor is healthy and writes rows while make stats and"
echo "make dryrun run in the container. Not proven here: see the notice at the top of this step."
