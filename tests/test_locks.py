"""`make venv VENV_TORCH=cpu`: torch's CPU build by hash, then the lock without its CUDA wheels.

PyTorch's index is out of CI's reach, so the install itself is not run here; these tests check what
can go stale offline: the hand-kept torch line against the lock, and what the filter takes out.
"""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CUDA_WHEELS = "torch|triton|nvidia-.*-cu12|liger-kernel"  # the Makefile's VENV_CUDA_WHEELS (Liger needs triton)


def pins(text: str) -> dict[str, str]:
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", text, re.M))


def test_cpu_torch_is_the_locks_version_by_one_hash():
    lock = pins((ROOT / "requirements.txt").read_text())
    text = (ROOT / "docker" / "torch-cpu-wheel.txt").read_text()
    assert pins(text) == {"torch": lock["torch"] + "+cpu"}
    assert len(re.findall(r"--hash=sha256:[0-9a-f]{64}\b", text)) == 1
    assert f"VENV_CUDA_WHEELS := {CUDA_WHEELS}\n" in (ROOT / "Makefile").read_text()


def test_the_cpu_lock_drops_exactly_torch_triton_liger_and_the_cuda_libraries():
    lock = pins((ROOT / "requirements.txt").read_text())
    out = subprocess.run([sys.executable, str(ROOT / "docker" / "lockfilter.py"), "--drop", CUDA_WHEELS,
                          str(ROOT / "requirements.txt")], capture_output=True, text=True, check=True).stdout
    kept = pins(out)
    dropped = sorted(set(lock) - set(kept))
    assert "torch" in dropped and "triton" in dropped and "liger-kernel" in dropped
    assert all(n in ("torch", "triton", "liger-kernel") or re.fullmatch(r"nvidia-.*-cu12", n) for n in dropped), dropped
    assert len(dropped) == 3 + sum(1 for n in lock if re.fullmatch(r"nvidia-.*-cu12", n))
    assert "nvidia-ml-py" in kept  # NVML, the monitor's, is not a CUDA wheel
    assert kept == {n: v for n, v in lock.items() if n not in dropped}
    sys.path.insert(0, str(ROOT / "docker"))
    from lockfilter import blocks

    whole = dict(blocks((ROOT / "requirements.txt").read_text()))
    assert all(whole[name] == block for name, block in blocks(out))  # each kept block whole, hashes and all


def test_the_package_metadata_builds_without_a_deprecation_warning(tmp_path):
    """Issue 21 (15): `license = { text = ... }` printed setuptools' deprecation at every install
    (twice per `make test` on a fresh clone). The SPDX string needs setuptools >= 77: every lock pins one."""
    import shutil

    for lock in ("requirements.txt", "requirements-quant.txt", "docker/image-extras.txt"):
        version = pins((ROOT / lock).read_text())["setuptools"]
        assert int(version.split(".")[0]) >= 77, (lock, version)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    (tmp_path / "out").mkdir()
    p = subprocess.run([sys.executable, "-W", "default", "-c", "from setuptools import build_meta as b; "
                        "print(b.prepare_metadata_for_build_wheel('out'))"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert "Deprecat" not in p.stderr + p.stdout, p.stderr
    meta = next((tmp_path / "out").glob("*.dist-info")) / "METADATA"
    assert "License-Expression: Apache-2.0" in meta.read_text()
