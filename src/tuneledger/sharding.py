"""Preset F: the base model sharded over the ranks with FSDP2, through accelerate's plugin and the
Trainer (no sharding of our own), and checkpoints that read the same as DDP's.

What F changes against DDP (docs/presets.md):
- `fsdp: full_shard auto_wrap` becomes TrainingArguments(fsdp=True, fsdp_config=...): FSDP2 units of
  one decoder layer each (TRANSFORMER_BASED_WRAP over the model's `_no_split_modules`), activation
  checkpointing by FSDP's wrapper (the Trainer's own gradient checkpointing would gather each
  layer's weights a second time), `reshard_after_forward` per `full_shard` / `shard_grad_op`.
- A 4-bit base is stored as bf16 (`bnb_4bit_quant_storage`), so its packed weights shard as a
  float tensor (transformers, peft and bitsandbytes document this for FSDP-QLoRA).
- The LoRA weights and their Adam state stay fp32 (peft keeps adapters fp32 on a bf16 base, and
  accelerate does not upcast next to 4-bit weights): the same master precision as DDP, so the
  loss matches; the all-gathered compute copy is bf16 on a GPU (accelerate's bf16 policy).
- A checkpoint holds the adapter only, gathered on rank 0 (adapter_model.safetensors, as DDP
  writes it), and the optimizer state in DDP's own layout (optimizer.pt, parameters by index):
  the same files either way, so export and chat read them unchanged, and a run resumes from DDP
  to F and back (`save_optimizer` / `load_optimizer` convert through parameter names).

torch >= 2.6 is needed (accelerate's FSDP2 plugin); the pinned torch 2.5.1 image answers with
`check_torch` before any weights load. accelerate enables FSDP on accelerators only, so a CPU
run (the CI proof over gloo) sets the same plugin on its state (`enable_on_cpu`): the same code
path as on GPUs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tuneledger import versions

FSDP2_MIN_TORCH = (2, 6)
# Levers not yet proven under FSDP2: off in auto, refused when asked for (docs/presets.md says why).
UNPROVEN = {
    "enable_liger_kernel": "Liger's fused linear cross-entropy reads lm_head's weight directly, which FSDP2 keeps "
                           "sharded outside lm_head's own forward",
    "fused_lora": "the fused projection is measured under DDP only",
    "grouped_lora": "the grouped projection is measured under DDP only",
    "torch_compile": "regional compile under FSDP2's hooks is not measured yet",
}
# Module wrappers that named_parameters() shows and state-dict names do not.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def check_torch(version: str | None = None) -> None:
    """Raise ValueError when this torch has no FSDP2 that accelerate drives (below 2.6)."""
    import torch

    v = version or torch.__version__
    if versions.major_minor(v) < FSDP2_MIN_TORCH:
        raise ValueError(f"preset F (fsdp) needs torch >= {'.'.join(map(str, FSDP2_MIN_TORCH))} for FSDP2 through "
                         f"accelerate; this environment has torch {v} (the pinned image and `make venv` have 2.5.1). Use DDP "
                         "(presets A-D: one whole copy per GPU), or run F where torch is newer (docs/presets.md)")


def lever_settings(cfg: Any) -> dict[str, Any]:
    """The speed levers' `wanted` values under F: each unproven lever False, with the reason in
    `why`. Raises ValueError for a lever set to true explicitly."""
    asked = [k for k in UNPROVEN if getattr(cfg, k) is True]
    if asked:
        raise ValueError(f"{', '.join(asked)}: true is not supported with fsdp (preset F): "
                         + "; ".join(UNPROVEN[k] for k in asked) + ". Leave it unset")
    return {k: False for k in UNPROVEN}


def fsdp_arguments(cfg: Any, layer_classes: list[str]) -> dict[str, Any]:
    """TrainingArguments' `fsdp` and `fsdp_config` for a sharded job: {"fsdp": True, "fsdp_config":
    {...}} (transformers' names), or {} for DDP. `layer_classes`: the decoder layer class names
    (the model's `_no_split_modules`), one FSDP unit each, unless fsdp_config names its own."""
    if not cfg.sharded:
        return {}
    words = str(cfg.fsdp).split()
    given = dict(cfg.fsdp_config or {})
    conf = {
        "version": 2,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": layer_classes,
        # shard_grad_op keeps each layer's gathered weights from forward to backward.
        "reshard_after_forward": "shard_grad_op" not in words,
        "activation_checkpointing": cfg.gradient_checkpointing,
        "state_dict_type": "FULL_STATE_DICT",
    }
    if "offload" in words:
        conf["cpu_offload"] = True
    if given.pop("offload_params", None):
        conf["cpu_offload"] = True
    conf.update(given)
    return {"fsdp": True, "fsdp_config": conf}


def describe(args: Any) -> str:
    """The ledger's line for the sharding a Trainer ran (its TrainingArguments)."""
    if not args.fsdp:
        return "DDP: one whole copy per rank"
    c = args.fsdp_config
    return (f"FSDP2 (accelerate's plugin): units {','.join(c.get('transformer_layer_cls_to_wrap') or [])}, "
            f"reshard after forward {c.get('reshard_after_forward')}, activation checkpointing "
            f"{c.get('activation_checkpointing')}, CPU offload {bool(c.get('cpu_offload'))}; "
            f"{', '.join(UNPROVEN)} off: not proven under FSDP2 (docs/presets.md)")


def enable_on_cpu(trainer: Any) -> None:
    """accelerate turns its FSDP plugin on for accelerators only (AcceleratorState keeps
    MULTI_CPU); set the plugin on a CPU run's state, so gloo runs the GPU path's code."""
    if not trainer.args.fsdp_plugin_args or trainer.is_fsdp_enabled:
        return
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    trainer.is_fsdp_enabled = True


def clean_name(name: str) -> str:
    """A parameter's state-dict name: named_parameters() without the wrappers' parts."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def trainable(model: Any) -> list[tuple[str, Any]]:
    """(clean name, parameter) of every trainable parameter, in named_parameters() order: the
    same order on every rank, which the gathers below rely on."""
    return [(clean_name(n), p) for n, p in model.named_parameters() if p.requires_grad]


def adapter_state(model: Any, keep: bool) -> dict[str, Any]:
    """The adapter's full weights {name: CPU tensor}, gathered from the shards. Every rank must
    call it (one all-gather per parameter); `keep` (rank 0) returns them, the others get {}."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in trainable(model):
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if keep:
            out[name] = full.detach().to("cpu", copy=True)
    return out


def save_adapter(model: Any, state: dict[str, Any], out_dir: Path, adapter_name: str = "default") -> None:
    """Write `state` (adapter_state's) as peft's save_pretrained writes a DDP run's adapter:
    adapter_model.safetensors with the adapter's name dropped from the keys, adapter_config.json
    in inference mode, the model card. (peft's own save picks the LoRA entries by the module names,
    which FSDP's activation-checkpoint wrapper changes: it would write an empty file.)"""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k.replace(f".{adapter_name}", ""): v.contiguous() for k, v in state.items()},
              str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = model.peft_config[adapter_name]
    was = config.inference_mode
    config.inference_mode = True
    try:
        config.save_pretrained(str(out_dir))
    finally:
        config.inference_mode = was
    model.create_or_update_model_card(str(out_dir))


def save_optimizer(model: Any, optimizer: Any, path: Path, keep: bool) -> None:
    """Write the optimizer state as DDP's torch.save(optimizer.state_dict()) does (parameters by
    index, in param_groups order) to `path` from rank 0 (`keep`). Every rank must call it."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not keep:
        return
    state, groups, i = {}, [], 0
    for group in full["param_groups"]:
        ids = []
        for fqn in group["params"]:
            if fqn in full["state"]:
                state[i] = full["state"][fqn]
            ids.append(i)
            i += 1
        groups.append({**group, "params": ids})
    torch.save({"state": state, "param_groups": groups}, path)


def load_optimizer(model: Any, optimizer: Any, saved: dict) -> None:
    """Load DDP-layout optimizer state (`saved`, as torch.load returned it, on every rank) into the
    sharded optimizer. Raises ValueError when the groups or parameter counts do not match."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    name_of = {id(p): n for n, p in trainable(model)}
    groups = inner.param_groups
    if len(groups) != len(saved["param_groups"]) or any(
            len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved["param_groups"])):
        raise ValueError("the checkpoint's optimizer holds "
                         f"{[len(s['params']) for s in saved['param_groups']]} parameters per group, this run "
                         f"{[len(g['params']) for g in groups]}: not the same adapter (lora_rank, lora_target)")
    state, out_groups = {}, []
    for g, s in zip(groups, saved["param_groups"]):
        fqns = [name_of[id(p)] for p in g["params"]]
        for idx, fqn in zip(s["params"], fqns):
            if idx in saved["state"]:
                state[fqn] = saved["state"][idx]
        out_groups.append({**s, "params": fqns})
    set_optimizer_state_dict(model, inner, optim_state_dict={"state": state, "param_groups": out_groups},
                             options=StateDictOptions(full_state_dict=True))


