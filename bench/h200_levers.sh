#!/usr/bin/env bash
# `make bench`, and one device call (one H200) of it: issue 19's levers, each measured by the
# project's own dry-run on the SYNTHETIC Qwen2.5-7B and the 400 field-length conversations, in one call:
#   the GPU run of tests/test_speed.py (packing isolation per attention backend, fused LoRA);
#   preset D plain (sdpa, no Liger, peft's LoRA) -> D with the defaults (auto) -> D + regional compile
#   -> D with lora_dropout 0.05 -> C with the defaults -> C + compile; a sync-debug step on D;
#   then one profiled step of PROFILE_RUN (default D; empty: none), its kernel-time table by category.
# GC_CHECK=1 adds bench/gc_compile_check.py (checkpointing around or inside compiled layers, dense and NF4; nf4: NF4 only).
# Needs (carried, never committed): .whl (bench/device_env.sh), .usite (bitsandbytes from
# ../shared/tools/make_unsloth_site.sh), .carry/alpaca_fieldlen.json (bench/make_fieldlen_data.py).
#   bash bench/h200_levers.sh            # on the device, from the repository root
set -uo pipefail
OUT=${OUT:-/tmp/out}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-3}
DEADLINE=${DEADLINE:-555}
RUNS=${RUNS:-"Dplain Dauto Cauto Dcompile Ddrop Ccompile"}
CONFIG=${CONFIG:-configs/qwen2.5-7b-qlora.yaml}
# The field-length conversations where they were carried (bench/make_fieldlen_data.py), else the config's own data.
DATASET=${DATASET:-$([ -f .carry/alpaca_fieldlen.json ] && echo .carry/alpaca_fieldlen.json)}
CAP=${CAP:-150}                   # s for one dry-run (compile runs get 80 more): the device call's 10 minutes
FLAGS=${FLAGS:-}
mkdir -p "$OUT" /tmp/logs
source bench/device_env.sh   # environment, carried wheels (or DEVICE_ENV=0: a CPU smoke), $TL, $MODEL, synth_model
t0=$(date +%s)
LOG=/tmp/logs/machine.log
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$LOG"; }
left() { echo $(( DEADLINE - ($(date +%s) - t0) )); }
{ nvidia-smi; echo "host: $(nproc) CPUs, $(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2), load $(cut -d" " -f1-3 /proc/loadavg)"; ${PY:-python3} -c "import torch, transformers, peft, bitsandbytes, datasets, liger_kernel; from importlib.metadata import version; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'peft', peft.__version__, 'bnb', bitsandbytes.__version__, 'datasets', datasets.__version__, 'liger-kernel', version('liger-kernel'))"; } >> "$LOG" 2>&1
synth_model "$LOG"
if [ "${GPU_TESTS:-1}" = 1 ]; then
  stamp "the GPU tests: ${GPU_TEST_FILES:-tests/test_speed.py tests/test_grouped.py tests/test_nf4.py tests/test_nf4_kernel.py tests/test_padding_mask.py tests/test_swiglu.py tests/test_liger_backward.py tests/test_offload.py tests/test_memory_step.py}"
  # SIGINT, not TERM: pytest then stops and still prints the failures and short summary it has so far
  timeout -s INT -k 15 150 ${PY:-python3} -m pytest -q -rfE --tb=short -p no:cacheprovider ${GPU_TEST_FILES:-tests/test_speed.py tests/test_grouped.py tests/test_nf4.py tests/test_nf4_kernel.py tests/test_padding_mask.py tests/test_swiglu.py tests/test_liger_backward.py tests/test_offload.py tests/test_memory_step.py} > /tmp/logs/test_speed_gpu.log 2>&1
  stamp "pytest exit $?: $(tail -1 /tmp/logs/test_speed_gpu.log)"
fi
if [ "${COMPILE_CHECK:-0}" = 1 ]; then   # eager against compiled gradients, per layer (bench/compile_check.py)
  stamp "compile check"
  timeout 150 ${PY:-python3} bench/compile_check.py --out "$OUT/compile_check.json" > /tmp/logs/compile_check.log 2>&1
  stamp "compile check exit $?: $(grep '^compile_check' /tmp/logs/compile_check.log | cut -c1-150 | tr '\n' '|')"
  cp /tmp/logs/compile_check.log "$OUT/"
