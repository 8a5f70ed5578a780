# Sourced by bench/h200_*.sh on a lent H200 machine, from the repository root: the environment
# (NVLink multicast off, as the lender asks; no hub), the carried wheels installed once per machine
# into /tmp/site, `$TL` and the synthetic Qwen2.5-7B at `$MODEL` (written once per machine by
# `synth_model LOG`).
# What it carries is built here by bench/make_carry.sh (.whl, .usite, .carry).
# DEVICE_ENV=0: a CPU smoke of a script's plumbing here (MODEL=/tmp/tiny CONFIG=configs/tiny.yaml
# FLAGS=--cpu): the tree's own src, `$TL` on `$PY`, no wheels, no synthetic model.
if [ "${DEVICE_ENV:-1}" != 1 ]; then
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  TL=${TL:-${PY:-python3} -m tuneledger}
  synth_model() { :; }
  return 0
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$PWD/src
# A machine kept warm between calls already has them; a new set of wheels is installed again.
if [ "$(ls .whl)" != "$(cat /tmp/site/.wheels 2>/dev/null)" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && ls .whl > /tmp/site/.wheels || exit 1
fi
TL="python3 -m tuneledger"
MODEL=/tmp/models/synthetic-qwen2.5-7b
synth_model() {   # $1: the log to append to
  [ -f $MODEL/config.json ] && return 0
  echo "synth-model" | tee -a "$1"
  $TL synth-model --arch qwen2.5-7b $MODEL 2>&1 | tail -2 | tee -a "$1"
}
# bitsandbytes for CUDA 13 from the Unsloth folder (../shared/tools/make_unsloth_site.sh), when carried:
# the full bitsandbytes wheel alone is 43 MB of the 64 MiB a call may carry. It travels as
# .carry/usite.tgz (10 MB instead of 33: the tracked tree's logs grew past what both leave room for).
[ -d .usite ] || { [ -f .carry/usite.tgz ] && tar xzf .carry/usite.tgz; }
[ -d .usite ] && export PYTHONPATH=$PYTHONPATH:$PWD/.usite
