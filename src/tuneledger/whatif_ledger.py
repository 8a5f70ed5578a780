"""The fields of a dry-run ledger (dryrun.json) that `tuneledger whatif` reads, and their types:
checked once, as the ledger is loaded, so that a damaged or hand-edited ledger gets one line naming
the file, the row and the field instead of a traceback from deep inside the cost model.

A dry-run writes every field below; numbers it did not measure it writes as null, and those are
Optional here. Other fields are left alone (extra="allow"). Strict: "1.2" is not a number, 0 is not
a bool.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
AtLeast0 = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=1)]


class _Part(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class Split(_Part):
    micro_batches_per_step: Count
    allreduce_s: Optional[AtLeast0] = None
    sync_wait_s: Optional[AtLeast0] = None
    optimizer_s: Optional[AtLeast0] = None
    data_wait_s: Optional[AtLeast0] = None


class ModelSize(_Part):
    matmul_params: Positive
    trainable_params: Positive
    total_params: Positive


class Memory(_Part):
    peak_allocated: AtLeast0  # MiB


class RunConfig(_Part):
    global_batch_size: Count
    save_steps: Optional[Annotated[int, Field(ge=0)]] = None


class GpuWindow(_Part):
    util_mean_pct: Optional[Annotated[float, Field(ge=0, le=100, allow_inf_nan=False)]] = None


class Row(_Part):
    preset: str
    micro_batch: Count
    gradient_checkpointing: bool
    packing: bool
    s_per_step: Positive
    tokens_per_step: Positive
    split: Split
    memory_mib: Annotated[list[Memory], Field(min_length=1)]
    model: ModelSize
    config: RunConfig
    peak_tflops_measured: Optional[Positive] = None
    gpu_window: Optional[GpuWindow] = None
    diagnosis: Optional[dict] = None
    eta: Optional[dict] = None
    save_s: Optional[AtLeast0] = None


class Length(_Part):
    median: AtLeast0  # tokens
    p95: AtLeast0


class Stats(_Part):
    length: Length
    tokens_per_step: Optional[Positive] = None


class Ledger(_Part):
    presets: list[Row]
    gpu: str
    world_size: Count = 1
    date: Optional[str] = None
    stats: Stats


def check(led: dict, path: Path | str) -> None:
    """Raise ValueError naming `path`, the row (presets[i], preset X) and the field for the first
    field that whatif reads and that is missing or of the wrong type or range."""
    try:
        Ledger.model_validate(led)
    except ValidationError as e:
        err = e.errors()[0]
        loc = list(err["loc"])
        where = ""
        if loc[:1] == ["presets"] and len(loc) > 1 and isinstance(loc[1], int):
            i = loc[1]
            row = led["presets"][i]
            where = f"presets[{i}] (preset {row.get('preset', '?') if isinstance(row, dict) else '?'}) "
            loc = loc[2:]
        field = ".".join(str(x) if not isinstance(x, int) else f"[{x}]" for x in loc).replace(".[", "[") or "the row"
        if err["type"] == "missing":
            raise ValueError(f"{path}: {where}{field}: missing (a dry-run's dryrun.json has it: was the ledger "
                             "cut short or edited?)") from None
        msg = err["msg"][0].lower() + err["msg"][1:]
        raise ValueError(f"{path}: {where}{field}: {err.get('input')!r}: {msg} (not what a dry-run writes: was the "
                         "ledger edited?)") from None
