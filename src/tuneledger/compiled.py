"""Regional compilation (`torch_compile`): each decoder layer compiled once (the layers share one
graph), to cut the launches and Python between kernels that leave the GPU idle, and, with
gradient checkpointing, the checkpoint traced inside each compiled layer (checkpoint_inside).
Compiling happens in the first steps, which the dry-run counts as start-up (probes.py times it).
"""

from __future__ import annotations

from typing import Any

import torch

from tuneledger import env_levers, versions
from tuneledger.config import COMPILE_NEEDS_FUSED

# ------------------------------------------------------------------------------------- compile
COMPILE_MIN_TORCH = (2, 9)  # what the compiled path was measured on (2.11 on the H200); older: eager by default




def compile_planned(wanted: bool | None, device_type: str) -> bool:
    """Whether compile_layers will compile (before the model exists: Liger needs to know).
    compile_layers can still say off for auto, when the LoRA projections do not fuse."""
    if wanted is not None:
        return bool(wanted)
    return device_type == "cuda" and versions.torch_at_least(COMPILE_MIN_TORCH)


def compile_layers(model: Any, wanted: bool | None, device_type: str, fused: bool, quantized: bool,
                   checkpoint: bool = False, cpp_wrapper: bool = False) -> str:
    """torch.compile each decoder layer (regional compilation: the layers share one compiled
    graph, so it compiles once, not 28 times). `wanted`: True, None (auto: on a CUDA GPU with torch
    >= 2.9 where the LoRA projections are fused or the base is dense) or False. Compiling happens
    in the first steps, which the dry-run counts as start-up. Returns the ledger's line; raises
    ValueError for True on a 4-bit model without the fused projection (COMPILE_NEEDS_FUSED).
    With `checkpoint`, the layers' gradient checkpointing moves inside the compiled region
    (checkpoint_inside). With `cpp_wrapper` (compile_cpp_wrapper), inductor launches the compiled
    kernels from generated C++ instead of Python (TORCHINDUCTOR_CPP_WRAPPER=1 does the same)."""
    _GRAPHS[0] = False
    if wanted is False:  # preset F turns compile off this way (sharding.lever_settings)
        return "off (compile_cpp_wrapper: nothing compiled to wrap)" if cpp_wrapper else "off"
    why = None
    if quantized and not fused:
        if wanted:
            raise ValueError(COMPILE_NEEDS_FUSED)
        why = "the LoRA projections are not fused; bitsandbytes' own 4-bit matmul is not safe to compile"
    elif device_type != "cuda":
        why = "no CUDA GPU"
    elif not versions.torch_at_least(COMPILE_MIN_TORCH):
        why = f"torch {torch.__version__} < {'.'.join(map(str, COMPILE_MIN_TORCH))}, not measured; torch_compile=true to try"
    if why and not wanted:
        return f"off ({why}{'; compile_cpp_wrapper: nothing compiled to wrap' if cpp_wrapper else ''})"
    layers = None
    for m in model.modules():
        if isinstance(getattr(m, "layers", None), torch.nn.ModuleList):
            layers = m.layers
            break
    if layers is None:
        raise ValueError("torch_compile: no decoder layers (a `layers` ModuleList) found")
    from torch import _dynamo

    # DDP's graph splitting (at bucket bounds) exists for whole-model graphs; one layer's graph is
    # small, and the splitter refuses the higher-order op our traced LoraProjection becomes.
    _dynamo.config.optimize_ddp = False
    # The two dequantizations of each weight must stay two (see LoraProjection): without the
    # common-subexpression pass the compiled graph keeps 4-bit weights, not bf16 ones.
    import torch._functorch.config as functorch_config

    functorch_config.cse = False
    mode = "reduce-overhead" if cudagraphs_wanted() and device_type == "cuda" else None
    _GRAPHS[0] = mode is not None
    options, guards = guard_options(_dynamo.config)
    if options and mode:  # torch.compile takes a mode or options, not both: reduce-overhead is this option
        options, mode = {**options, "triton.cudagraphs": True}, None
    for layer in layers:
        if checkpoint:
            checkpoint_inside(layer)
        layer.compile(dynamic=None, mode=mode, options=options)
    import torch._inductor.config as inductor_config

    if cpp_wrapper:  # read when a layer first compiles (its first call), so setting it here is in time
        inductor_config.cpp_wrapper = True
    wrapper = ""  # compile_cpp_wrapper, or TORCHINDUCTOR_CPP_WRAPPER=1: the bench's *cpp rows
    if inductor_config.cpp_wrapper:  # the generated C++ cannot call fused_lora's in-place op (add_product)
        in_place = env_levers.value("TUNELEDGER_ADDMM") != "copy"
        wrapper = ", C++ wrapper" + (" (the LoRA term added out of place in it)" if in_place else "")
    inside = ""
    if checkpoint:
        inside = ", checkpointing inside" + (", partitioner's choice" if env_levers.value("TUNELEDGER_CHECKPOINT_POLICY") == "prefer"
                                             else ", every op recomputed")
    dequant = ""
    if quantized:
        from tuneledger import nf4_kernel

        dequant = (", NF4 dequantized in the graph" if dequant_in_graph() else
                   ", our Triton NF4 dequantize op" if nf4_kernel.is_on() else ", bitsandbytes' dequantize ops")
    graphs = (f", CUDA graphs (TUNELEDGER_CUDAGRAPHS=1, rows padded to a multiple of {CUDAGRAPH_BUCKET})"
              if _GRAPHS[0] else "")
    return f"on ({len(layers)} decoder layers, regional{wrapper}{dequant}{inside}{graphs}{guards})"


