"""Loading a trained run's model: shared by the verbs that use one (export, chat, eval).

A run is named by a run name (runs/<run>), a run folder, a checkpoint-N folder or an export
folder; `pick` says which (checkpoints.find_checkpoint picks the adapter), `load` builds the model
for inference (the export, base + adapter, or a model folder alone). Errors are
checkpoints.LoadError, naming what is missing and what to pass instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuneledger.checkpoints import FINAL, LoadError, RunNotFound, find_checkpoint


@dataclass
class Loaded:
    model: Any
    tokenizer: Any
    source: str  # what was loaded, for the first line printed
    config: dict  # the run's resolved config (job.json), {} when unknown
    checkpoint: Path | None  # the adapter's checkpoint, None for an export or a model alone
    provenance: str = ""  # where it came from, for the first line: an export's checkpoint and step (provenance())


def run_conversations(cfg: dict, files: list[str], limit: int | None = None) -> list[list[dict]]:
    """The valid conversations ([{"role", "content"}, ...]) of `files` as a run trained on them:
    with the placeholders and default system prompt of its resolved config `cfg` (job.json's
    "config"). At most `limit`. Raises data.DataError for a file that cannot be read."""
    from tuneledger.data import read_records, to_messages

    system = cfg.get("default_system")
    out: list[list[dict]] = []
    for f in files:
        for where, obj in read_records(f):
            msgs = to_messages(obj, where, cfg.get("placeholders") or {})
            if not isinstance(msgs, list):
                continue
            if system is not None and msgs[0]["role"] != "system":
                msgs = [{"role": "system", "content": system}] + msgs
            out.append(msgs)
            if limit is not None and len(out) >= limit:
                return out
    return out


def run_dir(run: str) -> Path:
    """A run name (runs/<run>) or a path. Raises LoadError when neither exists."""
    p = Path(run)
    if p.exists():
        return p
    if len(p.parts) == 1:  # a bare name is a run under runs/; a path is only itself
        named = Path("runs") / run
        if named.exists():
            return named
        raise RunNotFound(f"no run {run!r}: neither {p} nor {named} exists")
    raise RunNotFound(f"no run at {p}: it does not exist")


def run_config(path: Path) -> dict:
    """The resolved config of the run `path` belongs to (its job.json), or {}."""
    for d in (path, path.parent, path.parent.parent):
        job = d / "job.json"
        if job.is_file():
            return json.loads(job.read_text()).get("config", {})
    return {}


def checkpoint_step(ckpt: Path) -> int | None:
    """The optimizer step a checkpoint was saved at: its trainer_state.json, else its name
    (checkpoint-N); for a run's root (the final adapter's copy) the step its FINAL file names."""
    try:
        return int(json.loads((ckpt / FINAL).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        return int(json.loads((ckpt / "trainer_state.json").read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    tail = ckpt.name.rsplit("-", 1)[-1]
    return int(tail) if ckpt.name.startswith("checkpoint-") and tail.isdigit() else None


def provenance(kind: str, where: Path) -> str:
    """What a start line says about where the model came from: for an export, the checkpoint, step
    and base its export.json records (export.py writes it); for an adapter, its step."""
    if kind == "adapter":
        step = checkpoint_step(where)
        return f"step {step}" if step is not None else ""
    try:
        led = json.loads((where / "export.json").read_text())
    except (OSError, ValueError):
        return "no export.json beside it: the run and checkpoint it was made from are not recorded"
    if not isinstance(led, dict) or not led.get("checkpoint"):
        return "its export.json names no checkpoint"
    step = led.get("step")
    if step is None:  # an export.json written before the step was recorded
        step = checkpoint_step(Path(led["checkpoint"]))
    return (f"exported from {led['checkpoint']}" + (f", step {step}" if step is not None else "")
            + (f"; base {led['base']}" if led.get("base") else ""))


def is_export(path: Path) -> bool:
    """A model folder (config.json) without an adapter: an export, or any plain model."""
    return (path / "config.json").is_file() and not (path / "adapter_config.json").is_file()


def pick(path: Path, checkpoint: str | None) -> tuple[str, Path]:
    """("export", dir) or ("adapter", checkpoint dir) for a run, checkpoint or export folder."""
    if checkpoint is None and is_export(path):
        return "export", path
    if checkpoint is None and is_export(path / "export"):
        return "export", path / "export"
    return "adapter", find_checkpoint(path if checkpoint is None else path / f"checkpoint-{checkpoint}")


def load(run: str | None, checkpoint: str | None = None, base: str | None = None, device: str | None = None) -> Loaded:
    """Load a model for inference: a run's export, or its base with the LoRA adapter on top, or
    (run None) the model folder or hub id `base` alone.

    The base is `base`, else the run's model_name_or_path, else the adapter's own record of it.
    bf16 on CUDA, fp32 on CPU. Raises LoadError when something is missing.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from tuneledger.tokenizer_load import load_tokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if run is None:
        if not base:
            raise LoadError("no model to load: give a RUN, or model_name_or_path (with adapter_name_or_path for an adapter)")
        try:
            tok = load_tokenizer(base)
            model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype).to(device).eval()
        except OSError as e:
            raise LoadError(f"cannot load the model {base}: {str(e).splitlines()[0]}") from None
        return Loaded(model, tok, f"model {base}", run_config(Path(base)) if Path(base).is_dir() else {}, None)
    path = run_dir(run)
    kind, where = pick(path, checkpoint)
    cfg = run_config(where)
    if kind == "export":
        tok = load_tokenizer(str(where))
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype).to(device).eval()
        return Loaded(model, tok, f"export {where}", cfg, None, provenance("export", where))
    from peft import PeftModel

    base = base or cfg.get("model_name_or_path") or json.loads((where / "adapter_config.json").read_text()).get(
        "base_model_name_or_path")
    if not base or not Path(base).exists() and "/" not in base:
        raise LoadError(f"the base model of {where} is unknown or missing ({base!r}); pass --base DIR "
                        "(or model_name_or_path in the config)")
    try:
        tok = load_tokenizer(base)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype).to(device)
    except OSError as e:
        raise LoadError(f"cannot load the base {base}: {str(e).splitlines()[0]}; pass --base DIR") from None
    model = PeftModel.from_pretrained(model, str(where)).eval()
    return Loaded(model, tok, f"{base} + adapter {where}", cfg, where, provenance("adapter", where))


def stop_ids(tok: Any) -> list[int]:
    """Token ids that end an answer: eos (the end-of-turn token, see model.fix_end_of_turn) and
    `<|im_end|>` when the vocabulary has it."""
    ids = {tok.eos_token_id}
    im_end = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else None
    if im_end is not None:
        ids.add(im_end)
    return sorted(i for i in ids if i is not None)