fi
if [ "${GC_CHECK:-0}" != 0 ]; then   # checkpointing around or inside compiled layers (bench/gc_compile_check.py): 1 dense and NF4, nf4: NF4 only
  qs=('' --nf4); [ "$GC_CHECK" = nf4 ] && qs=(--nf4)
  for q in "${qs[@]}"; do
    stamp "gc compile check ${q:-dense}"
    timeout 150 ${PY:-python3} bench/gc_compile_check.py --device cuda $q --out "/tmp/logs/gc_compile_check${q:+-nf4}.json" \
      > "/tmp/logs/gc_compile_check${q:+-nf4}.log" 2>&1
    stamp "gc compile check exit $?: $(grep '^gc_compile_check' "/tmp/logs/gc_compile_check${q:+-nf4}.log" | cut -c1-230 | tr '\n' '|')"
  done
fi
JOB="$CONFIG model_name_or_path=$MODEL ${DATASET:+dataset=$DATASET} cache_dir=/tmp/cache dryrun_steps=$STEPS dryrun_warmup_steps=$WARMUP"
PLAIN="flash_attn=sdpa enable_liger_kernel=false fused_lora=false torch_compile=false lora_dropout=0 absmax_once=false drop_padding_mask=false swiglu_recompute=false nf4_kernel=false"
# The launch levers (grouped_lora, absmax_once, drop_padding_mask) are on by default where they apply
# since 2026-12-06: a row of one of them alone sets the other two false; *nolaunch has all three off.
NOLAUNCH="grouped_lora=false absmax_once=false drop_padding_mask=false"
AUTO="lora_dropout=0"
table=()
declare -A seen
DATA=""
peer() {  # $1: unsloth | hf; the peers train on the tokenized cache this call's first dry-run made (the same records)
  [ -n "$DATA" ] && [ -d "$DATA" ] || { stamp "$1: no tokenized cache from a dry-run of this call yet (list a dry-run first)"; return; }
  local l; l=$(left); [ "$l" -lt 90 ] && { stamp "$1 skipped: $l s left"; return; }
  if [ "$1" = unsloth ]; then
    [ $l -gt 225 ] && l=225
    stamp "unsloth peer: presets $UNSLOTH_PRESETS (at most $(( l - 25 )) s)"
    if ! PYTHONPATH=$PWD/.usite:/tmp/site:${PYTHONPATH:-} python3 -c "import unsloth" > /tmp/logs/unsloth.log 2>&1; then
      stamp "unsloth does not import here: no Unsloth rows ($(tail -1 /tmp/logs/unsloth.log))"; return
    fi
    PYTHONPATH=$PWD/.usite:/tmp/site:${PYTHONPATH:-} timeout -k 10 $(( l - 25 )) python3 bench/peer_unsloth.py --model $MODEL --data "$DATA" \
      --preset $UNSLOTH_PRESETS ${UNSLOTH_PROFILE:+--profile} ${TUNELEDGER_MEMORY_STEP:+--memory} --steps $(( STEPS + 4 )) --warmup $(( WARMUP + 1 )) --out "$OUT/unsloth.json" > /tmp/logs/unsloth.log 2>&1
    stamp "unsloth exit $?: $(grep '^unsloth ' /tmp/logs/unsloth.log | tr '\n' ' ')"
  else
    stamp "plain HF + peft + bitsandbytes: preset D, lora_dropout 0 (at most $(( l - 25 )) s)"
    timeout -k 10 $(( l - 25 )) ${PY:-python3} -m torch.distributed.run --nproc-per-node 1 --master-port $((29600 + RANDOM % 1000)) \
      bench/baseline_hf.py --model $MODEL --data "$DATA" --preset D --lora-dropout 0 --steps $STEPS --warmup $WARMUP \
      --out "$OUT/hf.json" > /tmp/logs/hf.log 2>&1
    stamp "hf exit $?: $(grep '^baseline ' /tmp/logs/hf.log)"
  fi
}
UNSLOTH_PRESETS=${UNSLOTH_PRESETS:-D C}   # UNSLOTH_PROFILE=1: one more step of each profiled (profile-unsloth-<preset>.md)
# TUNELEDGER_MEMORY_STEP=N (a warm-up step: N <= WARMUP): each dry-run's peak memory of step N split by what
# holds it (memory-<run>.md), and Unsloth's of one more step (memory-unsloth-<preset>.md)
variant() {  # $1: a run <preset><variant> (Dauto, Cgroup, ...): sets o (key=value overrides) and e (environment)
  local r=$1
  case ${r:1} in
    plain) o="$PLAIN";; auto) o="$AUTO";; drop) o="lora_dropout=0.05";;
    sdpa) o="$AUTO flash_attn=sdpa";; noliger) o="$AUTO enable_liger_kernel=false";; nofuse) o="$AUTO fused_lora=false";;
    compile) o="$AUTO torch_compile=true";; nocompile) o="$AUTO torch_compile=false";;
    group) o="$AUTO grouped_lora=true absmax_once=false drop_padding_mask=false";;   # alone: q/k/v and gate/up as one projection each (grouped.py)
    cpp) o="$AUTO compile_cpp_wrapper=true";;   # inductor's C++ wrapper for the compiled layers: less Python per launch
    absmax) o="$AUTO absmax_once=true grouped_lora=false drop_padding_mask=false";;   # alone: absmax dequantized once at load (nf4.py)
    dq0) o="$AUTO double_quantization=false";;   # no double quantization: plain fp32 absmax (other quantized weights)
    nomask) o="$AUTO drop_padding_mask=true grouped_lora=false absmax_once=false";;   # alone: padded rows without their attention mask
    nolaunch) o="$AUTO $NOLAUNCH";;   # the three launch levers off (the defaults before 2026-12-06)
    notriton) o="$AUTO nf4_kernel=false";;   # A/B: bitsandbytes' NF4 dequant kernel instead of ours (nf4_kernel.py)
    once) o="$AUTO absmax_once=true";;   # A/B against the default since 2026-12-07: left off where the NF4 kernel rebuilds the scales
    nogroup) o="$AUTO grouped_lora=false";; noabsmax) o="$AUTO absmax_once=false";; keepmask) o="$AUTO drop_padding_mask=false";;
    fast) o="$AUTO grouped_lora=true absmax_once=true drop_padding_mask=true";;   # the opt-in levers together
    fastcpp) o="$AUTO grouped_lora=true absmax_once=true drop_padding_mask=true compile_cpp_wrapper=true";;
    lean) o="$AUTO swiglu_recompute=true";;   # the MLP's down_proj input remade in backward, not kept (swiglu.py): memory
    keep) o="$AUTO swiglu_recompute=false";;   # A/B against the default since 2026-12-06: the MLP's input kept
    cudnn) o="$AUTO";;   # A/B: cuDNN's SDPA left on (TUNELEDGER_CUDNN_SDPA=1; off by default: host cost per shape)
    fastgraph) o="$AUTO grouped_lora=true absmax_once=true drop_padding_mask=true";;   # Cfast, NF4 dequantized in the compiled graph
    fastlean) o="$AUTO grouped_lora=true absmax_once=true drop_padding_mask=true swiglu_recompute=true";;
    unsl) o="$AUTO use_unsloth=true packing=false";;   # tuneledger's dry-run with Unsloth as the model backend (use_unsloth)
    gcout) o="$AUTO";; # A/B: transformers' checkpoint around the compiled layers, as before compiled.checkpoint_inside
    prefer) o="$AUTO";;  # A/B: the checkpoint inside, the partitioner free to save (TUNELEDGER_CHECKPOINT_POLICY=prefer)
    graphdq) o="$AUTO";; # A/B: NF4 dequantized in torch ops inside the compiled layers (TUNELEDGER_DEQUANT=graph)
    pack) o="$AUTO packing=true";;  # padding-free: the micro-batch's samples in one row, varlen attention, no pad tokens
    copy) o="$AUTO";;  # A/B: the LoRA term added out of place, as before 2026-12-06 (TUNELEDGER_ADDMM=copy, fused_lora.add_product)
    cgraph) o="$AUTO";;  # A/B: compiled layers as CUDA graphs, padded rows bucketed to 64 tokens (TUNELEDGER_CUDAGRAPHS=1; padded presets)
    walk) o="$AUTO";;  # A/B: Trainer's model.train() walking every module at every micro-batch (TUNELEDGER_TRAIN_WALK=every)
    ligerbwd) o="$AUTO";;  # A/B: Liger's own fused cross-entropy backward, its torch.equal check and 2 host syncs a micro-batch (TUNELEDGER_LIGER_BACKWARD=liger)
    dicttags) o="$AUTO";;  # A/B: Dynamo's guards by recursive dict tags (TUNELEDGER_GUARDS=dict-tags)
    noguard) o="$AUTO";;  # A/B: no guards on module attributes, unsafe (TUNELEDGER_GUARDS=skip-modules)
    ugc) o="$AUTO use_unsloth_gc=true";;  # checkpointed layer inputs in pinned CPU memory until backward (offload.py; A and B)
    ugcnoabsmax) o="$AUTO use_unsloth_gc=true absmax_once=false";;  # the same, without absmax_once's +290 MiB
    ugcstream) o="$AUTO use_unsloth_gc=true";;  # A/B: its copies on side streams, each copied back ahead of its layer's backward (TUNELEDGER_OFFLOAD=stream)
    *) stamp "unknown run $r (<A-D><plain|auto|drop|sdpa|noliger|nofuse|compile|nocompile|group|cpp|absmax|dq0|nomask|fast|fastcpp|lean|keep|fastlean|fastgraph|cudnn|nolaunch|notriton|once|nogroup|noabsmax|keepmask|unsl|gcout|prefer|graphdq|pack|copy|ligerbwd|cgraph|walk|dicttags|noguard|ugc|ugcnoabsmax|ugcstream>, unsloth, hf)"; return 1;;
  esac
  # Dauto and Cauto warn at every host-device sync of their last warm-up step, with the stack (probes.SyncDebug):
  # a warm-up step, so the warnings never slow a measured one.
  e=""; case $r in Dauto|Cauto) e="TUNELEDGER_SYNC_DEBUG=$WARMUP";; esac
  [ "${r:1}" = gcout ] && e="TUNELEDGER_CHECKPOINT_OUTSIDE=1"; [ "${r:1}" = prefer ] && e="TUNELEDGER_CHECKPOINT_POLICY=prefer"
  case ${r:1} in graphdq|fastgraph) e="TUNELEDGER_DEQUANT=graph";; cudnn) e="TUNELEDGER_CUDNN_SDPA=1";; copy) e="TUNELEDGER_ADDMM=copy";; ligerbwd) e="TUNELEDGER_LIGER_BACKWARD=liger";; cgraph) e="TUNELEDGER_CUDAGRAPHS=1";; walk) e="TUNELEDGER_TRAIN_WALK=every";;
    dicttags) e="TUNELEDGER_GUARDS=dict-tags";; noguard) e="TUNELEDGER_GUARDS=skip-modules";; ugcstream) e="TUNELEDGER_OFFLOAD=stream";; esac
  return 0
}
for r in $RUNS; do
  case $r in unsloth|hf) peer $r; continue;; esac
  p=${r:0:1}   # a run is <preset><variant>: Dauto, Cplain, Dnoliger, ...
  variant $r || continue
  l=$(left); if [ "$l" -lt 60 ]; then stamp "$r skipped: $l s left"; continue; fi
  cap=$CAP; case $r in *plain|*nocompile|*nofuse) ;; *cpp) cap=$(( CAP + 160 ));; *) cap=$(( CAP + 80 ));; esac  # compiling: the first steps (C++: 104 s cold)
  [ $(( l - 25 )) -lt $cap ] && cap=$(( l - 25 ))
  # A run listed again (RUNS="Cauto Ccpp Cauto": A/B/A against the host's drift) is its own row: Cauto-2.
  n=$r; i=2; while [ -n "${seen[$n]:-}" ]; do n=$r-$i; i=$(( i + 1 )); done; seen[$n]=1
  rm -rf "/tmp/run-$n"   # a ledger left by an earlier call must never stand for this one
  stamp "$n: dryrun --preset $p $o (at most $cap s)"
  env $e timeout -k 10 -s INT $cap \
    $TL dryrun $JOB run_name=$n output_dir=/tmp/run-$n $o --preset $p --nproc 1 --no-fit-check $FLAGS > /tmp/logs/dryrun-$n.log 2>&1
  rc=$?
  stamp "$n exit $rc: $(grep -E "^preset $p:" /tmp/logs/dryrun-$n.log | head -1 | cut -c1-160)"
  [ -z "$DATA" ] && DATA=$(sed -n 's/.*(cache \(.*\))$/\1/p' /tmp/logs/dryrun-$n.log | head -1)
  table+=("$n=/tmp/run-$n")   # a run without its dryrun.json becomes a failed row
  # the dry-run writes it beside the preset's run (/tmp/run-$n/dryrun/<preset>/), not at the top
  m=$(find /tmp/run-$n -name "memory-step*.md" 2>/dev/null | head -1); [ -n "$m" ] && cp "$m" "$OUT/memory-$n.md"
