"""What tuneledger does with each LLaMA-Factory config key: implement, ignore (and why), or refuse.

A LLaMA-Factory SFT yaml runs here unchanged. Its keys fall into three groups:
  implemented  a JobConfig field of the same name (or an alias that sets one), read as LLaMA-Factory
               reads it;
  ignored      accepted, and listed once with the reason it does not apply here (`do_train`,
               `overwrite_cache`, `stage: sft`, ...);
  refused      it asks for something tuneledger does not do (`stage: dpo`, `deepspeed`, ...); the
               error names the key and what to use instead.
Some keys are ignored at one value and refused at another (`stage: sft` / `stage: dpo`). A key
with no rule here is accepted at LLaMA-Factory's default value (it then changes nothing) and
refused at any other.

The key list is data/llamafactory_keys.json, made by scripts/llamafactory_keys.py from
LLaMA-Factory's hparams sources (Apache-2.0); docs/llamafactory-keys.md is generated from this
module's rules by the same script (llamafactory_docs.py).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

KEYS_JSON = Path(__file__).parent / "data" / "llamafactory_keys.json"


@functools.cache
def lf_keys() -> dict[str, dict]:
    """LLaMA-Factory's train keys: name -> {"group": its dataclass, "default": literal or "?"}."""
    return json.loads(KEYS_JSON.read_text(encoding="utf-8"))["keys"]


def lf_source() -> str:
    return json.loads(KEYS_JSON.read_text(encoding="utf-8"))["source"]


# Accepted with any value: why it does not apply here.
IGNORED: dict[str, str] = {
    "do_train": "`tuneledger train` always trains",
    "do_eval": "evaluation runs when there is eval data (val_size or eval_dataset) and eval_strategy is not 'no'",
    "do_predict": "training does not predict; a predict config (do_predict + predict_with_generate) runs as "
                  "`tuneledger eval CONFIG.yaml`",
    "overwrite_cache": "the tokenized cache is keyed on the data files' sha256, the tokenizer and every setting that "
                       "changes the tokens, so changed input is tokenized again anyway; `make clean-cache` drops it",
    "overwrite_output_dir": "a run resumes from its last checkpoint when its settings match (resume_from_checkpoint: "
                            "auto) and refuses when they differ; resume_from_checkpoint=never starts the folder over",
    "use_reentrant_gc": "gradient checkpointing is always non-reentrant",
    "ddp_find_unused_parameters": "set to false: LoRA on every linear layer gives every trainable weight a gradient",
    "load_best_model_at_end": "the best checkpoint by eval loss is recorded (train.json `best_checkpoint`) and "
                              "`make export RUN=... CHECKPOINT=best` merges it; nothing is reloaded at the end",
    "metric_for_best_model": "the best checkpoint is always the one with the lowest eval loss",
    "greater_is_better": "the best checkpoint is always the one with the lowest eval loss",
    "logging_dir": "TensorBoard events go to <output_dir>/tensorboard",
    "logging_strategy": "loss is logged every logging_steps optimizer steps",
    "save_strategy": "checkpoints are saved every save_steps optimizer steps",
    "save_safetensors": "adapters are saved as safetensors",
    "remove_unused_columns": "the tokenized dataset holds only the columns training reads",
    "ignore_pad_token_for_loss": "padding never counts in the loss (labels -100)",
    "use_fast_tokenizer": "the tokenizer loads with transformers' AutoTokenizer defaults (fast)",
    "tokenized_path": "tokenized data is cached under cache_dir, keyed on the data and settings",
    "data_shared_file_system": "the launcher tokenizes once, before the ranks start; ranks only read the cache",
    "low_cpu_mem_usage": "weights load straight to each rank's device",
    "preprocessing_batch_size": "records are tokenized in batches of 64",
    "print_param_status": "the trainable parameter count is printed and written to the ledger",
    "include_effective_tokens_per_second": "tokens/s of real (non-pad) tokens is always logged",
    "include_num_input_tokens_seen": "real (non-pad) tokens are always counted",
    "disable_tqdm": "train shows a progress bar, the dry-run does not",
    "hub_token": "no hub upload from training", "hf_hub_token": "uses the environment's HF_TOKEN, if any",
    "ms_hub_token": "ModelScope downloads go through `make fetch USE_MODELSCOPE_HUB=1`",
    "om_hub_token": "no Modelers hub support; models are local directories or Hugging Face ids",
    "local_rank": "set by torchrun", "master_addr": "the launcher picks 127.0.0.1 and a free port",
    "master_port": "the launcher picks a free port each run (the field report hit 'address in use' on 29500)",
    "ddp_backend": "nccl on GPUs, gloo on CPUs", "use_cpu": "`tuneledger train --cpu`",
    "dataloader_pin_memory": "transformers' default", "dataloader_persistent_workers": "transformers' default",
    "dataloader_prefetch_factor": "transformers' default", "seed_data": "records are shuffled by seed",
    "data_seed": "records are shuffled and held out by seed",
}
# Generation settings: training does not generate.
for _k in ("do_sample", "temperature", "top_p", "top_k", "num_beams", "max_length", "max_new_tokens",
           "repetition_penalty", "length_penalty", "skip_special_tokens", "generation_max_length",
           "generation_num_beams", "generation_config", "predict_with_generate", "sortish_sampler", "eval_num_beams"):
    IGNORED[_k] = "generation setting: training does not generate (`tuneledger chat` takes --max-new-tokens)"


