"""The checks that run before any weights load, each failing in seconds (`tuneledger preflight`
runs them all; dryrun and train run them before anything heavy, in prepare.prepare_for_training):

- the logging backend asked for imports and writes, as the run will import it (a missing
  tensorboard crashed the field report's run only after the 7B model had loaded; one too old for
  torch.utils.tensorboard passed a bare `import tensorboard`);
- bitsandbytes' CUDA library loads when quantization is on;
- the output filesystem has room for the checkpoints to keep;
- the model's config.json is read first and is a text causal LM (a VL variant is refused before
  15 GB are downloaded);
- every lora_target name is a layer of the model (checked on an empty copy: a misspelt name
  failed inside every rank of every preset, after the weights loaded);
- use_unsloth_gc: the pinned host memory it takes fits the host's available memory;
- before all of these, in dryrun and train: the dataset files are there (check_data; a missing one
  is bad input: DataError, exit 2).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tuneledger.config import JobConfig
from tuneledger.model import PreflightError, check_remote_code, check_text_causal_lm, is_synthetic, read_model_config
from tuneledger.ledger import plural


def tensorboard_problem() -> str | None:
    """Why TensorBoard logging would not work in this environment, or None.

    Does what the run does: transformers' TensorBoardCallback imports
    `torch.utils.tensorboard.SummaryWriter` (which refuses tensorboard < 1.15, and fails on a
    protobuf it cannot use), then writes events; so this imports it and writes one scalar to a
    temporary folder. Any exception counts, not only ImportError.
    """
    import tempfile

    try:
        from torch.utils.tensorboard import SummaryWriter

        with tempfile.TemporaryDirectory() as tmp:
            writer = SummaryWriter(log_dir=tmp)
            writer.add_scalar("preflight", 1.0, 0)
            writer.close()
            if not list(Path(tmp).glob("events.out.tfevents.*")):
                return "torch.utils.tensorboard wrote no event file"
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def check_logging(cfg: JobConfig) -> str:
    if cfg.report_to == "tensorboard":
        problem = tensorboard_problem()
        if problem:
            raise PreflightError(f"report_to=tensorboard but TensorBoard logging does not work here ({problem}). Fix: "
                                 "pip install tensorboard (requirements.txt pins one that works with this torch), or set "
                                 "report_to=none") from None
    return f"logging: {cfg.report_to}"


def check_bitsandbytes(cfg: JobConfig, cuda: bool) -> str:
    if not cfg.quantization_bit:
        return "quantization: off (LoRA on the unquantized base)"
    if not cuda:
        raise PreflightError("quantization_bit=4 needs a CUDA GPU; none is visible. On a CPU set quantization_bit=null")
    try:
        import bitsandbytes as bnb
        from bitsandbytes.cextension import CudaBNBNativeLibrary, lib
    except Exception as e:
        raise PreflightError(f"bitsandbytes does not import ({type(e).__name__}: {e}). Fix: pip install "
                             "bitsandbytes==0.50.2 (requirements.txt), matching your CUDA") from None
    if not isinstance(lib, CudaBNBNativeLibrary):
        raise PreflightError("bitsandbytes loaded without its CUDA library. Fix: reinstall bitsandbytes for this "
                             "CUDA, or run `python -m bitsandbytes` to see what it looked for")
    return f"quantization: bitsandbytes {bnb.__version__} CUDA library loaded"


def checkpoint_bytes(cfg: JobConfig, config: dict) -> int:
    """Upper estimate of one checkpoint: LoRA weights in fp32 plus AdamW's two moments (12 B/param)."""
    h, n_layers = config.get("hidden_size", 0), config.get("num_hidden_layers", 0)
    inter = config.get("intermediate_size", 0)
    kv = h // max(1, config.get("num_attention_heads", 1)) * config.get("num_key_value_heads", config.get("num_attention_heads", 1))
    # q, k, v, o, gate, up, down: r * (in + out) each
    per_layer = cfg.lora_rank * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + inter) + (inter + h))
    return per_layer * n_layers * 12


def tokenizer_bytes(model: str) -> int:
    """Bytes the tokenizer takes in every checkpoint, from a real save_pretrained into a temporary
    folder (the Trainer saves it as a fast tokenizer: Qwen2.5's tokenizer.json alone is 11 MB)."""
    import tempfile

    from tuneledger.tokenizer_load import load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        load_tokenizer(model).save_pretrained(tmp)
        return sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file())


SMALL_FILES = 2**20  # trainer_state, scheduler, RNG states, README, configs: well under 1 MiB together


def checkpoint_estimate(cfg: JobConfig, config: dict) -> tuple[int, str]:
    """(bytes of one checkpoint, where the figure comes from). A sealed checkpoint of this run is a
    real save and is used as is; otherwise LoRA weights + AdamW moments (checkpoint_bytes) plus a
    real save of the tokenizer plus the small files."""
    from tuneledger.checkpoints import scan, size_of

    good, _ = scan(cfg.out_dir) if cfg.out_dir.is_dir() else (None, [])
    if good:
        return size_of(good), f"measured on {good.name}"
    return checkpoint_bytes(cfg, config) + tokenizer_bytes(cfg.model_name_or_path) + SMALL_FILES, \
        "LoRA weights + AdamW state + a real save of the tokenizer"


