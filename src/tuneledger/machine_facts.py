"""What a run ran on, for its ledger: package versions and the GPUs' link (NVLink, PCIe)."""

from __future__ import annotations

import platform
import subprocess


def versions(cpu: bool = False) -> dict:
    """Versions of what the run used. A CPU run used no CUDA, whatever torch was built for: no "cuda"."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "datasets", "flash-attn", "tuneledger"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    if not cpu:
        import torch

        out["cuda"] = torch.version.cuda
    return out


def topology() -> dict:
    """`nvidia-smi topo -m` and the link it shows between GPUs: NVLink, PCIe, or n/a."""
    try:
        text = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {"link": "n/a (no nvidia-smi)", "matrix": ""}
    rows = [line.split() for line in text.splitlines() if line.startswith("GPU")]
    cells = {c for row in rows for c in row[1:len(rows) + 1] if c != "X"}
    if any(c.startswith("NV") for c in cells):
        link = "NVLink (" + ", ".join(sorted(c for c in cells if c.startswith("NV"))) + ")"
    elif cells:
        link = "PCIe (" + ", ".join(sorted(cells)) + "; no NVLink)"
    else:
        link = "single GPU"
    return {"link": link, "matrix": text}
