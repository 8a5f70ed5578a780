"""The job configuration's schema: every setting of a stats / dry-run / train job (`JobConfig`),
its default and its check, the presets, and the world-size-dependent numbers (`resolve`).

Key names follow LLaMA-Factory where one exists (`model_name_or_path`, `template`, `cutoff_len`,
`per_device_train_batch_size`, `gradient_accumulation_steps`, `lora_rank`, `lora_alpha`,
`lora_dropout`, `lora_target`, `quantization_bit`, `flash_attn`, ...), so a user's existing
config reads the same here. Reading a config (the YAML file, the preset, `key=value` overrides,
LLaMA-Factory's other keys) is config_load.py. The global batch is the fixed quantity; gradient
accumulation is derived:

    gradient_accumulation_steps = global_batch_size / (per_device_train_batch_size * world_size)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


# bitsandbytes' own 4-bit matmul (peft's path) keeps the quant state on its autograd ctx; a
# compiled layer traces backward once for all layers and bakes that state in from one of them
# (on an H200 the loss drifted 2.5e-3 from eager in 10 steps: bench/results/h200-2026-12-01-levers).
COMPILE_NEEDS_FUSED = ("torch_compile: true on a 4-bit model needs the fused LoRA projection (fused_lora unset or "
                       "true): bitsandbytes' own 4-bit matmul is not safe to compile. Unset fused_lora, or set "
                       "torch_compile=false")


class ConfigError(ValueError):
    """A config file, preset or override is wrong. The message names the file/key and the fix."""


# The field report's presets (seeds/000) plus our D and F. GC = gradient checkpointing.
# D's micro-batch is the largest that fit an H200 (8); `resolve()` caps it at global / world so the
# global batch stays fixed at any world size. F is B sharded: FSDP2 over the (4-bit) base, for a
# model whose one whole copy per GPU (DDP) does not fit (docs/presets.md).
PRESETS: dict[str, dict[str, Any]] = {
    "A": {"per_device_train_batch_size": 1, "gradient_checkpointing": True, "packing": False},
    "B": {"per_device_train_batch_size": 2, "gradient_checkpointing": True, "packing": False},
    "C": {"per_device_train_batch_size": 2, "gradient_checkpointing": False, "packing": False},
    "D": {"per_device_train_batch_size": 8, "gradient_checkpointing": False, "packing": True},
    "F": {"per_device_train_batch_size": 2, "gradient_checkpointing": True, "packing": False, "fsdp": "full_shard auto_wrap"},
}
# The one-whole-copy-per-GPU presets: what `PRESET=all` measures (F joins when none of them fits).
DDP_PRESETS = ("A", "B", "C", "D")
# fsdp_config keys read (LLaMA-Factory's and transformers' names, with or without the fsdp_ prefix).
FSDP_CONFIG_KEYS = ("version", "reshard_after_forward", "cpu_ram_efficient_loading", "offload_params", "cpu_offload",
                    "activation_checkpointing", "transformer_layer_cls_to_wrap", "state_dict_type", "auto_wrap_policy")


class JobConfig(BaseModel):
    """Every setting of a stats / dry-run / train job. Units are in the field names or comments."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # -- model
    model_name_or_path: str
    # LLaMA-Factory's key. Accepted; code shipped with a model (auto_map) is refused either way (docs/security.md)
    trust_remote_code: bool = False
    # LLaMA-Factory's key ("disabled" reads as eager), plus varlen and flex. auto: packed rows get a
    # varlen kernel (flash-attn, else torch's own), else flex attention; padded rows SDPA (speed.py)
    flash_attn: Literal["auto", "sdpa", "fa2", "varlen", "flex", "eager"] = "auto"
    # -- speed levers (speed.py; None: on where it applies and is exact, the ledger says which ran)
    enable_liger_kernel: bool | None = None  # LLaMA-Factory's key: Liger's fused RMSNorm, RoPE, SwiGLU, linear+CE
    fused_lora: bool | None = None  # base projection + LoRA (and its dropout) in one autograd function
    torch_compile: bool | None = None  # regional torch.compile of the decoder layers; None: auto (compiled.compile_layers)
    # inductor's C++ wrapper for the compiled layers: less Python per kernel launch. Off by default:
    # +4.8-9.5% on host-bound C in one H200 call, but a 4x cold compile (104 s) and unmeasured on D (docs/speed.md)
    compile_cpp_wrapper: bool = False
    # The three launch levers for host-bound presets (A-C), measured together on preset C: on one
    # H100 +53% tokens/s over the defaults of then (bench/results/h100-2026-12-05-call1), and no
    # change on D (h100-2026-12-06b-call1). null: on where it applies; false: off.
    # q/k/v and gate/up LoRA projections as one fused projection each (grouped.py), their base
    # weights laid out as one tensor: fewer launches. Applies with fused_lora, lora_dropout 0 and no
    # checkpointing inside compiled layers
    grouped_lora: bool | None = None
    # double quantization's absmax dequantized once at load (nf4.py): one kernel per weight
    # dequantization instead of three, the same weights bit for bit, +332 MiB on a 7B. null: on
    # where it applies, except where nf4_kernel's nested kernel rebuilds the 8-bit scales in its
    # own launch (also one kernel, without the memory) on ungrouped projections (A, B); true forces it
    absmax_once: bool | None = None
    # LLaMA-Factory's key: Unsloth's FastLanguageModel as the model backend where Unsloth is installed
    # (optional, not in the lock or the image; unsloth_backend.py): its kernels instead of the levers above
    use_unsloth: bool = False
    # LLaMA-Factory's key: checkpointed layers' inputs kept in pinned host memory until backward, as
    # Unsloth's checkpointing does (offload.py): less GPU memory for two PCIe copies a layer (B on one
    # H200: 8.6 -> 8.2 GiB, 0.68x the tokens/s in one call; bench/results/h200-2026-12-07-call1)
    use_unsloth_gc: bool = False
    # padded micro-batches train without their attention mask (right padding makes causal attention
    # alone exact: rows.padding_mask_lever), so SDPA runs its flash kernel. null: on for right-padded rows
    drop_padding_mask: bool | None = None
    # the MLP's down_proj input silu(gate) x up remade in backward from gate and up, not kept
    # (swiglu.py): T x intermediate values per layer less memory without checkpointing. On an H100:
    # C 17.2 -> 15.2 GiB for 0.5% of the mean step, D 33.3 -> 27.7 GiB for 1.0%, the same losses
    # (bench/results/h100-2026-12-06-call1, -call2). null: on where it applies (fused LoRA, a
    # SwiGLU MLP with LoRA on down_proj, checkpointing off: with it on, the layer is remade anyway)
    swiglu_recompute: bool | None = None
    # NF4 weights dequantized by our Triton kernel (nf4_kernel.py) instead of bitsandbytes' one: the
    # same bits, fewer ms for a memory-bound copy (preset C on an H100: bitsandbytes 123 ms a step
    # against Unsloth's Triton 93). null: on where it applies (the fused projection, NF4, a CUDA GPU
    # with Triton); false: bitsandbytes' kernel
    nf4_kernel: bool | None = None
    # -- data
    # Files (.json/.jsonl) or names looked up in <dataset_dir>/dataset_info.json (LLaMA-Factory's).
    dataset: list[str]
    dataset_dir: str = "data"
    # Records are rendered with the tokenizer's own chat template. A ChatML name of LLaMA-Factory
    # ("qwen", "qwen3", "qwen3_nothink", "chatml", ...) also checks that the tokenizer's template is
    # ChatML; any other name (and "tokenizer") takes whatever template the tokenizer has.
    template: str = "qwen"
    default_system: str | None = None  # None: the template's own default system prompt
    cutoff_len: int = 2048  # tokens; longer records are truncated and counted
    max_samples: int | None = Field(None, ge=1)
    placeholders: dict[str, str] = {}  # fills {{key}} in records, e.g. identity.json's {{name}}
    max_invalid_ratio: float = Field(0.05, ge=0, le=1)  # stats/train exit non-zero above this share of bad records
    preprocessing_num_workers: int | None = None  # None: min(cpu count, 8)
    cache_dir: str = ".cache/tuneledger"
    # -- method
    quantization_bit: Literal[4] | None = None  # None: LoRA on a bf16 base, as in LLaMA-Factory; 4: QLoRA
    quantization_type: Literal["nf4", "fp4"] = "nf4"
    double_quantization: bool = True
    # LLaMA-Factory's defaults (rank 8, alpha 2 x rank, no dropout); the shipped configs set 64/128/0.05.
    lora_rank: int = 8
    lora_alpha: int | None = None  # None: 2 x lora_rank
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_target: str = "all"  # "all" = every linear projection but lm_head
    # -- batch
    preset: Literal["A", "B", "C", "D", "F"] | None = None
    # Unset with gradient_accumulation_steps set (a LLaMA-Factory config): micro-batch x accumulation
    # x world size, as LLaMA-Factory computes it. Unset with neither: 16.
    global_batch_size: int = 16
    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int | None = None  # derived from global_batch_size when that is set
    gradient_checkpointing: bool = True
    packing: bool = False
    # -- sharding (preset F): LLaMA-Factory's and transformers' keys. fsdp "full_shard auto_wrap"
    # (or true) shards the base over the ranks with FSDP2 (accelerate's plugin, torch >= 2.6); unset
    # or false: pure DDP, one whole copy per rank. fsdp_config: see FSDP_CONFIG_KEYS and docs/presets.md.
    fsdp: bool | str | None = None
    fsdp_config: dict[str, Any] | None = None
    # -- optimisation
    learning_rate: float = Field(1e-4, gt=0)
    lr_scheduler_type: str = "cosine"
    warmup_ratio: float = Field(0.03, ge=0, lt=1)
    warmup_steps: int = Field(0, ge=0)  # > 0 wins over warmup_ratio
    weight_decay: float = Field(0.0, ge=0)
    num_train_epochs: float = Field(1.0, gt=0)
    max_steps: int = -1
    max_grad_norm: float = 1.0
    optim: str = "adamw_torch_fused"
    bf16: bool = True
    seed: int = 42
    # -- output
    run_name: str = "run"
    output_dir: str | None = None  # None: runs/<run_name>
    save_steps: int = 200
    save_total_limit: int | None = 3
    logging_steps: int = 10
    plot_loss: bool = True  # <output_dir>/training_loss.png, redrawn at each checkpoint
    report_to: Literal["tensorboard", "none"] = "tensorboard"
    dataloader_num_workers: int = 2
    ddp_timeout: int = 7200  # s; large, as in the field report, so a slow save never kills a rank
    resume_from_checkpoint: Literal["auto", "never"] | str = "auto"
    resume_on_changed_data: bool = False  # true: resume although a data file's sha256 changed since the checkpoint
    # SIGTERM/SIGINT: each rank finishes its step, rank 0 saves, exit 0, all within this many seconds
    # (keep it below Kubernetes' terminationGracePeriodSeconds / Slurm's --signal lead time; docs/faults.md).
    stop_grace_period_s: float = Field(120, gt=0)
    # -- evaluation: a held-out share of `dataset` (val_size) or other datasets (eval_dataset)
    val_size: float = Field(0.0, ge=0)  # < 1: a fraction of the records; >= 1: a count; held out by seed
    eval_dataset: list[str] | None = None
    per_device_eval_batch_size: int = 8
    eval_strategy: Literal["no", "steps", "epoch"] | None = None  # None: "steps" when there is eval data
    eval_steps: int | None = None  # None: save_steps, so every checkpoint has an eval loss to pick the best by
    # -- dry-run
    dryrun_steps: int = 50
    dryrun_warmup_steps: int = Field(5, ge=0)  # optimizer steps excluded from the steady-state numbers
    memory_cap_gib: float | None = None  # cap each process's CUDA memory, e.g. 24 to prove a 4090 fit

    @field_validator("model_name_or_path")
    @classmethod
    def _expand_home(cls, v: str) -> str:
        # transformers does not expand ~; a hub id never starts with it.
        return os.path.expanduser(v) if v.startswith("~") else v

    @field_validator("run_name")
    @classmethod
    def _a_name_not_a_path(cls, v: str) -> str:
        # runs/<run_name>: a path here would land under runs/ (runs/tmp/x for /tmp/x), not where meant.
        if not v.strip() or "/" in v or v in (".", ".."):
            raise ValueError(f"{v!r} is not a folder name: a run name is one folder under runs/; give a path as "
                             "output_dir=<path> (make: RUN=<path> does that)")
        return v

    @field_validator("dataset", "eval_dataset", mode="before")
    @classmethod
    def _split_datasets(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [p.strip() for p in v.split(",") if p.strip()]
        return v

    @field_validator("flash_attn", mode="before")
    @classmethod
    def _flash_attn_disabled(cls, v: Any) -> Any:
        return "eager" if v == "disabled" else v

    @field_validator("resume_from_checkpoint", mode="before")
    @classmethod
    def _resume_null(cls, v: Any) -> Any:
        return "auto" if v is None else v

    @field_validator("val_size")
    @classmethod
    def _whole_count(cls, v: float) -> float:
        if v >= 1 and v != int(v):
            raise ValueError("a count (>= 1) must be a whole number; a fraction must be below 1")
        return v

    @field_validator(
        "cutoff_len", "global_batch_size", "per_device_train_batch_size", "lora_rank", "lora_alpha",
        "save_steps", "logging_steps", "dryrun_steps", "per_device_eval_batch_size", "eval_steps",
    )
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError("must be > 0")
        return v

    @model_validator(mode="before")
    @classmethod
    def _lora_alpha_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("lora_alpha") is None:
            rank = data.get("lora_rank", cls.model_fields["lora_rank"].default)
            data = {**data, "lora_alpha": 2 * rank if isinstance(rank, int) else None}
        return data

    @model_validator(mode="after")
    def _warmup_below_steps(self) -> "JobConfig":
        if self.dryrun_warmup_steps >= self.dryrun_steps:
            raise ValueError(f"dryrun_warmup_steps ({self.dryrun_warmup_steps}) must be below dryrun_steps "
                             f"({self.dryrun_steps}): nothing would be left to measure")
        return self

    @field_validator("fsdp", mode="before")
    @classmethod
    def _fsdp_options(cls, v: Any) -> Any:
        if isinstance(v, list):
            v = " ".join(map(str, v))
        if isinstance(v, str):
            words = v.split()
            if not words or words == ["false"]:
                return None
            bad = [w for w in words if w not in ("full_shard", "shard_grad_op", "auto_wrap", "offload", "true")]
            if bad:
                raise ValueError(f"unknown {'option' if len(bad) == 1 else 'options'} {bad}: FSDP2 takes full_shard or shard_grad_op, with auto_wrap "
                                 "and offload (LLaMA-Factory's form, e.g. \"full_shard auto_wrap\")")
            return " ".join(words)
        return v or None

    @field_validator("fsdp_config", mode="before")
    @classmethod
    def _fsdp_config_keys(cls, v: Any) -> Any:
        if v is None:
            return None
        if not isinstance(v, dict):
            raise ValueError("must be a mapping of FSDP settings (a JSON file path is not read: put the keys here)")
        out = {}
        for k, val in v.items():
            key = str(k).removeprefix("fsdp_")
            if key not in FSDP_CONFIG_KEYS and key not in ("min_num_params", "sync_module_states", "use_orig_params",
                                                              "forward_prefetch", "backward_prefetch", "limit_all_gathers"):
                raise ValueError(f"unknown key {k!r}; known: {', '.join(FSDP_CONFIG_KEYS)}")
            out[key] = val
        if str(out.get("version", 2)) != "2":
            raise ValueError(f"version {out['version']}: preset F runs FSDP2 only (FSDP1 is deprecated in transformers "
                             "and needs a GPU even to start); set fsdp_config.version: 2 or remove it")
        return out

    @property
    def sharded(self) -> bool:
        """True when the base is sharded over the ranks (fsdp set: preset F), False for pure DDP."""
        return bool(self.fsdp)

    @property
    def nf4_base(self) -> bool:
        """True when the base loads as NF4 4-bit weights (what nf4_kernel dequantizes)."""
        return self.quantization_bit == 4 and self.quantization_type == "nf4"

    @property
    def absmax_once_applies(self) -> bool:
        """True when absmax_once would change something here (see absmax_once_applies)."""
        return absmax_once_applies(self.quantization_bit, self.double_quantization, self.sharded)

    @model_validator(mode="after")
    def _levers_agree(self) -> "JobConfig":
        # Lever pairs that contradict each other whatever the machine: bad input, refused as the
        # config loads (exit 2). What depends on the machine is speed.check_levers' (preflight).
        if self.grouped_lora and self.lora_dropout:
            raise ValueError(f"grouped_lora: true needs lora_dropout 0 (it is {self.lora_dropout:g}): a group would draw "
                             "one dropout mask where peft draws one per projection. Set lora_dropout=0 or grouped_lora=false")
        if self.swiglu_recompute and self.fused_lora is False:
            raise ValueError("swiglu_recompute: true needs the fused LoRA projection, but fused_lora is false: unset "
                             "fused_lora (on where it applies) or set swiglu_recompute=false")
        if self.grouped_lora and self.fused_lora is False:
            raise ValueError("grouped_lora: true needs the fused LoRA projection, but fused_lora is false: unset "
                             "fused_lora (on where it applies) or set grouped_lora=false")
        if self.torch_compile and self.fused_lora is False and self.quantization_bit:
            raise ValueError(COMPILE_NEEDS_FUSED)
        if self.nf4_kernel and not self.nf4_base:
            raise ValueError("nf4_kernel: true needs an NF4 base (quantization_bit: 4, quantization_type: nf4), but "
                             f"quantization_bit is {'null' if self.quantization_bit is None else self.quantization_bit} and "
                             f"quantization_type {self.quantization_type}: "
                             "unset nf4_kernel (on where it applies) or set it to false")
        if self.nf4_kernel and self.fused_lora is False:
            raise ValueError("nf4_kernel: true needs the fused LoRA projection, but fused_lora is false: unset "
                             "fused_lora (on where it applies) or set nf4_kernel=false")
        if self.use_unsloth_gc and self.sharded:
            raise ValueError("use_unsloth_gc: true is not supported with fsdp (preset F) here; set use_unsloth_gc=false")
        if self.compile_cpp_wrapper and self.torch_compile is False:
            raise ValueError("compile_cpp_wrapper: true needs the compiled layers, but torch_compile is false: unset "
                             "torch_compile (on where it applies) or set compile_cpp_wrapper=false")
        return self

    @model_validator(mode="after")
    def _one_eval_source(self) -> "JobConfig":
        if self.val_size and self.eval_dataset:
            raise ValueError(f"val_size ({self.val_size}) and eval_dataset ({','.join(self.eval_dataset)}) both set: "
                             "evaluate on a held-out share of dataset (val_size) or on eval_dataset, not both")
        return self

    @property
    def out_dir(self) -> Path:
        return Path(self.output_dir or f"runs/{self.run_name}")

    @property
    def evaluates(self) -> bool:
        """True when the run has eval data (val_size or eval_dataset) and evaluation is not off."""
        return bool(self.val_size or self.eval_dataset) and self.eval_strategy != "no"

    @property
    def batch_from_accumulation(self) -> bool:
        """True for a config that gives gradient_accumulation_steps and no global_batch_size
        (LLaMA-Factory's way): its global batch is micro-batch x accumulation x world size."""
        return bool(self.gradient_accumulation_steps) and "global_batch_size" not in self.model_fields_set

    def accumulation(self, world_size: int) -> int:
        """Gradient accumulation steps for `world_size` ranks at the fixed global batch.

        Raises ConfigError when global_batch_size / (per_device_train_batch_size * world_size) is
        not a whole number, or when an explicit `gradient_accumulation_steps` disagrees.
        """
        per_step = self.per_device_train_batch_size * world_size
        if self.global_batch_size % per_step:
            raise ConfigError(
                f"global batch {self.global_batch_size} is not divisible by micro-batch "
                f"{self.per_device_train_batch_size} x world size {world_size} = {per_step}: "
                "gradient accumulation would not be a whole number. Change global_batch_size, "
                "per_device_train_batch_size or the number of GPUs."
            )
        accum = self.global_batch_size // per_step
        if self.gradient_accumulation_steps not in (None, accum):
            raise ConfigError(
                f"gradient_accumulation_steps={self.gradient_accumulation_steps} contradicts global "
                f"batch {self.global_batch_size} / (micro-batch {self.per_device_train_batch_size} x "
                f"world size {world_size}) = {accum}. Remove it: it is derived."
            )
        return accum


FIELDS = set(JobConfig.model_fields)


def d_micro_batch(wanted: int, global_batch: int, world_size: int) -> int:
    """Preset D's micro-batch: the largest up to `wanted` that the global batch per rank allows
    and divides (so the accumulation stays whole), at least 1."""
    per_rank = global_batch // world_size
    fits = [m for m in range(min(wanted, per_rank), 0, -1) if per_rank % m == 0]
    return fits[0] if fits else 1


def resolve(cfg: JobConfig, world_size: int) -> JobConfig:
    """Fix the world-size-dependent numbers: the global batch of a config that gives only the
    accumulation (LLaMA-Factory's way), preset D's micro-batch cap, and the accumulation.

    Returns a copy with `gradient_accumulation_steps` set. Raises ConfigError (see `accumulation`).
    """
    cfg = cfg.model_copy()
    if cfg.batch_from_accumulation:  # derive the global batch as LLaMA-Factory does
        cfg.global_batch_size = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world_size
    if cfg.preset == "D":
        # D is "the largest micro-batch that fits": 8 fit an H200, but never more than the global
        # batch allows, so 8 GPUs at global 16 run micro-batch 2 rather than changing the recipe;
        # and one that divides it (global 24 on 2 GPUs: 6), so accumulation stays whole.
        cfg.per_device_train_batch_size = d_micro_batch(cfg.per_device_train_batch_size, cfg.global_batch_size, world_size)
    cfg.gradient_accumulation_steps = cfg.accumulation(world_size)
    return cfg


def describe(cfg: JobConfig, world_size: int) -> str:
    """One line with the batch arithmetic, printed at the start of every run."""
    return (
        f"{'preset ' + cfg.preset if cfg.preset else 'no preset (the config as written)'}: micro-batch {cfg.per_device_train_batch_size} x world size {world_size} "
        f"x gradient accumulation {cfg.gradient_accumulation_steps} = global batch {cfg.global_batch_size}; "
        f"gradient checkpointing {'on' if cfg.gradient_checkpointing else 'off'}; "
        f"packing {'on' if cfg.packing else 'off'}; cutoff_len {cfg.cutoff_len}; "
        f"LoRA r={cfg.lora_rank} alpha={cfg.lora_alpha} dropout={cfg.lora_dropout}; "
        f"{'QLoRA 4-bit ' + cfg.quantization_type.upper() if cfg.quantization_bit else 'LoRA on an unquantized base'}"
        f"{'; FSDP2: the base sharded over ' + str(world_size) + ' rank' + ('s' if world_size != 1 else '') if cfg.sharded else ''}"
    )


def preset_overrides(cfg: JobConfig, world: int) -> dict:
    """The preset's own settings (PRESETS: micro-batch, checkpointing, packing) that key=value
    overrides changed, {key: the value run}: such a row is not the preset the name says (a `tune`
    candidate between the presets runs as one). D's micro-batch cap (d_micro_batch) is D's own."""
    own = {k: v for k, v in PRESETS.get(cfg.preset or "", {}).items() if k != "fsdp"}
    if cfg.preset == "D":
        own["per_device_train_batch_size"] = d_micro_batch(own["per_device_train_batch_size"], cfg.global_batch_size, world)
    return {k: getattr(cfg, k) for k, v in own.items() if getattr(cfg, k) != v}


# The ledger's nf4_kernel line says this where our NF4 kernel rebuilds double quantization's scales in
# its own launch (nf4_kernel.py); diagnose.py reads it: absmax_once measured slower there.
NF4_NESTED_LINE = "double quantization's scales in the same kernel"


def absmax_once_applies(quantization_bit: Any, double_quantization: Any, sharded: Any) -> bool:
    """True when absmax_once has a weight to act on: a 4-bit base with double quantization, not
    sharded (FSDP2 shards the quant states with the weights: nf4.absmax_once). One rule for
    tune's idle-lever check (on a JobConfig) and diagnose's untried levers (on a row's config)."""
    return quantization_bit == 4 and bool(double_quantization) and not sharded