# A/B, not measured yet (make bench's *dicttags and *noguard rows): TorchDynamo's cache lookup, the
# guards run before each compiled layer's call, took 34 ms of host time in the 224 layer calls of a
# step of preset C on an H100 (bench/results/h100-2026-12-06f-call2/profile-Cauto.md), while the GPU
# waited for the host 233 ms a step. torch's knobs for it (its docs: "Reducing Guard Overhead"):
#   dict-tags     torch._dynamo.config.use_recursive_dict_tags_for_guards: the guards of a nested
#                 module are skipped while its __dict__ is untouched (sound; off by default in torch
#                 for concerns raised in its issues);
#   skip-modules  guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe: no guards on
#                 module attributes, unsound if one changes after compiling. Training and evaluation
#                 stay apart by grad mode, a global-state guard that is kept (evaluation runs under
#                 torch.no_grad), not by `training`.
def guard_options(dynamo_config: Any) -> tuple[dict | None, str]:
    """What TUNELEDGER_GUARDS asks of the layers' compile: (torch.compile options or None, the
    clause for the ledger's line). dict-tags is set on `dynamo_config` here. A knob this torch lacks
    changes nothing and the clause says so."""
    lever = env_levers.value("TUNELEDGER_GUARDS")
    if lever == "dict-tags":
        if not hasattr(dynamo_config, "use_recursive_dict_tags_for_guards"):
            return None, f", TUNELEDGER_GUARDS=dict-tags: no effect (torch {torch.__version__} has no such config)"
        dynamo_config.use_recursive_dict_tags_for_guards = True
        return None, ", guards by recursive dict tags (TUNELEDGER_GUARDS=dict-tags)"
    if lever == "skip-modules":
        skip = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
        if skip is None:
            return None, f", TUNELEDGER_GUARDS=skip-modules: no effect (torch {torch.__version__} has no guard filters)"
        return {"guard_filter_fn": skip}, ", no guards on module attributes (TUNELEDGER_GUARDS=skip-modules, unsafe)"
    return None, ""


# A/B, not measured yet (make bench's *cgraph rows): the compiled layers replayed as CUDA graphs
# (torch.compile's reduce-overhead mode), which launch a layer's kernels in one call: the lever
# issue 19 names for host-bound presets (C's GPU waits about 6% of a step more than Unsloth's,
# with the same kernel time: bench/results/h100-2026-12-06e-call1). A graph is recorded per row
# length, so padded rows are padded up to a multiple of CUDAGRAPH_BUCKET tokens (their labels
# -100: the loss is unchanged, the tokens/s count real tokens only).
CUDAGRAPH_BUCKET = 64


_GRAPHS = [False]  # set by compile_layers: this process's layers were compiled as CUDA graphs


