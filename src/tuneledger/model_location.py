"""Where a model is: a local folder or a hub id, and whether the hub can be reached. The one check
every verb makes before it reads a config, a tokenizer or weights, and the error every check
before the weights raises (PreflightError). Below both the model loading (model.py) and the
tokenizer loading (tokenizer_load.py), which import it.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path


class PreflightError(RuntimeError):
    """A check that runs before weights load failed. The message says what to fix. The verbs exit
    with `exit_code`: 1, a check of the machine or the model failed (docs/runs-and-output.md)."""

    exit_code = 1


class ModelNotFound(PreflightError):
    """The model named on the command line or in the config is not there: bad input, exit 2, as a
    dataset file that is not there."""

    exit_code = 2


def hub_offline() -> str | None:
    """Why the model hub cannot be reached right now, or None when it may be.

    HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE say so; otherwise a TCP connection to HF_ENDPOINT's host
    (or the https proxy) must open within 1.5 s. Without this, transformers retries an unreachable
    hub for about a minute before it fails.
    """
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var}={os.environ[var]}"
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    proxy = (os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")) if endpoint.startswith("https") else None
    return _unreachable(proxy or endpoint, "proxy " if proxy else "")


@functools.lru_cache(maxsize=None)
def _unreachable(url: str, what: str) -> str | None:
    """Why a TCP connection to `url`'s host cannot open within 1.5 s, or None (once per process)."""
    import socket
    from urllib.parse import urlsplit

    target = urlsplit(url)
    try:
        port = target.port or (443 if target.scheme == "https" else 80)
        socket.create_connection((target.hostname, port), timeout=1.5).close()
    except (OSError, ValueError) as e:
        return f"{what}{url} unreachable: {getattr(e, 'strerror', None) or e}"
    return None


def looks_like_path(name: str) -> bool:
    """True when `name` is meant as a local path, never a hub id (`org/name` or `name`): it starts
    with '.', '/' or '~', has more than one '/', or its parent directory exists here."""
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name:
        return True
    return "/" in name and Path(name).parent.is_dir()


def locate_model(name: str) -> Path | None:
    """The local directory `name` (model_name_or_path) names, or None for a hub id the hub may serve.

    The one check every verb makes before it loads a config, tokenizer or weights. Raises
    PreflightError at once, saying how to get the model, when `name` is a path that is not a
    directory (see `looks_like_path`), or when it is not a local directory and the hub is offline.
    """
    local = Path(name).expanduser()
    if local.is_dir():
        return local
    if local.exists():
        raise PreflightError(f"model {name} is a file, not a model directory")
    if looks_like_path(name):
        # The hub id is not known from a folder name (its organisation is not in it): say where
        # the id goes, with a real id as the example, and never make one up.
        raise ModelNotFound(f"model {name}: no such directory (relative to {Path.cwd()}). `make fetch MODEL=<hub id>` "
                             f"downloads a model into models/<name>: `make fetch MODEL=<organisation>/{local.name}` "
                             f"makes models/{local.name} (e.g. MODEL=Qwen/Qwen2.5-7B-Instruct makes "
                             "models/Qwen2.5-7B-Instruct).")
    offline = hub_offline()
    if offline:
        raise ModelNotFound(f"model {name}: no such directory, and the hub is offline ({offline}). `make fetch "
                             f"MODEL={name}` downloads it into models/{local.name} where the hub, or a mirror set in "
                             f"HF_ENDPOINT, is reachable; then use MODEL=models/{local.name}.")
    return None

def synthetic_model(name: str) -> bool:
    """Whether model `name` (a local folder) is one of synth.py's random-weight models: its
    config.json carries the tuneledger_synthetic marker. False for a hub id or an unreadable config."""
    try:
        return "tuneledger_synthetic" in json.loads((Path(name).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return False