def check_disk(cfg: JobConfig, config: dict, dryrun: bool = False) -> str:
    """Room for save_total_limit + 1 checkpoints (the new one is written before the oldest is
    rotated out), less those the run already holds; a dry-run (`dryrun`) saves one per preset and
    copies its adapter, to time both, and deletes them before the next preset: room for two.
    Raises PreflightError naming both figures."""
    one, basis = checkpoint_estimate(cfg, config)
    keep = cfg.save_total_limit or 10
    have = len([p for p in cfg.out_dir.glob("checkpoint-*") if p.is_dir()]) if cfg.out_dir.is_dir() else 0
    count = 2 if dryrun else max(1, keep + 1 - have)
    need = int(one * count * 1.1)
    out = cfg.out_dir
    probe = next((p for p in [out, *out.parents] if p.exists()), Path("."))
    free = shutil.disk_usage(probe).free
    why = ("the dry-run's timed save and its timed copy of the final adapter" if dryrun else
           f"save_total_limit {keep} + 1 written before rotation{f', less {have} already here' if have else ''}")
    if free < need:
        raise PreflightError(f"{probe} has {free:,} bytes free; {plural(count, 'more checkpoint')} of {one:,} bytes ({basis}; "
                             f"{why}) need {need:,} with 10% margin. Free space"
                             + ("" if dryrun else ", lower save_total_limit,") + " or set output_dir elsewhere")
    # room for the most checkpoints the folder holds at once, not the run's count of saves (the ledger's)
    # A nearly full disk in MB: "0.0 GB free" read as none at all.
    free_text = f"{free / 1e9:.1f} GB" if free >= 1e9 else f"{free / 1e6:.0f} MB"
    return (f"disk: {free_text} free at {probe}; room for {plural(count, 'checkpoint')} at once ({why}) of "
            f"{one / 1e6:.1f} MB ({basis}) needs ~{need / 1e9:.2g} GB")


def check_data(cfg: JobConfig) -> None:
    """Every `dataset` (and `eval_dataset`) entry names a file that is there, directly or through
    dataset_info.json: dryrun and train call it first, so a misspelt file is said in a second, not
    after torch and the preflight checks (12.7 s on a loaded 2-core machine). Raises data.DataError,
    as reading the data would (a hub dataset is downloaded here, as reading it would)."""
    from tuneledger.data import DataError
    from tuneledger.dataset_info import resolve_sources

    resolve_sources(cfg.dataset, cfg.dataset_dir, cfg.cache_dir)
    if cfg.eval_dataset and cfg.eval_strategy != "no":
        try:
            resolve_sources(cfg.eval_dataset, cfg.dataset_dir, cfg.cache_dir)
        except DataError as e:
            raise DataError(f"eval_dataset: {e}") from None


def run_checks(cfg: JobConfig, cuda: bool | None = None, dryrun: bool = False, ranks_here: int | None = None,
               jobs: list[JobConfig] | None = None) -> list[str]:
    """Run every check; return one line per check (`dryrun`: the disk check counts its one timed
    save; `ranks_here`: the ranks this host starts, nproc; None: one per visible GPU; `jobs`: the
    configs that will run, a dry-run's resolved presets, for the checks that depend on a preset's
    own settings (host memory); None: `cfg` alone; []: none here, each run checks itself, as tune's
    candidates do). Raises PreflightError on the first failure."""
    config = read_model_config(cfg.model_name_or_path)  # first: a missing model is said before torch loads
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    check_text_causal_lm(config, cfg.model_name_or_path)
    arch = ", ".join(config.get("architectures") or [config.get("model_type", "?")])
    lines = [f"model: {cfg.model_name_or_path} ({arch}){' SYNTHETIC (random weights)' if is_synthetic(config) else ''}"]
    lines += [check_remote_code(config, cfg.model_name_or_path, cfg.trust_remote_code),
              check_logging(cfg), check_bitsandbytes(cfg, cuda), check_levers(cfg, cuda), check_sharding(cfg),
              check_lora_target(cfg), check_disk(cfg, config, dryrun)]
    return lines + [line for job in (jobs if jobs is not None else [cfg])
                    if (line := check_host_memory(job, config, cuda, ranks_here, named=jobs is not None and len(jobs) > 1))]


def mem_available() -> int:
    """The host memory available to new processes without swapping, in bytes (psutil; Linux's MemAvailable)."""
    import psutil

    return psutil.virtual_memory().available


