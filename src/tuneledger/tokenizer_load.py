"""The model's tokenizer as the data side uses it: loaded with a pad token that is an existing
token, and with eos the token that ends an assistant turn. stats, dryrun, train and the model
loading (model.py imports it from here) all take it from here.
"""

from __future__ import annotations

import os
from typing import Any

from tuneledger.model_location import PreflightError, locate_model

_SAID: set[str] = set()


def load_tokenizer(name_or_path: str) -> Any:
    """The model's tokenizer, with a pad token that is an existing token (distinct from eos if possible).

    No token is ever added: a new `<|pad|>` gets the id len(vocab), which can lie past the
    model's embedding rows (an IndexError on the first padded batch). Without a pad token, the
    first of `<|endoftext|>`, `<|pad|>`, unk that exists becomes pad, else eos itself. Pad == eos is
    safe here: labels are built per token (padding gets -100, attention_mask 0), never derived
    from input_ids == pad, so the end-of-turn token stays supervised. Raises PreflightError if
    there is no chat template or no eos.
    """
    local = locate_model(name_or_path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(local) if local is not None else name_or_path)
    fix_end_of_turn(tok)
    if not tok.chat_template:
        raise PreflightError(f"tokenizer of {name_or_path} has no chat_template; use an -Instruct model or add one")
    if tok.eos_token is None:
        raise PreflightError(f"tokenizer of {name_or_path} has no eos_token")
    if tok.pad_token is None or tok.pad_token_id == tok.eos_token_id:
        vocab = tok.get_vocab()
        candidates = [t for t in ("<|endoftext|>", "<|pad|>", tok.unk_token) if t and t in vocab and t != tok.eos_token]
        tok.pad_token = candidates[0] if candidates else tok.eos_token
    tok.padding_side = "right"
    return tok


def fix_end_of_turn(tok: Any) -> None:
    """Make eos the token that ends an assistant turn.

    Labels supervise the end-of-turn token and generation stops at eos, so they must be the same
    token. ChatML templates (Qwen, SmolLM2, ...) end turns with `<|im_end|>`; some checkpoints ship
    another eos (SmolLM2's GGUF says `<|im_start|>`), and a model trained that way never stops.
    """
    template = tok.chat_template or ""
    if "<|im_end|>" in template and "<|im_end|>" in tok.get_vocab() and tok.eos_token != "<|im_end|>":
        line = f"tokenizer: eos {tok.eos_token!r} does not end the template's turns; using '<|im_end|>'"
        # Said once per command: a process loads the tokenizer more than once, and torchrun's ranks
        # (RANK set) load it again after the launcher has said it.
        if line not in _SAID and "RANK" not in os.environ:
            _SAID.add(line)
            print(line, flush=True)
        tok.eos_token = "<|im_end|>"
