"""`tuneledger chat RUN`: talk to a trained run in the terminal.

    tuneledger chat RUN                          # runs/RUN/export if there is one, else base + newest adapter
    tuneledger chat RUN --checkpoint best        # base + the checkpoint with the lowest eval loss (or N)
    tuneledger chat RUN --prompt "who are you?"  # one answer, for scripts and tests

RUN is a run name (runs/RUN), a run folder, a checkpoint-N folder or an export folder. The
conversation is rendered with the model's own chat template and the run's default system prompt;
tokens stream as they are generated (transformers' TextStreamer) and generation stops at the
end-of-turn token (`<|im_end|>` for ChatML models) or after --max-new-tokens. Greedy by default;
--temperature > 0 samples. In the terminal: an empty line does nothing, /reset starts a new
conversation, /exit or Ctrl-D leaves.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ChatError(RuntimeError):
    """The run, checkpoint or base cannot be found or loaded; the message says which and what to do."""


@dataclass
class Loaded:
    model: Any
    tokenizer: Any
    source: str  # what was loaded, for the first line printed
    config: dict  # the run's resolved config (job.json), {} when unknown
    checkpoint: Path | None  # the adapter's checkpoint, None for an export


def run_dir(run: str) -> Path:
    """A run name (runs/<run>) or a path."""
    p = Path(run)
    if p.exists():
        return p
    named = Path("runs") / run
    if named.exists():
        return named
    raise ChatError(f"no run {run!r}: neither {p} nor {named} exists")


def run_config(path: Path) -> dict:
    """The resolved config of the run `path` belongs to (its job.json), or {}."""
    for d in (path, path.parent, path.parent.parent):
        job = d / "job.json"
        if job.is_file():
            return json.loads(job.read_text()).get("config", {})
    return {}


def is_export(path: Path) -> bool:
    return (path / "config.json").is_file() and not (path / "adapter_config.json").is_file()


def pick(path: Path, checkpoint: str | None) -> tuple[str, Path]:
    """("export", dir) or ("adapter", checkpoint dir) for a run, checkpoint or export folder."""
    from tuneledger.export import ExportError, find_checkpoint

    if checkpoint is None and is_export(path):
        return "export", path
    if checkpoint is None and is_export(path / "export"):
        return "export", path / "export"
    target = path if checkpoint is None else path / f"checkpoint-{checkpoint}"
    try:
        return "adapter", find_checkpoint(target)
    except ExportError as e:
        raise ChatError(str(e)) from None


def load(run: str, checkpoint: str | None = None, base: str | None = None, device: str | None = None) -> Loaded:
    """Load a run's model for inference: its export, or its base with the LoRA adapter on top.

    The base is --base, else the run's model_name_or_path, else the adapter's own record of it.
    bf16 on CUDA, fp32 on CPU. Raises ChatError when something is missing.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from tuneledger.model import load_tokenizer

    path = run_dir(run)
    kind, where = pick(path, checkpoint)
    cfg = run_config(where)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if kind == "export":
        tok = load_tokenizer(str(where))
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype).to(device).eval()
        return Loaded(model, tok, f"export {where}", cfg, None)
    from peft import PeftModel

    base = base or cfg.get("model_name_or_path") or json.loads((where / "adapter_config.json").read_text()).get(
        "base_model_name_or_path")
    if not base or not Path(base).exists() and "/" not in base:
        raise ChatError(f"the base model of {where} is unknown or missing ({base!r}); pass --base DIR")
    try:
        tok = load_tokenizer(base)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype).to(device)
    except OSError as e:
        raise ChatError(f"cannot load the base {base}: {str(e).splitlines()[0]}; pass --base DIR") from None
    model = PeftModel.from_pretrained(model, str(where)).eval()
    return Loaded(model, tok, f"{base} + adapter {where}", cfg, where)


def stop_ids(tok: Any) -> list[int]:
    """Token ids that end an answer: eos (the end-of-turn token, see model.fix_end_of_turn) and
    `<|im_end|>` when the vocabulary has it."""
    ids = {tok.eos_token_id}
    im_end = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else None
    if im_end is not None:
        ids.add(im_end)
    return sorted(i for i in ids if i is not None)


def reply(loaded: Loaded, messages: list[dict], max_new_tokens: int = 256, temperature: float = 0.0,
          stream: bool = True) -> str:
    """Generate the assistant's answer to `messages` ([{"role", "content"}, ...]), streaming it to
    stdout when `stream`; returns its text without the end-of-turn token."""
    import torch
    from transformers import TextStreamer

    tok, model = loaded.tokenizer, loaded.model
    system = loaded.config.get("default_system")
    if system is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}] + messages
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    ids = ids.to(model.device)
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "eos_token_id": stop_ids(tok),
                              "pad_token_id": tok.pad_token_id}
    kwargs.update({"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False})
    if stream:
        kwargs["streamer"] = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def repl(loaded: Loaded, args: argparse.Namespace) -> None:
    history: list[dict] = []
    print("type a message; /reset starts over, /exit or Ctrl-D leaves", flush=True)
    while True:
        try:
            text = input("\nyou> ").strip()
        except EOFError:
            print()
            return
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            history = []
            print("(new conversation)")
            continue
        history.append({"role": "user", "content": text})
        print("assistant> ", end="", flush=True)
        history.append({"role": "assistant", "content": reply(loaded, history, args.max_new_tokens, args.temperature)})


def run(args: argparse.Namespace) -> int:
    try:
        loaded = load(args.run, args.checkpoint, args.base, args.device)
    except ChatError as e:
        print(f"tuneledger chat: {e}", file=sys.stderr)
        return 1
    print(f"chat: {loaded.source}", file=sys.stderr, flush=True)
    if getattr(loaded.model.config, "tuneledger_synthetic", None):
        print("chat: SYNTHETIC model (random weights): its answers are noise, whatever the training did",
              file=sys.stderr, flush=True)
    if args.prompt is not None:
        reply(loaded, [{"role": "user", "content": args.prompt}], args.max_new_tokens, args.temperature)
        return 0
    try:
        repl(loaded, args)
    except KeyboardInterrupt:
        print()
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("chat", help="chat with a trained run (its export, or base + adapter) in the terminal")
    p.add_argument("run", help="run name (runs/RUN), run folder, checkpoint-N folder or export folder")
    p.add_argument("--checkpoint", help="N or best: base + that checkpoint's adapter (default: the export if there is one, "
                   "else the newest checkpoint)")
    p.add_argument("--base", help="the base model (default: the run's model_name_or_path)")
    p.add_argument("--prompt", help="answer this one message and exit")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0 samples")
    p.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda when there is one)")
    p.set_defaults(func=run)
