# tuneledger: measure, then fine-tune. `make help` lists the verbs.
#
# Settings (all optional):  CONFIG=configs/x.yaml  PRESET=A|B|C|D|all  MODEL=<hub id or dir>
#   DATASET=a.json,b.jsonl  RUN=<run name>  MAX_STEPS=N  STEPS=N (dry-run)  NPROC=N  ARGS="key=value ..."
SHELL := /bin/bash
.DEFAULT_GOAL := help

# The image's Python is 3.10; use the same here so the lock installs identically.
PYTHON ?= $(shell for p in python3.10 $$HOME/.pyenv/versions/3.10.13/bin/python3.10 python3; do \
	$$p -c 'import sys' >/dev/null 2>&1 && { echo $$p; break; }; done)
VENV ?= .venv
TL := $(VENV)/bin/tuneledger

# With a GPU the default job is the reference QLoRA config on the synthetic Qwen2.5-7B; without
# one it is the same job on a tiny random Qwen2 (CPU, gloo), so `make dryrun` runs anywhere.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
CONFIG ?= configs/qwen2.5-7b-qlora.yaml
SYNTH ?= models/synthetic-qwen2.5-7b
SYNTH_ARCH := qwen2.5-7b
else
CONFIG ?= configs/tiny.yaml
SYNTH ?= models/synthetic-tiny
SYNTH_ARCH := tiny
endif
MODEL ?= $(SYNTH)
PRESET ?=
DRYRUN_PRESET ?= $(or $(PRESET),all)

# Make variables -> key=value overrides, in LLaMA-Factory's key names.
OVERRIDES := model_name_or_path=$(MODEL) \
	$(if $(DATASET),dataset=$(DATASET)) $(if $(RUN),run_name=$(RUN)) \
	$(if $(MAX_STEPS),max_steps=$(MAX_STEPS)) $(if $(STEPS),dryrun_steps=$(STEPS)) $(ARGS)

.PHONY: help venv stats dryrun train test clean-cache
help: ## list the verbs
	@grep -hE '^[a-zA-Z0-9_./-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'
	@echo "  settings: CONFIG=$(CONFIG) MODEL=$(MODEL) PRESET=$(PRESET) DATASET= RUN= MAX_STEPS= STEPS= NPROC= ARGS="

$(VENV)/.stamp: requirements.txt pyproject.toml
	@test -n "$(PYTHON)" || { echo "no Python 3.10 found; set PYTHON=/path/to/python3.10"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade --no-deps --require-hashes -r requirements.txt
	$(VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	@touch $@

venv: $(VENV)/.stamp ## create .venv from the lock (Python 3.10, hashes)

models/synthetic-%/config.json: | $(VENV)/.stamp
	$(TL) synth-model --arch $* models/synthetic-$*

# The synthetic model is built only when the job uses it.
MODEL_DEP := $(if $(filter $(SYNTH),$(MODEL)),$(SYNTH)/config.json)

stats: $(VENV)/.stamp $(MODEL_DEP) ## token counts, invalid records, steps per epoch (runs/<run>/stats.json)
	$(TL) stats $(CONFIG) $(OVERRIDES)

dryrun: $(VENV)/.stamp $(MODEL_DEP) ## measure s/step, tokens/s, memory, save time, ETA (PRESET=all ranks A-D)
	$(TL) dryrun $(CONFIG) --preset $(DRYRUN_PRESET) $(if $(NPROC),--nproc $(NPROC)) $(OVERRIDES)

train: $(VENV)/.stamp $(MODEL_DEP) ## the full DDP run; resumes from the last checkpoint (PRESET=A|B|C|D)
	$(TL) train $(CONFIG) $(if $(PRESET),preset=$(PRESET)) $(if $(NPROC),--nproc $(NPROC)) $(OVERRIDES)

test: $(VENV)/.stamp ## unit tests and tiny end-to-end runs on CPU
	$(VENV)/bin/python -m pytest -q

clean-cache: ## drop the tokenized-data cache
	rm -rf .cache/tuneledger