@dataclass
class Only:
    """A key that is ignored at the values we do anyway and refused at any other."""

    accepted: Callable[[Any], bool]
    why_ignored: str
    instead: str
    shown: str  # the accepted values, for the docs


ONLY: dict[str, Only] = {
    "stage": Only(lambda v: v == "sft", "supervised fine-tuning is what tuneledger does", "tuneledger does supervised "
                  "fine-tuning only (stage: sft); train pt/rm/ppo/dpo/kto with LLaMA-Factory", "sft"),
    "finetuning_type": Only(lambda v: v == "lora", "tuneledger trains LoRA adapters", "tuneledger trains LoRA (or QLoRA "
                            "with quantization_bit: 4) only; set finetuning_type: lora", "lora"),
    "quantization_method": Only(lambda v: v in ("bnb", "bitsandbytes"), "4-bit quantization is bitsandbytes NF4/FP4",
                                "QLoRA here quantizes with bitsandbytes only: set quantization_method: bnb", "bnb"),
    "save_only_model": Only(lambda v: not v, "checkpoints hold the optimizer and scheduler state, so a run can resume",
                            "checkpoints keep the optimizer state so a stopped run resumes; remove save_only_model "
                            "(the adapter alone is adapter_model.safetensors in each checkpoint)", "false"),
    "fp16": Only(lambda v: not v, "bf16 is the compute type", "fp16 is not supported: use bf16: true", "false"),
    "pure_bf16": Only(lambda v: not v, "LoRA weights train in fp32 over a bf16 base",
                      "pure_bf16 (bf16 LoRA weights) is not supported; remove it (bf16: true is the base's dtype)", "false"),
    "train_on_prompt": Only(lambda v: not v, "only assistant replies are supervised",
                            "train_on_prompt is not supported: only assistant replies (and their end-of-turn token) "
                            "are supervised", "false"),
    "mask_history": Only(lambda v: not v, "every assistant turn is supervised",
                         "mask_history is not supported: every assistant turn is supervised", "false"),
    "streaming": Only(lambda v: not v, "datasets are tokenized and cached before training",
                      "streaming is not supported: the data is tokenized into a cache first (`make stats`)", "false"),
    "use_dora": Only(lambda v: not v, "plain LoRA", "use_dora is not supported: tuneledger trains plain LoRA", "false"),
    "use_rslora": Only(lambda v: not v, "plain LoRA scaling (alpha / rank)",
                       "use_rslora is not supported: set lora_alpha for the scaling you want", "false"),
    "resize_vocab": Only(lambda v: not v, "the tokenizer's vocabulary is used as it is",
                         "resize_vocab is not supported: the base's vocabulary is kept", "false"),
    "group_by_length": Only(lambda v: not v, "micro-batches are drawn at random",
                            "group_by_length is not supported; packing: true (preset D) removes padding instead", "false"),
    "gradient_checkpointing_kwargs": Only(lambda v: not v, "non-reentrant gradient checkpointing",
                                          "gradient checkpointing is always non-reentrant; remove gradient_checkpointing_kwargs", "unset"),
}

# Refused at any value: what to use instead.
REFUSED: dict[str, str] = {
    # The field report (seeds/000): ZeRO partitions optimizer state, gradients and weights, and that
    # fights bitsandbytes' 4-bit weights; FSDP2 shards them once they are stored as bf16.
    "deepspeed": "remove deepspeed: tuneledger runs DDP (presets A-D, one whole copy per GPU) or FSDP2 (preset F, "
                 "fsdp: full_shard auto_wrap, the model sharded over the GPUs when one copy does not fit a card), not "
                 "DeepSpeed; with quantization_bit: 4 ZeRO would not work at all: ZeRO and 4-bit (QLoRA) weights do not "
                 "mix (ZeRO partitions the weights that bitsandbytes packs)",
    # Training only: in export, chat and eval it names the adapter to use (USE_RULES).
    "adapter_name_or_path": "tuneledger does not train on from an existing adapter; to go on training a run, start the "
                            "same run again (it resumes from its last checkpoint)",
    "push_to_hub": "upload runs/<run>/export yourself (huggingface-cli upload)",
}

