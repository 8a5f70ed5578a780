"""`tuneledger chat RUN|CONFIG.yaml`: talk to a trained run in the terminal.

    tuneledger chat RUN                          # runs/RUN/export if there is one, else base + newest adapter
    tuneledger chat RUN --checkpoint best        # base + the checkpoint with the lowest eval loss (or N)
    tuneledger chat RUN --prompt "who are you?"  # one answer, for scripts and tests
    tuneledger chat lf_inference.yaml            # LLaMA-Factory's inference yaml: model_name_or_path + adapter_name_or_path

RUN is a run name (runs/RUN), a run folder, a checkpoint-N folder or an export folder; the first
line says what was loaded and where it came from (an export: the checkpoint, step and base its
export.json records; an adapter: its step). A config
(usecfg: a LLaMA-Factory inference yaml, or a training config naming its run) gives the adapter,
the base, max_new_tokens, do_sample/temperature and default_system; options on the command line
win. A `template:` line says which chat template renders and why (templateinfo). The
conversation is rendered with the model's own chat template and the run's default system prompt;
tokens stream as they are generated (transformers' TextStreamer) and generation stops at the
end-of-turn token (`<|im_end|>` for ChatML models) or after --max-new-tokens. Greedy by default;
--temperature > 0 samples. In the terminal: an empty line does nothing, /reset starts a new
conversation, /exit or Ctrl-D leaves.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tuneledger.checkpoints import LoadError
from tuneledger.loading import Loaded, load, stop_ids
from tuneledger.words import count_at_least


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


def sampling(use: Any, temperature: float | None) -> float:
    """The temperature to generate at: --temperature, else the config's (do_sample: false is 0,
    greedy; do_sample: true without a temperature is LLaMA-Factory's 0.95), else 0."""
    if temperature is not None:
        return temperature
    if use.get("do_sample") is False:
        return 0.0
    if use.get("temperature") is not None:
        return float(use.get("temperature"))
    return 0.95 if use.get("do_sample") else 0.0


def run(args: argparse.Namespace) -> int:
    from tuneledger.templateinfo import template_line
    from tuneledger.usecfg import resolve_use

    use = resolve_use("chat", list(args.items))
    try:
        loaded = load(use.run, args.checkpoint, args.base or use.base, args.device)
    except LoadError as e:
        print(f"tuneledger chat: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 1)
    if use.get("default_system") is not None:
        loaded.config = {**loaded.config, "default_system": use.get("default_system")}
    # What was loaded and where it came from: an export's checkpoint and step, an adapter's step.
    print(f"chat: {loaded.source}" + (f" ({loaded.provenance})" if loaded.provenance else ""), file=sys.stderr,
          flush=True)
    asked = use.get("template", loaded.config.get("template"))
    print(template_line(asked, loaded.tokenizer.chat_template, loaded.source), file=sys.stderr, flush=True)
    if getattr(loaded.model.config, "tuneledger_synthetic", None):
        print("chat: SYNTHETIC model (random weights): its answers are noise, whatever the training did",
              file=sys.stderr, flush=True)
    args.max_new_tokens = args.max_new_tokens or int(use.get("max_new_tokens", 256))
    args.temperature = sampling(use, args.temperature)
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
    p.add_argument("items", nargs="+", metavar="RUN|CONFIG.yaml [key=value ...]",
                   help="run name (runs/RUN), run, checkpoint-N or export folder; or a LLaMA-Factory inference yaml "
                   "(model_name_or_path, adapter_name_or_path, template, ...) or training config")
    p.add_argument("--checkpoint", help="N or best: base + that checkpoint's adapter (default: the export if there is one, "
                   "else the newest checkpoint)")
    p.add_argument("--base", help="the base model (default: the config's model_name_or_path, else the run's)")
    p.add_argument("--prompt", help="answer this one message and exit")
    p.add_argument("--max-new-tokens", type=count_at_least(1), help="default: the config's max_new_tokens, else 256")
    p.add_argument("--temperature", type=float, help="0: greedy (the default); > 0 samples (default: the config's "
                   "do_sample/temperature)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda when there is one)")
    p.set_defaults(func=run)
