#!/usr/bin/env bash
# Install tuneledger's Python dependencies into the image's venv; run by the Dockerfile.
# Every file pip fetches is checked against a sha256 in a lock: --require-hashes throughout.
#
# How torch is pinned (README "How torch is pinned"):
#   requirements.txt      the lock: PyPI's torch 2.5.1 (a CUDA 12.4 build) and its nvidia-*-cu12 12.4
#                         wheels, as the host venv and CI install it.
#   torch-cu121-wheel.txt torch 2.5.1+cu121, from TORCH_INDEX_URL only.
#   torch-cu121.txt       that build's CUDA 12.1 nvidia-*-cu12 wheels (from PyPI or its mirror).
# With TORCH_INDEX_URL set, the lock goes in without its torch and nvidia-*-cu12 blocks and the two
# cu121 files take their place; everything else (triton included) is the lock's, so the two torch
# sources never meet in one pip call. With TORCH_INDEX_URL empty the lock goes in whole. `pip check`
# proves the result consistent either way.
#
# Settings (build args, in the environment here):
#   TORCH_INDEX_URL        torch 2.5.1+cu121's index; empty: PyPI's 2.5.1 (CUDA 12.4) from the lock
#   TORCH_CUDA             the CUDA version that torch must report (12.1; 12.4 for PyPI's build)
#   FLASH_ATTN_WHEEL_URL   prebuilt flash-attn wheel; empty: no flash-attn (the trainer uses SDPA)
#   FLASH_ATTN_SHA256      its sha256
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_TRUSTED_HOST   pip's own settings; empty: pip's default
#   TORCH_VERSION, TRANSFORMERS_VERSION, ..., FLASH_ATTN_VERSION, PYTHON_VERSION: the image's
#                          labels; the build fails if what was installed differs from them.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
lock=$here/..            # requirements.txt sits one level up, as in the repository
for v in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_TRUSTED_HOST TORCH_INDEX_URL FLASH_ATTN_WHEEL_URL; do
    [ -n "${!v:-}" ] || unset "$v"