# Keys with no rule of their own, by prefix: what to use instead of setting them.
FAMILIES: list[tuple[tuple[str, ...], str]] = [
    (("pref_", "kto_", "ppo_", "simpo_", "dpo_", "reward_model", "ref_model", "ld_alpha"),
     "a preference/RLHF stage setting: tuneledger does SFT only"),
    (("galore_", "use_galore", "apollo_", "use_apollo", "badam_", "use_badam", "use_muon", "use_adam_mini", "loraplus_",
      "pissa_", "use_llama_pro", "freeze_", "oft_", "additional_target", "module_dropout", "create_new_adapter",
      "use_asft_loss", "asft_", "use_dft_loss", "use_eaft_loss", "eaft_", "train_from_scratch", "mixture_of_depths"),
     "another fine-tuning method or optimizer: tuneledger trains plain LoRA (lora_rank, lora_alpha, lora_dropout, "
     "lora_target)"),
    (("vllm_", "sglang_", "infer_", "kt_", "use_kt", "use_v1_kernels", "use_kv_cache"),
     "an inference setting: try the result with `tuneledger chat RUN`"),
    (("export_",), "an export setting: a merge config runs as `tuneledger export CONFIG.yaml` (make export CONFIG=...)"),
    (("image_", "video_", "audio_", "media_dir", "crop_to_patches", "use_audio_in_video"),
     "a multimodal setting: tuneledger trains text-only models"),
    (("swanlab_", "use_swanlab"), "use report_to: tensorboard"),
    (("profiler_", "enable_torch_profiler"), "`make dryrun` measures where the step's time goes"),
    (("ray_", "use_mca", "megatron_", "use_megatron", "hyper_parallel", "use_hyper_parallel"),
     "tuneledger launches DDP with torchrun itself (make train NPROC=N)"),
    (("hub_", "push_to_hub"), "upload runs/<run>/export yourself (huggingface-cli upload)"),
    (("fp8",), "bf16 is the compute type"),
    (("tf32", "bf16_full_eval", "fp16_", "half_precision_backend", "jit_mode_eval", "use_ipex"),
     "the precision is bf16 (fp32 on CPUs) and is not configurable further"),
]
DEFAULT_INSTEAD = "no equivalent in tuneledger; remove it"

# LLaMA-Factory keys that set a field of ours under another name.
ALIASES: dict[str, tuple[str, Callable[[Any], dict]]] = {
    "disable_gradient_checkpointing": ("gradient_checkpointing: false",
                                       lambda v: {"gradient_checkpointing": False} if v else {}),
    "neat_packing": ("packing: true (packing never lets samples attend to each other here)",
                     lambda v: {"packing": True} if v else {}),
    "evaluation_strategy": ("eval_strategy", lambda v: {"eval_strategy": v}),
}


@dataclass
class Verdict:
    status: str  # "implemented" | "ignored" | "refused"
    text: str = ""  # ignored: why; refused: what to use instead
    updates: dict = field(default_factory=dict)  # fields an alias sets


def family(key: str) -> str:
    for prefixes, instead in FAMILIES:
        if key.startswith(prefixes):
            return instead
    return DEFAULT_INSTEAD


def _same(value: Any, default: Any) -> bool:
    if default == "?":
        return value is None
    if isinstance(default, str) and "." in default and default.split(".")[0][:1].isupper():  # an enum member
        return str(value).lower() == default.split(".")[1].lower()
    return value == default or (value in (None, "", []) and default in (None, "", []))


def classify(key: str, value: Any) -> Verdict | None:
    """The verdict on a key that is not a JobConfig field, or None when LLaMA-Factory has no such key."""
    if key in ALIASES:
        return Verdict("implemented", ALIASES[key][0], ALIASES[key][1](value))
    if key in IGNORED:
        return Verdict("ignored", IGNORED[key])
    if key in ONLY:
        rule = ONLY[key]
        return Verdict("ignored", rule.why_ignored) if rule.accepted(value) else Verdict("refused", rule.instead)
    if key in REFUSED:
        return Verdict("refused", REFUSED[key])
    if key not in lf_keys():
        return None
    default = lf_keys()[key]["default"]
    if _same(value, default):
        return Verdict("ignored", f"left at LLaMA-Factory's default ({default!r}): changes nothing")
    return Verdict("refused", family(key))
