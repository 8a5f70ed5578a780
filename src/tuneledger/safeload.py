"""Load a checkpoint's optimizer, scheduler and RNG state without ever running code from it.

`torch.load(weights_only=True)` unpickles with an allow-list, but torch < 2.6 sends any zip that
looks like a TorchScript archive to `torch.jit.load`, whatever `weights_only` says, and TorchScript
runs the archive's code (CVE-2025-32434, GHSA-53q9-r3pm-6pq6). transformers 5 therefore refuses
torch.load below torch 2.6, which our pinned torch 2.5.1 is, so no run could resume.

`safe_torch_load` closes the hole itself, on every torch version:
- the file must be torch's zip format (legacy and TorchScript archives are refused before torch
  reads them), holding only what `torch.save` writes: one `data.pkl`, tensor data, version records;
- it is then read with `weights_only=True` and an allow-list of exactly the globals these files
  need beyond torch's own: numpy's array reconstruction, used by the RNG state
  (`np.random.get_state()`), as transformers allow-lists them itself from torch 2.6 on.
Anything else raises UnsafeCheckpointError, naming the file and what it holds; nothing in the
file runs. `checkpoint_loading()` routes transformers' Trainer through it while it resumes.
"""

from __future__ import annotations

import contextlib
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, Iterator

import torch

# Records torch.save writes into its zip, below the archive's top folder.
SAVE_RECORDS = re.compile(r"^[^/]+/(data\.pkl|version|\.format_version|\.storage_alignment|byteorder|"
                          r"data/\d+|\.data/[\w.]+)$")


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file holds something other than tensors and plain values; it was not loaded."""


def numpy_globals() -> list:
    """The numpy types a pickled `np.random.get_state()` (in rng_state*.pth) refers to."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def check_archive(path: str | Path) -> None:
    """Refuse anything but torch.save's zip layout (see SAVE_RECORDS). Raises UnsafeCheckpointError."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise UnsafeCheckpointError(
            f"{path}: refused: not torch's zip format (a legacy or plain pickle file can run code when loaded). "
            "tuneledger's own checkpoints are always zip; resume from another checkpoint, or "
            "resume_from_checkpoint=never to start over")
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
    odd = [n for n in names if not SAVE_RECORDS.match(n)]
    if odd or sum(n.endswith("/data.pkl") for n in names) != 1:
        what = "a TorchScript archive (its code would run on load)" if any(
            n.endswith(("constants.pkl", ".py")) or "/code/" in n for n in names) else "records torch.save does not write"
        raise UnsafeCheckpointError(f"{path}: refused: it is {what}: {', '.join(odd[:5]) or 'no single data.pkl'}. "
                                    "A checkpoint's optimizer, scheduler and RNG files hold tensors and plain values only")


def safe_torch_load(f: Any, map_location: Any = None, **kw: Any) -> Any:
    """torch.load of a checkpoint file, with the checks above; the signature of torch.load.

    Raises UnsafeCheckpointError for a file that is not torch.save's zip of allowed globals.
    """
    if not isinstance(f, (str, Path)):
        raise UnsafeCheckpointError(f"refused to load {f!r}: only checkpoint files given by path are checked")
    check_archive(f)
    # torch 2.5 cannot map to the device string "cpu:N" that multi-process CPU runs use.
    if isinstance(map_location, torch.device) and map_location.type == "cpu":
        map_location = "cpu"
    kw.pop("weights_only", None)
    try:
        with torch.serialization.safe_globals(numpy_globals()):
            return _torch_load(f, map_location=map_location, weights_only=True, **kw)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        raise UnsafeCheckpointError(f"{f}: refused: it refers to code that is not on the allow-list of tensors and "
                                    f"plain values ({next((x for x in first if 'GLOBAL' in x), first[0] if first else '')}); "
                                    "nothing from it ran") from None


_torch_load = torch.load


@contextlib.contextmanager
def checkpoint_loading() -> Iterator[None]:
    """While resuming: every torch.load in transformers' Trainer goes through safe_torch_load, and
    its blanket refusal below torch 2.6 (check_torch_load_is_safe) is lifted, since the checks
    here close the hole it guards against."""
    import transformers.trainer as hf_trainer

    saved_check, saved_load = hf_trainer.check_torch_load_is_safe, torch.load
    hf_trainer.check_torch_load_is_safe, torch.load = (lambda: None), safe_torch_load
    try:
        yield
    finally:
        hf_trainer.check_torch_load_is_safe, torch.load = saved_check, saved_load
