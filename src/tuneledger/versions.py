"""Version tests shared by modules that must not import each other (compiled imports nf4_kernel)."""

from __future__ import annotations


def major_minor(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: "2.11.0+cu130" -> (2, 11)."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def torch_at_least(version: tuple[int, int]) -> bool:
    """Whether this process's torch is `version` (major, minor) or newer."""
    import torch

    return major_minor(torch.__version__) >= version
