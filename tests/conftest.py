"""Shared fixtures. Tests read ../shared/ in place (never copied into the repo)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TUNELEDGER_SHARED", ROOT.parent / "shared"))
QWEN_TOKENIZER = SHARED / "assets" / "qwen2.5-tokenizer"
DATA = SHARED / "data"


def shared(path: Path) -> Path:
    if not path.exists():
        pytest.fail(f"{path} is missing: these tests read the project's ../shared folder (or $TUNELEDGER_SHARED)")
    return path


@pytest.fixture(scope="session")
def qwen_tokenizer():
    from tuneledger.model import load_tokenizer

    return load_tokenizer(str(shared(QWEN_TOKENIZER)))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Qwen2 with the real Qwen2.5 tokenizer (copied from ../shared for speed)."""
    from tuneledger.synth import write_synthetic_model

    out = tmp_path_factory.mktemp("models") / "synthetic-tiny"
    write_synthetic_model("tiny", out, tokenizer=str(shared(QWEN_TOKENIZER)), device="cpu")
    return out
