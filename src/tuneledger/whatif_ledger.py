"""The fields of a dry-run ledger (dryrun.json) that `tuneledger whatif` reads, and their types:
checked once, as the ledger is loaded, so that a damaged or hand-edited ledger gets one line naming
the file, the row and the field instead of a traceback from deep inside the cost model.

A dry-run writes every field below; numbers it did not measure it writes as null, and those are
Optional here. Other fields are left alone (extra="allow"). Strict: "1.2" is not a number, 0 is not
a bool.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tuneledger.diagnose import BOTTLENECKS

Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
AtLeast0 = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=1)]
MAX_WORLD = 4096  # ranks: beyond any box or cluster a ledger comes from (a million allocated 119 GiB)
MAX_MIB = 10_000_000  # MiB per GPU: 10 TB, beyond any card


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
    levers: Optional[dict] = None  # what ran (speed.py): read for absmax_once


class Memory(_Part):
    peak_allocated: Annotated[float, Field(ge=0, le=MAX_MIB, allow_inf_nan=False)]  # MiB


class RunConfig(_Part):
    global_batch_size: Count
    save_steps: Optional[Annotated[int, Field(ge=0)]] = None


class GpuWindow(_Part):
    util_mean_pct: Optional[Annotated[float, Field(ge=0, le=100, allow_inf_nan=False)]] = None


class Eta(_Part):
    parts: Optional[dict[str, Optional[AtLeast0]]] = None  # the start-up parts and finish_s, s
    total_steps: Optional[Annotated[int, Field(ge=0)]] = None
    save_s: Optional[AtLeast0] = None


class Diagnosis(_Part):
    bottleneck: Optional[Literal[BOTTLENECKS]] = None  # type: ignore[valid-type]


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
    diagnosis: Optional[Diagnosis] = None
    eta: Optional[Eta] = None
    save_s: Optional[AtLeast0] = None
    tokens_per_s: Optional[Positive] = None  # --against needs it (whatif.load_against)

    @model_validator(mode="after")
    def _consistent(self):
        if self.model.trainable_params > self.model.total_params:
            raise ValueError(f"model.trainable_params {self.model.trainable_params:g} is more than model.total_params "
                             f"{self.model.total_params:g}")
        over = sum(v or 0.0 for v in (self.split.allreduce_s, self.split.sync_wait_s, self.split.optimizer_s,
                                      self.split.data_wait_s))
        if over > self.s_per_step * 1.001:
            raise ValueError(f"split's all-reduce, sync wait, optimizer and data wait ({over:g} s) are more than "
                             f"s_per_step ({self.s_per_step:g} s)")
        return self


class Length(_Part):
    median: AtLeast0  # tokens
    p95: AtLeast0
    mean: Optional[AtLeast0] = None


class Stats(_Part):
    length: Length
    tokens_per_step: Optional[Positive] = None


class Ledger(_Part):
    presets: list[Row]
    gpu: str
    world_size: Annotated[int, Field(ge=1, le=MAX_WORLD)] = 1
    date: str = "?"
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
        if err["type"] == "value_error":  # a check across fields (Row._consistent): its own sentence
            raise ValueError(f"{path}: {where}{err['msg'].removeprefix('Value error, ')} (not what a dry-run "
                             "writes: was the ledger edited?)") from None
        msg = err["msg"][0].lower() + err["msg"][1:]
        raise ValueError(f"{path}: {where}{field}: {err.get('input')!r}: {msg} (not what a dry-run writes: was the "
                         "ledger edited?)") from None