def cudagraphs_wanted() -> bool:
    """Whether compiled layers are to run as CUDA graphs: TUNELEDGER_CUDAGRAPHS=1 (the A/B)."""
    return env_levers.value("TUNELEDGER_CUDAGRAPHS") == "1"


def cudagraphs_on() -> bool:
    """Whether this process's decoder layers were compiled as CUDA graphs (compile_layers on a CUDA
    GPU with TUNELEDGER_CUDAGRAPHS=1). Without compiled layers the variable changes nothing: no
    bucketed rows, no marked steps (a trial found rows padded to 64 on a CPU run, 18% slower)."""
    return _GRAPHS[0]


def pad_multiple() -> int | None:
    """What the padded collator pads each micro-batch's rows up to a multiple of: CUDAGRAPH_BUCKET
    under CUDA graphs (one recorded graph per bucket, not per length), else None (the longest row)."""
    return CUDAGRAPH_BUCKET if cudagraphs_on() else None


def dequant_in_graph() -> bool:
    """Whether a compiled layer dequantizes NF4 in torch ops of its own graph (fused_lora.dequantize_in_graph)
    instead of bitsandbytes' ops: only with TUNELEDGER_DEQUANT=graph (make bench's *graphdq rows).
    Measured in one H200 call, preset C: 7,952 tokens/s in the graph against 8,177 with bitsandbytes'
    ops (mean step; bench/results/h200-2026-12-04): no gain, so not the default."""
    return env_levers.value("TUNELEDGER_DEQUANT") == "graph"


def checkpoint_inside_wanted() -> bool:
    """Whether compiled layers take their checkpoint inside (checkpoint_inside): yes, unless
    TUNELEDGER_CHECKPOINT_OUTSIDE=1 (make bench's *gcout rows: transformers' checkpoint around them)."""
    return env_levers.value("TUNELEDGER_CHECKPOINT_OUTSIDE") != "1"


def checkpoint_inside_planned(cfg: Any, device_type: str) -> bool:
    """Whether `cfg`'s gradient checkpointing will run inside compiled layers on `device_type`
    (DDP with checkpointing, compile planned, checkpoint_inside_wanted): what model.load_model
    passes to compile_layers, and what grouped_lora cannot run with."""
    return bool(cfg.gradient_checkpointing and not cfg.sharded and checkpoint_inside_wanted()
                and compile_planned(cfg.torch_compile, device_type))


def checkpoint_inside(layer: Any) -> None:
    """Checkpoint `layer` inside its compiled region instead of around it.

    transformers' GradientCheckpointingLayer calls checkpoint(layer) outside the compiled graph,
    so each layer's compiled forward runs twice, each time saving what its backward needs. Traced
    inside, the checkpoint becomes dynamo's activation-checkpoint region: AOT autograd's
    partitioner saves the layer's inputs and recomputes its forward within the backward graph.
    Eval and no-grad calls pass through (nothing to checkpoint)."""
    from torch.utils.checkpoint import checkpoint

    forward = layer.forward
    layer.gradient_checkpointing = False
    extra = {}
    if env_levers.value("TUNELEDGER_CHECKPOINT_POLICY") != "prefer":
        # Every op of the layer MUST_RECOMPUTE (selective checkpointing's policy). The default tag,
        # PREFER_RECOMPUTE, leaves the CUDA partitioner free to save projection outputs: preset B on
        # an H200 then held 13.5 GiB (5,314 tokens/s) against 8.6 GiB (5,142) with this policy and
        # 8.7 GiB with the checkpoint outside (bench/results/h200-2026-12-03). Checkpointing exists
        # for memory; TUNELEDGER_CHECKPOINT_POLICY=prefer (make bench's *prefer rows) keeps the other.
        from functools import partial

        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        extra["context_fn"] = partial(create_selective_checkpoint_contexts,
                                      lambda ctx, op, *a, **k: CheckpointPolicy.MUST_RECOMPUTE)

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not (layer.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    layer.forward = checkpointed


def compile_stats() -> dict:
    """Dynamo's counters (graphs compiled, graph breaks, recompiles), for the ledger."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    return {"graphs": counters["stats"].get("unique_graphs", 0),
            "graph_breaks": sum(counters["graph_break"].values()),
            "frames_ok": counters["frames"].get("ok", 0), "frames_total": counters["frames"].get("total", 0)}
