"""Model and tokenizer loading: the same code for a hub id, a local path and a synthetic model.

QLoRA loads one full 4-bit copy per rank onto `cuda:LOCAL_RANK` (`device_map={"": local_rank}`),
never `device_map="auto"`, which would split one copy across GPUs and serialise them: pure DDP.

We do not call peft's `prepare_model_for_kbit_training`. It upcasts every non-4-bit weight
(embeddings, norms, lm_head) to fp32, which cost 22% of GPU time in dtype casts on an H200
(../shared/notes/h200-baseline.md). We keep what training needs from it: frozen base weights,
gradients enabled on the inputs (so checkpointed blocks have a grad path), and non-reentrant
gradient checkpointing. bench/results has the measured difference.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tuneledger import compiled, env_levers, fused_lora, grouped, nf4, nf4_kernel, offload, speed, swiglu
from tuneledger.model_location import PreflightError, hub_offline, locate_model, looks_like_path  # noqa: F401
from tuneledger.tokenizer_load import fix_end_of_turn, load_tokenizer  # noqa: F401  (tokenizers are the data side's)

# Model types and architectures that are not text-only causal LMs. Checked on config.json before
# any weights are fetched: a VL checkpoint is ~1 GB bigger and trains a vision tower we never use.
VISION_MODEL_TYPES = ("vl", "vision", "llava", "idefics", "paligemma", "mllama", "pixtral", "qwen2_audio", "omni")


def read_model_config(name_or_path: str) -> dict:
    """config.json of a local model directory or a hub repo (that one file only, honouring HF_ENDPOINT).

    Raises PreflightError when it cannot be found or read.
    """
    local = locate_model(name_or_path)
    if local is not None:
        path = local / "config.json"
        if not path.is_file():
            raise PreflightError(f"{local} has no config.json: is it a model directory?")
    else:
        try:
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(name_or_path, "config.json"))
        except Exception as e:  # offline, unknown repo, gated: say which and how to fix
            raise PreflightError(
                f"cannot fetch config.json of '{name_or_path}' from {os.environ.get('HF_ENDPOINT', 'https://huggingface.co')}: "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. Download the model to a local directory "
                "and set model_name_or_path to it, or set HF_ENDPOINT to a mirror.") from None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PreflightError(f"{path}: cannot read model config: {e}") from None


def check_text_causal_lm(config: dict, name: str) -> None:
    """Refuse vision-language and non-causal-LM checkpoints, naming the field that shows it."""
    model_type = str(config.get("model_type", ""))
    archs = [str(a) for a in config.get("architectures") or []]
    lowered = [model_type.lower()] + [a.lower() for a in archs]
    if "vision_config" in config or any(tag in x for x in lowered for tag in VISION_MODEL_TYPES):
        raise PreflightError(
            f"{name} is a vision-language model (model_type={model_type!r}, architectures={archs}); this job trains text "
            "only. Use the text variant, e.g. Qwen/Qwen2.5-7B-Instruct rather than Qwen/Qwen2.5-VL-7B-Instruct.")
    if archs and not any(a.endswith("ForCausalLM") for a in archs):
        raise PreflightError(f"{name}: architectures={archs} has no *ForCausalLM; tuneledger fine-tunes causal LMs only")


def check_remote_code(config: dict, name: str, trust: bool) -> str:
    """Refuse a model that ships its own Python code (`auto_map` in config.json); return a line.

    trust_remote_code would run that code in every rank. The models this tool trains are built
    into transformers, so `trust_remote_code: true` (common in LLaMA-Factory configs) is accepted
    and has no effect; the line says so, loudly, for the log and the ledger.
    Raises PreflightError naming the auto_map entries.
    """
    auto_map = config.get("auto_map")
    if auto_map:
        raise PreflightError(f"{name} ships its own Python code (config.json auto_map: {sorted(auto_map)}); tuneledger "
                             "never runs a model's code (trust_remote_code). Use a transformers-native variant of the model.")
    if trust:
        return (f"NOTE trust_remote_code: true has no effect: {name} is built into transformers "
                f"({config.get('model_type', '?')}), so no code from the model folder runs")
    return "remote code: none (the model is built into transformers)"


def is_synthetic(config: dict) -> bool:
    return "tuneledger_synthetic" in config


def align_special_tokens(model: Any, tok: Any) -> None:
    """Give the model's config and generation config the tokenizer's eos, bos and pad ids.

    transformers' Trainer does the same alignment itself, and then warns about it on every rank
    of every launch; done here first, there is nothing left for it to change or say. eos stays a
    list in the generation config, the tokenizer's first, so any of the model's own still stops it.
    """
    config, gen = model.config, getattr(model, "generation_config", None)
    config.eos_token_id, config.bos_token_id, config.pad_token_id = tok.eos_token_id, tok.bos_token_id, tok.pad_token_id
    if gen is not None:
        eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
        gen.eos_token_id = [tok.eos_token_id] + [e for e in eos if e is not None and e != tok.eos_token_id]
        gen.bos_token_id, gen.pad_token_id = tok.bos_token_id, tok.pad_token_id


def check_embedding_rows(tok: Any, config: dict, name: str) -> str:
    """Refuse a tokenizer that can produce ids past the model's embedding rows (an IndexError in
    the first forward pass otherwise). `config` is the model's config.json. Returns a line for the log.

    Raises PreflightError naming the token, its id and the number of rows.
    """
    rows = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not rows:
        return "tokenizer: the model config has no vocab_size to check the ids against"
    for what in ("pad", "eos"):
        token, tid = getattr(tok, f"{what}_token"), getattr(tok, f"{what}_token_id")
        if tid is not None and tid >= rows:
            raise PreflightError(f"tokenizer of {name}: the {what} token {token!r} has id {tid:,}, but the model has "
                                 f"only {rows:,} embedding rows (ids 0..{rows - 1:,}); use the tokenizer that came with "
                                 "the model, or one whose special tokens lie inside its vocabulary")
    if len(tok) > rows:
        raise PreflightError(f"tokenizer of {name} has {len(tok):,} tokens, but the model has only {rows:,} embedding "
                             f"rows: ids {rows:,}..{len(tok) - 1:,} would fail in the first forward pass; use the "
                             "tokenizer that came with the model")
    return f"tokenizer: {len(tok):,} tokens within the model's {rows:,} embedding rows, pad {tok.pad_token!r}"


def _lever(apply: Any, *args: Any, **kwargs: Any) -> Any:
    """Run one speed lever; a lever asked for (True) that cannot run is a PreflightError."""
    try:
        return apply(*args, **kwargs)
    except ValueError as e:
        raise PreflightError(str(e)) from None


def load_model(cfg: Any, device: Any) -> tuple[Any, dict]:
    """Load the base model on `device` (4-bit when `quantization_bit` is 4) and wrap it with LoRA,
    initialised from `cfg.seed`.

    Returns (peft model, info) where info has trainable/total parameters, attention backend,
    the speed levers that ran (speed.py, one line each), dtype (bf16 on CUDA when `cfg.bf16`, else fp32) and whether the model is synthetic. Raises PreflightError for 4-bit without CUDA.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    # bf16 is the GPU's compute type. CPUs without native bf16 (no AVX512-BF16/AMX) emulate it: a
    # bf16 matmul ran at 1.6 GFLOP/s against fp32's 64 on CI's 2-core EPYC, so a CPU run is fp32.
    dtype = torch.bfloat16 if cfg.bf16 and device.type == "cuda" else torch.float32
    if cfg.use_unsloth:  # Unsloth's model and LoRA, its own kernels (unsloth_backend.py; checked at preflight)
        from tuneledger import unsloth_backend

        model, levers = unsloth_backend.load(cfg, device, dtype)
        if cfg.use_unsloth_gc:
            levers["use_unsloth_gc"] = ("on (Unsloth's own checkpointing, which moves the layer inputs to host memory)"
                                        if cfg.gradient_checkpointing else "off (gradient checkpointing is off)")
        base = model.get_base_model()
        attn = str(getattr(base.config, "_attn_implementation", None) or "sdpa")
        return model, _info(model, cfg, attn, levers, dtype, *_sizes(base))
    wanted = {k: getattr(cfg, k) for k in ("enable_liger_kernel", "fused_lora", "grouped_lora", "torch_compile")}
    if cfg.sharded:  # preset F (sharding.py): FSDP2 needs a newer torch, and some levers are not proven there
        from tuneledger import sharding

        _lever(sharding.check_torch)
        wanted = _lever(sharding.lever_settings, cfg)
    attn, attn_why = _lever(speed.pick_attention, cfg.flash_attn, cfg.packing, device.type)
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": attn}
    if cfg.quantization_bit == 4:
        if device.type != "cuda":
            raise PreflightError("quantization_bit: 4 needs a CUDA GPU (bitsandbytes); on CPU set quantization_bit=null")
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=cfg.quantization_type,
            bnb_4bit_use_double_quant=cfg.double_quantization, bnb_4bit_compute_dtype=dtype,
            # F: the packed 4-bit weights stored as a float tensor, which FSDP2 can shard
            **({"bnb_4bit_quant_storage": dtype} if cfg.sharded else {}))
    # One whole copy per rank on this rank's device: pure DDP.
    kwargs["device_map"] = {"": device.index if device.type == "cuda" else "cpu"}
    model = AutoModelForCausalLM.from_pretrained(cfg.model_name_or_path, **kwargs)
    model.config.use_cache = False
    levers = {"attention": attn_why, "liger": _lever(speed.apply_liger, model, wanted["enable_liger_kernel"], device.type,
                                                     compiled.compile_planned(wanted["torch_compile"], device.type))}
    layer_classes, weights_bytes, layer_bytes = _sizes(model)

    for p in model.parameters():
        p.requires_grad_(False)
    # F: FSDP's activation checkpointing wraps each layer instead (the Trainer's own would gather
    # every layer's weights a second time in backward).
    if cfg.gradient_checkpointing and not cfg.sharded:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # Checkpointed blocks need an input that requires grad to have a backward path through frozen
    # embeddings; peft's k-bit preparation does the same.
    model.enable_input_require_grads()

    target = "all-linear" if cfg.lora_target == "all" else [t.strip() for t in cfg.lora_target.split(",")]
    # The LoRA A matrices are drawn at random here, before the Trainer seeds anything: seed first,
    # so the same seed gives the same adapter (and the same first losses).
    from transformers import set_seed

    set_seed(cfg.seed)
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=target, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    levers["fused_lora"] = _lever(fused_lora.fuse_lora, model, wanted["fused_lora"])
    levers["nf4_kernel"] = _lever(nf4_kernel.use, cfg.nf4_kernel, cfg.nf4_base, levers["fused_lora"].startswith("on"))
    # After the kernel's check (its default depends on it), before grouping, which lays the
    # plain scales out with the weights. The fused projection reads the quant state at each call.
    # Grouped projections keep absmax_once by default: there the nested kernel measured slower
    # (C: 0.82x, bench/results/h100-2026-12-07c-call2), unlike on B's single projections (+18%).
    group_args = (wanted["grouped_lora"], levers["fused_lora"].startswith("on"), cfg.lora_dropout,
                  compiled.checkpoint_inside_planned(cfg, device.type))
    levers["absmax_once"] = nf4.absmax_once(model, cfg.absmax_once, cfg.sharded, nf4_kernel.rebuilds_nested_scales()
                                            and not compiled.dequant_in_graph() and not grouped.planned(*group_args))
    levers["grouped_lora"] = _lever(grouped.group_lora, model, *group_args)
    levers["swiglu_recompute"] = _lever(swiglu.recompute_swiglu, model, cfg.swiglu_recompute,
                                        levers["fused_lora"].startswith("on"), cfg.gradient_checkpointing)
    levers["compile"] = _lever(compiled.compile_layers, model, wanted["torch_compile"], device.type,
                               levers["fused_lora"].startswith("on"), bool(cfg.quantization_bit),
                               checkpoint=cfg.gradient_checkpointing and not cfg.sharded and compiled.checkpoint_inside_wanted(),
                               cpp_wrapper=cfg.compile_cpp_wrapper)
    levers["use_unsloth_gc"] = _lever(offload.offload_layer_inputs, model, cfg.use_unsloth_gc, cfg.gradient_checkpointing)
    if ab := env_levers.active():  # make bench's A/B variables: every row says how it ran
        unused = compiled.cudagraphs_wanted() and not compiled.cudagraphs_on()
        unguarded = env_levers.value("TUNELEDGER_GUARDS") and not levers["compile"].startswith("on")
        unmoved = env_levers.value("TUNELEDGER_OFFLOAD") and not levers["use_unsloth_gc"].startswith("on")
        levers["env"] = ab + (" (TUNELEDGER_CUDAGRAPHS: no effect, no layers compiled on a CUDA GPU)" if unused else "") + (
            " (TUNELEDGER_GUARDS: no effect, no layers compiled)" if unguarded else "") + (
            " (TUNELEDGER_OFFLOAD: no effect, use_unsloth_gc is off)" if unmoved else "")
    levers["lora_dropout"] = cfg.lora_dropout
    if cfg.lora_dropout:
        # What the user weighs it against (measured in make bench's Ddrop row, not in this run).
        levers["lora_dropout_cost"] = ("in the fused projection about 3% of preset D's tokens/s and no memory on one H200 "
                                       "(bench/results/h200-2026-12-01-session3); set lora_dropout=0 (LLaMA-Factory's "
                                       "and Unsloth's default) to skip it" if levers["fused_lora"].startswith("on") else
                                       "peft's dropout keeps a copy of each projection's input; the fused projection "
                                       "(fused_lora) keeps none")
    return model, _info(model, cfg, attn, levers, dtype, layer_classes, weights_bytes, layer_bytes)