done
pip() { python -m pip --disable-pip-version-check --no-input "$@"; }
hashed=(install --no-deps --require-hashes --only-binary=:all: --progress-bar=off)
step() { printf '\n--- %s\n' "$*"; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

step "pip from the lock"
python "$here/lockfilter.py" --keep pip "$lock/requirements.txt" > "$tmp/pip.txt"
pip "${hashed[@]}" -r "$tmp/pip.txt"

if [ -n "${TORCH_INDEX_URL:-}" ]; then
    step "torch 2.5.1+cu121 from TORCH_INDEX_URL, its CUDA 12.1 wheels, and the lock without PyPI's torch"
    # As an index (PyTorch's .../whl/cu121 layout) or a flat folder of wheels (e.g. Aliyun's
    # pytorch-wheels/cu121/): whichever the URL is, pip finds the file; the hash decides.
    pip "${hashed[@]}" --index-url "$TORCH_INDEX_URL" --find-links "$TORCH_INDEX_URL" -r "$here/torch-cu121-wheel.txt"
    python "$here/lockfilter.py" --drop 'torch|nvidia-.*-cu12' "$lock/requirements.txt" > "$tmp/rest.txt"
    pip "${hashed[@]}" -r "$tmp/rest.txt" -r "$here/torch-cu121.txt"
else
    step "the lock whole: PyPI's torch 2.5.1 (CUDA 12.4), the fallback"
    pip "${hashed[@]}" -r "$lock/requirements.txt"
fi

step "image-only packages (docker/image-extras.txt)"
pip "${hashed[@]}" -r "$here/image-extras.txt"

step "torch as installed"
python - <<'PY'
import os, sys
import torch
print(f"torch.__version__ = {torch.__version__}")
print(f"torch.version.cuda = {torch.version.cuda}")
print(f"torch C++ ABI (_GLIBCXX_USE_CXX11_ABI) = {torch._C._GLIBCXX_USE_CXX11_ABI}")
want = os.environ.get("TORCH_CUDA", "")
if want and torch.version.cuda != want:
    hint = ("PyPI's torch 2.5.1 is a CUDA 12.4 build: with TORCH_INDEX_URL empty set TORCH_CUDA=12.4"
            if not os.environ.get("TORCH_INDEX_URL") else "check that TORCH_INDEX_URL serves the cu121 build")
    sys.exit(f"torch reports CUDA {torch.version.cuda}, the build asked for TORCH_CUDA={want}: {hint}")
PY

if [ -n "${FLASH_ATTN_WHEEL_URL:-}" ]; then
    step "flash-attn: the prebuilt wheel must match torch, CUDA, the C++ ABI and Python"
    python - "$FLASH_ATTN_WHEEL_URL" <<'PY'
import re, sys, urllib.parse
import torch
name = urllib.parse.unquote(sys.argv[1].rsplit("/", 1)[-1])
m = re.fullmatch(r"flash_attn-(?P<ver>[^+]+)\+cu(?P<cu>\d+)torch(?P<torch>\d+\.\d+)cxx11abi(?P<abi>TRUE|FALSE)"
                 r"-(?P<py>cp\d+)-cp\d+-linux_x86_64\.whl", name)
if not m:
    sys.exit(f"FLASH_ATTN_WHEEL_URL: cannot read the build tags of {name!r} (want flash_attn-V+cuXXtorchX.YcxxabiTRUE|FALSE-cpXY-...)")
have = {"torch": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
        "cu": torch.version.cuda.split(".")[0] if torch.version.cuda else "none",
        "abi": str(torch._C._GLIBCXX_USE_CXX11_ABI).upper(),
        "py": f"cp{sys.version_info[0]}{sys.version_info[1]}"}
bad = [f"{k}: wheel {m[k]}, image {have[k]}" for k in have if m[k] != have[k]]
if bad:
    sys.exit(f"{name} does not match this image ({'; '.join(bad)}). Pick the wheel for torch{have['torch']}, "
             f"cu{have['cu']}, cxx11abi{have['abi']}, {have['py']}.")
print(f"{name}: torch{m['torch']} cu{m['cu']} cxx11abi{m['abi']} {m['py']} match")
PY
    printf 'flash-attn @ %s --hash=sha256:%s\n' "$FLASH_ATTN_WHEEL_URL" "${FLASH_ATTN_SHA256:?FLASH_ATTN_SHA256 is required with FLASH_ATTN_WHEEL_URL}" \
        > "$tmp/flash-attn.txt"
    pip "${hashed[@]}" -r "$tmp/flash-attn.txt"
    step "flash-attn import smoke test"
    python - <<'PY'
import sys
try:
    import flash_attn
    import flash_attn_2_cuda  # noqa: F401  the compiled kernels: an ABI mismatch fails here
    from flash_attn import flash_attn_func  # noqa: F401
except ImportError as e:
    msg = str(e)
    if "libcuda.so" in msg:  # the driver is mounted at run time only; nothing to check here
        print(f"flash-attn: kernels need the GPU driver, absent during the build ({msg}); ABI checked by tags only")
        sys.exit(0)
    kind = "C++ ABI or torch version mismatch (undefined symbol)" if "undefined symbol" in msg else "import failure"
    sys.exit(f"flash-attn does not import: {kind}: {msg}")
print(f"flash-attn {flash_attn.__version__} imports; attention backend on GPUs: flash_attention_2")
PY
else
    step "flash-attn: skipped (FLASH_ATTN_WHEEL_URL is empty); the trainer falls back to SDPA and records it"
fi

step "pip check: one consistent set"
pip check

step "installed versions against the image's labels"
# The locks' hash from the very files installed, for the smoke test to hold against the label that
# `make image` computed on the checkout (docker/lock-hash: same files, same relative paths).
LOCKS_SHA256=$(sh "$here/lock-hash" trainer "$lock") python - <<'PY'
import json, os, sys
from importlib.metadata import PackageNotFoundError, version
import torch
labels = {"torch": "TORCH_VERSION", "transformers": "TRANSFORMERS_VERSION", "peft": "PEFT_VERSION",
          "accelerate": "ACCELERATE_VERSION", "bitsandbytes": "BITSANDBYTES_VERSION",
          "datasets": "DATASETS_VERSION", "flash-attn": "FLASH_ATTN_VERSION"}
record = {"python": sys.version.split()[0], "torch_cuda": torch.version.cuda,
          "torch_cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI), "locks_sha256": os.environ["LOCKS_SHA256"]}
bad = []
want_py = os.environ.get("PYTHON_VERSION")
if want_py and not record["python"].startswith(want_py + "."):
    bad.append(f"python {record['python']} (label {want_py})")
for dist, var in labels.items():
    want = os.environ.get(var)
    try:
        have = version(dist)
    except PackageNotFoundError:
        have = None
    record[dist] = have
    if dist == "flash-attn" and not os.environ.get("FLASH_ATTN_WHEEL_URL"):
        if want not in (None, "", "none"):  # no wheel asked for: the label must say so
            bad.append(f"flash-attn not installed (FLASH_ATTN_WHEEL_URL is empty; set FLASH_ATTN_VERSION=none)")
        continue
    if want and (have or "").split("+")[0] != want:
        bad.append(f"{dist} {have} (label {want})")
record["attention_on_gpu"] = "flash_attention_2" if record["flash-attn"] else "sdpa"
for k, v in record.items():
    print(f"  {k:16} {v}")
if bad:
    sys.exit("installed versions differ from the image's labels: " + ", ".join(bad)
             + ". Update the ARGs in the Dockerfile with the lock.")
with open(os.path.join(sys.prefix, "tuneledger-image.json"), "w") as f:
    json.dump(record, f, indent=1)
PY