done
peers=(); for f in "$OUT/unsloth.json" "$OUT/hf.json"; do [ -f "$f" ] && peers+=("$f"); done
${PY:-python3} bench/bench_table.py "$OUT" "${table[@]}" ${peers[@]:+--peers "${peers[@]}"} 2>&1 | tee /tmp/logs/bench_table.log
# Where one step's time goes: a short dry-run of PROFILE_RUN (a preset with the defaults, or a run
# name such as Cfast) with one step profiled (src/tuneledger/profile.py), its kernel-time table by
# category printed and kept.
PROFILE_RUN=${PROFILE_RUN-D}
if [ -n "$PROFILE_RUN" ]; then
  o="$AUTO"; e=""; [ ${#PROFILE_RUN} -gt 1 ] && { variant "$PROFILE_RUN" || PROFILE_RUN=; }
fi
if [ -n "$PROFILE_RUN" ]; then
  if [ "$(left)" -lt 120 ]; then stamp "profile of $PROFILE_RUN skipped: $(left) s left"; else
    d=/tmp/run-prof-$PROFILE_RUN; rm -rf "$d"; p=${PROFILE_RUN:0:1}
    stamp "profile: step $(( WARMUP + 2 )) of $PROFILE_RUN ($o), kernel time by category"
    env $e TUNELEDGER_PROFILE_STEP=$(( WARMUP + 2 )) timeout -k 10 -s INT $(( $(left) - 20 )) $TL dryrun $JOB run_name=prof-$PROFILE_RUN \
      output_dir="$d" $o dryrun_steps=$(( WARMUP + 3 )) --preset "$p" --nproc 1 --no-fit-check $FLAGS \
      > /tmp/logs/dryrun-prof-$PROFILE_RUN.log 2>&1
    f=$(find "$d" -name "profile-step*.md" | head -1)
    if [ -n "$f" ]; then cp "$f" "$OUT/profile-$PROFILE_RUN.md"; sed -n '1,32p' "$f" | tee -a "$LOG"
    else stamp "profile: no profile-step*.md (see /tmp/logs/dryrun-prof-$PROFILE_RUN.log)"; fi
  fi
fi
for p in D C; do
  [ -f /tmp/logs/dryrun-${p}auto.log ] || continue
  grep -h -B2 -A6 "Warning: called a synchronizing" /tmp/logs/dryrun-${p}auto.log | head -120 > /tmp/logs/syncs-$p.log
  stamp "syncs warned in one $p warm-up step: $(grep -c 'called a synchronizing' /tmp/logs/dryrun-${p}auto.log)"
done
cp "$LOG" "$OUT/"; [ -f /tmp/logs/test_speed_gpu.log ] && cp /tmp/logs/test_speed_gpu.log "$OUT/"
# PACK=1 (a device call, which returns at most 8 files): the memory and profile tables and the peers'
# JSONs go back as one archive, tables.tgz (memory_viz's pickles stay behind: tens of MB).
if [ "${PACK:-0}" = 1 ]; then
  extra=$(cd "$OUT" && ls memory-*.md memory-*.json profile-*.md unsloth.json hf.json 2>/dev/null)
  [ -n "$extra" ] && (cd "$OUT" && tar czf tables.tgz $extra && rm -f $extra memory-*.pickle)
fi
tar czf "$OUT/levers-runs.tgz" -C /tmp logs $(cd /tmp && ls -d run-*/dryrun.json run-*/dryrun.md 2>/dev/null; find run-* -name "memory-step*.md" -o -name "memory-step*.json" 2>/dev/null)
stamp done
