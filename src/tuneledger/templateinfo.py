"""Which chat template renders, and why: the `template:` line at the start of stats, dryrun, train,
export, chat and eval.

tuneledger always renders with the tokenizer's own chat template (tokens.py). LLaMA-Factory's
`template` key names a format instead; here it is checked against the tokenizer's template:

  ChatML names (qwen, qwen3, chatml, ...)    the tokenizer's template must be ChatML; data
                                              preparation refuses otherwise (data.prepare)
  other names whose format is known           matched against the tokenizer's template's markers;
  (llama3, mistral, gemma, ...)               a different format gets a WARNING line: the records
                                              render as the tokenizer's format, not the asked one
  tokenizer                                   the tokenizer's template, as asked
  any other name (default, alpaca, ...)       a NOTE: that format is not checked; the tokenizer's renders

A warning rather than a refusal: a LLaMA-Factory example (template: llama3) then runs unchanged on
another model, rendered the way that model was trained to read, and the line says so.
"""

from __future__ import annotations

import json
from pathlib import Path

from tuneledger.data import CHATML_TEMPLATES

# Format -> a marker its chat template always writes.
MARKERS = {"ChatML": "<|im_start|>", "Llama 3": "<|start_header_id|>", "Llama 4": "<|header_start|>",
           "Mistral/Llama 2 [INST]": "[INST]", "Gemma": "<start_of_turn>", "DeepSeek": "<｜User｜>",
           "Phi-3/Zephyr/GLM <|user|>": "<|user|>"}
# LLaMA-Factory template names of a known format.
NAMES = {**{n: "ChatML" for n in CHATML_TEMPLATES}, "phi4": "ChatML", "llama3": "Llama 3", "llama4": "Llama 4",
         "mistral": "Mistral/Llama 2 [INST]", "llama2": "Mistral/Llama 2 [INST]", "gemma": "Gemma", "gemma2": "Gemma",
         "gemma3": "Gemma", "deepseek3": "DeepSeek", "deepseekr1": "DeepSeek", "phi": "Phi-3/Zephyr/GLM <|user|>",
         "zephyr": "Phi-3/Zephyr/GLM <|user|>", "glm4": "Phi-3/Zephyr/GLM <|user|>"}


def template_format(chat_template: str | None) -> str | None:
    """The format of a chat template, by its markers (first match), or None when unrecognised."""
    for name, marker in MARKERS.items():
        if marker in (chat_template or ""):
            return name
    return None


def local_chat_template(model: str) -> str | None:
    """The chat template of a local model folder, read from its files (no transformers import):
    chat_template.jinja, else tokenizer_config.json's chat_template; None when not found."""
    d = Path(model)
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text(encoding="utf-8")
    try:
        t = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError):
        return None
    if isinstance(t, list):  # named templates: the default one
        t = next((x.get("template") for x in t if x.get("name") == "default"), None)
    return t if isinstance(t, str) else None


def template_line(asked: str | None, chat_template: str | None, model: str) -> str:
    """One line: the template asked for, the format that renders (the tokenizer's of `model`), and
    why; it starts with WARNING when the asked format is known to differ."""
    fmt = template_format(chat_template) or "a format tuneledger does not recognise"
    own = f"the tokenizer's own chat template of {model} ({fmt})"
    if asked in (None, "tokenizer"):
        return f"template: {own} renders every record, as asked (template: tokenizer)"
    want = NAMES.get(asked)
    if want is None:
        return (f"template: NOTE {asked!r} is not a format tuneledger checks; {own} renders, as it always does here "
                "(template: tokenizer says so and silences this note)")
    if want == template_format(chat_template):
        return f"template: {asked} = {want}, {own}: it renders every record, as LLaMA-Factory's {asked} would"
    if want == "ChatML":
        return (f"template: {asked} asks for ChatML and {own} is not: data preparation refuses it; set "
                "template: tokenizer to render with the tokenizer's template as it is")
    return (f"template: WARNING {asked} asks for {want}, but {own} is what renders: tuneledger always renders with the "
            f"tokenizer's template (LLaMA-Factory would render {want}, which this model's tokenizer does not write). "
            "Set template: tokenizer (or the name of its format) if that is what you want, else use a model of "
            f"the {want} format")