def check_host_memory(cfg: JobConfig, config: dict, cuda: bool, ranks_here: int | None = None,
                      named: bool = False) -> str | None:
    """use_unsloth_gc pins each rank's checkpointed layer inputs and the final norm's input in host
    memory: about (layers + 1) x micro-batch x cutoff_len x hidden values a rank (bf16: 2 bytes,
    else 4), each block rounded up to a power of two as torch's pinned-memory cache allocates it
    (it keeps freed blocks per power of two: rows of many lengths can leave up to twice that pinned),
    x the ranks this host starts (`ranks_here`, nproc; None: its visible GPUs). `named`: the line
    and error name cfg's preset (a dry-run of several). Raises PreflightError above 80% of the
    available host memory (the pinning would fail mid-run, or the host swap); None when the lever
    has nothing to do here."""
    if not (cfg.use_unsloth_gc and cfg.gradient_checkpointing and cuda):  # (fsdp with it is refused as the config loads)
        return None
    import torch

    from tuneledger.offload import MIN_BYTES

    what = f"host memory{f' (preset {cfg.preset})' if named and cfg.preset else ''}:"
    layers, hidden = config.get("num_hidden_layers"), config.get("hidden_size")
    if not (layers and hidden):
        return (f"{what} use_unsloth_gc's pinned memory not estimated (config.json gives no "
                "num_hidden_layers and hidden_size); the ledger's use_unsloth_gc line says what a micro-batch moved")
    one = cfg.per_device_train_batch_size * cfg.cutoff_len * int(hidden) * (2 if cfg.bf16 else 4)
    if one < MIN_BYTES:
        return f"{what} use_unsloth_gc moves nothing here (each layer input, {one / 2**20:.2f} MiB, is under 1 MiB)"
    per_rank = (int(layers) + 1) * (1 << (one - 1).bit_length())
    ranks = max(1, ranks_here or torch.cuda.device_count())
    free = mem_available()
    said = (f"{what} use_unsloth_gc pins about {per_rank / 1e9:,.1f} GB a rank ((layers + 1) x micro-batch x "
            f"cutoff_len x hidden, {'bf16' if cfg.bf16 else 'fp32'}, in power-of-two blocks), "
            f"{ranks * per_rank / 1e9:,.1f} GB for {plural(ranks, 'rank')} on this host (up to twice that over rows of "
            "many lengths: torch's pinned cache keeps blocks of each power of two it was asked for)")
    if ranks * per_rank > 0.8 * free:
        raise PreflightError(f"{said}, over 80% of the {free / 1e9:.1f} GB the host has available: set use_unsloth_gc=false, "
                             "a smaller per_device_train_batch_size or cutoff_len, or free host memory"
                             + ("; or dry-run the other presets (--preset)" if named else ""))
    return f"{said} of {free / 1e9:.1f} GB available"


# The layer types peft's LoRA wraps (Conv1D: GPT-2's linear layers).
LORA_LAYER_TYPES = ("Linear", "Embedding", "Conv1d", "Conv2d", "Conv3d", "Conv1D")


def check_lora_target(cfg: JobConfig) -> str:
    """Every name in lora_target (comma-separated) names a layer LoRA can wrap, as peft matches a
    name: a module whose full name is it or ends in "." + it. Checked on the model built from its
    config.json on the meta device (no weights, about a second for a 7B). Raises PreflightError
    listing the model's layer names."""
    if cfg.lora_target == "all":
        return "lora_target: all linear layers"
    wanted = [t.strip() for t in cfg.lora_target.split(",") if t.strip()]
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(cfg.model_name_or_path, trust_remote_code=cfg.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.trust_remote_code)
    names = [n for n, m in model.named_modules() if n and type(m).__name__ in LORA_LAYER_TYPES]
    missing = [t for t in wanted if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        short = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise PreflightError(f"lora_target: {', '.join(missing)}: no such layer in {cfg.model_name_or_path} "
                             f"({type(model).__name__}); its layers LoRA can wrap: {', '.join(short)}, or lora_target: all")
    return f"lora_target: {', '.join(wanted)} ({plural(len([n for n in names if any(n == t or n.endswith('.' + t) for t in wanted)]), 'layer')})"


def check_sharding(cfg: JobConfig) -> str:
    """Preset F (fsdp) can run with this torch and these levers (sharding.py). Raises PreflightError."""
    if not cfg.sharded:
        return "parallelism: DDP (one whole copy of the model per rank)"
    from tuneledger import sharding

    try:
        sharding.check_torch()
        sharding.lever_settings(cfg)
    except ValueError as e:
        raise PreflightError(str(e)) from None
    import torch

    return f"parallelism: FSDP2 (fsdp: {cfg.fsdp}), torch {torch.__version__}: the model sharded over the ranks"


def check_levers(cfg: JobConfig, cuda: bool) -> str:
    """The speed levers the config asks for can run here (speed.check_levers). Raises PreflightError."""
    from tuneledger import speed

    try:
        return f"attention: {speed.check_levers(cfg, 'cuda' if cuda else 'cpu')}"
    except ValueError as e:
        raise PreflightError(str(e)) from None