def load_adapter(model: Any, checkpoint: Path, adapter_name: str = "default") -> None:
    """Load a checkpoint's adapter_model.safetensors (DDP's or F's: the same file) into the sharded
    model on every rank. Raises ValueError naming a LoRA weight the file lacks."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    path = Path(checkpoint) / "adapter_model.safetensors"
    saved = load_file(str(path))
    want = {}
    for name, p in trainable(model):
        key = name.replace(f".{adapter_name}", "")  # peft's file names drop the adapter's name
        if key not in saved:
            raise ValueError(f"{path}: no {key}: the checkpoint is not this run's adapter (lora_rank, lora_target)")
        want[name] = saved[key].to(p.dtype)
    set_model_state_dict(model, want, options=StateDictOptions(full_state_dict=True, strict=False))


def predicted_peak_gib(weights_gib: float, lora_state_gib: float, activations_gib: float, layer_gib: float,
                       world: int) -> float:
    """F's per-GPU peak at `world` ranks (GiB), from one measured run:

        (weights + LoRA weights, grads and Adam state) / world + activations
            + 2 x one layer's weights x (world - 1) / world

    the sharded state divided over the ranks, the activations as measured (they do not shard:
    each rank runs its own micro-batch), and two gathered decoder layers (the one computing and
    the one FSDP2 prefetches) less the shard of them a rank holds anyway. The weights are the
    base as stored (4-bit packed, or bf16). Raises ValueError for world < 1."""
    if world < 1:
        raise ValueError(f"world size {world}: must be >= 1")
    return (weights_gib + lora_state_gib) / world + activations_gib + 2 * layer_gib * (world - 1) / world


FIT_FORMULA = ("F's per-GPU peak at N GPUs = (base weights as stored + LoRA weights, grads and Adam state [16 bytes "
               "per trainable parameter]) / N + activations (measured: this run's peak less its state) + 2 x one decoder "
               "layer x (N - 1) / N (the gathered layer and the prefetched one); DDP's is the measured peak at any N")


def peak_by_world(row: dict, worlds: tuple[int, ...] = (1, 2, 4, 8)) -> dict | None:
    """DDP's measured per-GPU peak beside F's predicted one at each world size in `worlds` (GiB),
    from one dry-run row (its model info and memory_mib), or None where no GPU memory was measured
    (a CPU run). The formula (FIT_FORMULA, predicted_peak_gib) is in the result."""
    peaks = [m.get("peak_allocated") for m in row.get("memory_mib") or []]
    model = row.get("model") or {}
    if not peaks or None in peaks or "weights_mib" not in model:
        return None
    peak = max(peaks) / 1024
    weights, layer = model["weights_mib"] / 1024, model["layer_mib"] / 1024
    lora_state = model["trainable_params"] * 16 / 2**30
    measured_world = row.get("world_size") or 1
    if (row.get("config") or {}).get("fsdp"):  # measured under F: take its own sharding back out
        held = (weights + lora_state) / measured_world + 2 * layer * (measured_world - 1) / measured_world
    else:
        held = weights + lora_state
    activations = max(0.0, peak - held)
    return {"ddp_gib": round(weights + lora_state + activations, 2), "activations_gib": round(activations, 2),
            "f_gib": {n: round(predicted_peak_gib(weights, lora_state, activations, layer, n), 2) for n in worlds},
            "formula": FIT_FORMULA}