def _sizes(model: Any) -> tuple[list, int, int]:
    """The base model's FSDP unit classes, its bytes as stored on the device and one decoder layer's."""
    layer_classes = sorted(set(getattr(model, "_no_split_modules", None) or []))
    weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    layers = getattr(getattr(model, "model", model), "layers", None)
    layer_bytes = sum(p.numel() * p.element_size() for p in layers[0].parameters()) if layers else 0
    return layer_classes, weights_bytes, layer_bytes


def _info(model: Any, cfg: Any, attn: str, levers: dict, dtype: Any, layer_classes: list, weights_bytes: int,
          layer_bytes: int) -> dict:
    """load_model's info dict for the peft model."""
    trainable, total = model.get_nb_trainable_parameters()
    return {
        "trainable_params": int(trainable), "total_params": int(total),
        "trainable_pct": round(100 * trainable / total, 2),
        "attention": attn, "levers": levers, "dtype": str(dtype).replace("torch.", ""),
        "quantization": (f"{cfg.quantization_type} 4-bit, double quant {cfg.double_quantization}"
                         + (" (absmax fp32 from load: absmax_once)" if str(levers.get("absmax_once", "")).startswith("on")
                            else "") if cfg.quantization_bit else "none"),
        "synthetic": bool(getattr(model.config, "tuneledger_synthetic", None)),
        # N of the MFU formula: every weight a token passes through in matmuls (lm_head included,
        # the embedding lookup not).
        "matmul_params": int(total - trainable - model.config.vocab_size * model.config.hidden_size),
        # The base as stored on the device (4-bit packed or bf16) and one decoder layer of it, in
        # MiB: F's fit formula (sharding.predicted_peak_gib). layer_classes: F's FSDP units.
        "weights_mib": round(weights_bytes / 2**20, 1), "layer_mib": round(layer_bytes / 2**20, 1),
        "layer_classes": layer_classes,
    }
