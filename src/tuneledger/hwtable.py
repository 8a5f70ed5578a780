"""The hardware `tuneledger whatif` predicts for: one YAML per GPU kind in `hardware/`, or a user's own.

A GPU set is written `<count>x<kind>` (`8x4090-pcie`, `2xH200-sxm`; the kind is case-blind) or is a
YAML file of the same fields plus `count`. Every figure is a vendor datasheet number, or a
measurement or an assumption said as such, and each entry names the source of each figure under
`source:`. Fields and units (FIELDS): dense bf16 tensor TFLOP/s without sparsity, memory in GiB
(GPU memory is binary: a 24 GB card holds 24,564 MiB), memory bandwidth in GB/s, the link between
GPUs in GB/s per direction with the share of it a ring all-reduce reaches, the link's latency per
hop in µs, and the host's speed per kernel launch relative to the machine the ledger was measured
on (1.0: as fast).

Bad input raises WhatifError naming the file, its line and the field (the verb exits 2 on it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from tuneledger.yaml_strict import DuplicateKey, StrictLoader

HERE = Path(__file__).resolve().parent / "hardware"

# field: (unit and meaning, lower bound exclusive or None for text)
FIELDS = {
    "name": ("a short name, e.g. 4090-pcie", None),
    "gpu": ("the GPU as nvidia-smi names it", None),
    "bf16_tflops": ("dense bf16 tensor TFLOP/s, no sparsity (datasheet)", 0.0),
    "memory_gb": ("memory per GPU, GB as the datasheet says it (read as GiB)", 0.0),
    "memory_gbs": ("memory bandwidth, GB/s (datasheet)", 0.0),
    "link": ("the link between GPUs, in words", None),
    "link_gbs": ("link bandwidth between GPUs, GB/s per direction (datasheet)", 0.0),
    "allreduce_efficiency": ("share of link_gbs a ring all-reduce reaches, (0, 1]", 0.0),
    "link_latency_us": ("latency per ring hop, µs", -1e-9),
    "host_speed": ("host speed per kernel launch relative to the measured machine (1.0: as fast)", 0.0),
}
# Optional fields: (meaning, lower bound exclusive); absent is None.
OPTIONAL = {
    "bf16_tflops_measured": ("bf16 TFLOP/s a large square torch.mm reaches on this GPU, measured (public records or the "
                             "dry-run's 8192^3 probe; at most 1.25x bf16_tflops); absent: the datasheet peaks' ratio", 0.0),
}
# What a GPU, its link and its host can be (inclusive): a figure outside is a typo (1e-300 GB/s
# gave a 300-digit ETA), refused with the range.
PLAUSIBLE = {"bf16_tflops": (1, 100_000), "bf16_tflops_measured": (1, 100_000), "memory_gb": (0, 100_000),
             "memory_gbs": (1, 1_000_000), "link_gbs": (0.01, 100_000), "link_latency_us": (0, 1_000_000),
             "host_speed": (0.01, 100), "allreduce_efficiency": (0.01, 1)}
YAML_FORM = """\
  name: my-gpu            # a short name
  gpu: NVIDIA L40S        # as nvidia-smi names it
  count: 4                # GPUs in the box
  bf16_tflops: 362        # dense bf16 tensor TFLOP/s, no sparsity (datasheet)
  memory_gb: 48           # memory per GPU
  memory_gbs: 864         # memory bandwidth, GB/s
  link: PCIe 4.0 x16      # between the GPUs, in words
  link_gbs: 31.5          # GB/s per direction
  allreduce_efficiency: 0.5   # share of link_gbs a ring all-reduce reaches
  link_latency_us: 20     # per hop
  host_speed: 1.0         # per-launch host speed vs the machine the ledger measured
  bf16_tflops_measured: 330   # optional: a measured bf16 matmul rate (else datasheet x the ledger GPU's share)
  source: {bf16_tflops: "datasheet ...", ...}   # where each figure comes from"""


class WhatifError(ValueError):
    """Bad input to whatif: the message names the file, line and field, and the fix."""


@dataclass(frozen=True)
class Hardware:
    """One GPU kind and its link; see FIELDS for units. `where` is the file it was read from."""

    name: str
    gpu: str
    bf16_tflops: float
    memory_gb: float
    memory_gbs: float
    link: str
    link_gbs: float
    allreduce_efficiency: float
    link_latency_us: float
    host_speed: float
    bf16_tflops_measured: float | None = None
    match: tuple[str, ...] = ()
    source: dict = field(default_factory=dict)
    where: str = ""

    @property
    def usable_gib(self) -> float:
        """What the allocator may use: the card less 1 GiB for the CUDA context, cuBLAS workspace
        and NCCL buffers (the dry-run's 24 GB rule, ledger.CAP_24GB_GIB = 23 of 24)."""
        return self.memory_gb - 1.0


def _lines(text: str) -> dict[str, int]:
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return {}
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {k.value: k.start_mark.line + 1 for k, _ in node.value if isinstance(k, yaml.ScalarNode)}


def from_yaml(path: Path, need_count: bool = False) -> tuple[Hardware, int | None]:
    """A Hardware entry (and its `count`, None when absent) from a YAML file. Raises WhatifError
    naming path:line and the field for a missing, unknown or out-of-range field."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise WhatifError(f"{path}: cannot read the hardware file ({e.strerror or e})") from None
    except UnicodeDecodeError as e:  # UTF-16 (a Windows editor's "Unicode"), or not text at all
        raise WhatifError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); save the hardware file as UTF-8") from None
    try:
        data = yaml.load(text, Loader=StrictLoader)
    except DuplicateKey as e:
        raise WhatifError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"{path}:{mark.line + 1}" if mark else str(path)
        raise WhatifError(f"{at}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise WhatifError(f"{path}: a hardware file is a mapping of fields; the form is:\n{YAML_FORM}")
    lines = _lines(text)
    at = lambda k: f"{path}:{lines[k]}" if k in lines else str(path)  # noqa: E731
    known = set(FIELDS) | set(OPTIONAL) | {"count", "match", "source"}
    for k in data:
        if k not in known:
            raise WhatifError(f"{at(k)}: unknown field {k!r}; the fields are {', '.join(sorted(known))}")
    values = {}
    for k, (meaning, low) in (FIELDS | OPTIONAL).items():
        if k in OPTIONAL and data.get(k) is None:
            continue
        if k not in data or data[k] is None:
            raise WhatifError(f"{path}: missing field {k} ({meaning}); the form is:\n{YAML_FORM}")
        v = data[k]
        if low is not None:
            if isinstance(v, str):  # YAML 1.1 reads 1e9 (no dot) as text; it is a number all the same
                try:
                    v = float(v)
                except ValueError:
                    pass
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= low or (
                    k == "allreduce_efficiency" and v > 1):
                bound = "(0, 1]" if k == "allreduce_efficiency" else f"above {low:g}" if low >= 0 else ">= 0"
                raise WhatifError(f"{at(k)}: {k}: {data[k]!r} is not a finite number {bound} ({meaning})")
            v = float(v)
            lo, hi = PLAUSIBLE.get(k, (-math.inf, math.inf))
            if not lo <= v <= hi:
                raise WhatifError(f"{at(k)}: {k}: {data[k]!r} is outside what hardware has ({lo:g} to {hi:g}; "
                                  f"{meaning}): a typo?")
        elif not isinstance(v, (str, int, float)) or isinstance(v, bool) or not str(v).strip():
            raise WhatifError(f"{at(k)}: {k}: {data[k]!r} is not a name ({meaning})")
        values[k] = str(v) if low is None else v
    measured = values.get("bf16_tflops_measured")
    if measured and measured > 1.25 * values["bf16_tflops"]:  # a GeForce card's boost reaches ~1.05x
        raise WhatifError(f"{at('bf16_tflops_measured')}: bf16_tflops_measured: {data['bf16_tflops_measured']!r} is over "
                          f"1.25x bf16_tflops ({values['bf16_tflops']:g}): a sparsity or fp8 figure, or a typo?")
    if values["memory_gb"] <= 1.0:
        raise WhatifError(f"{at('memory_gb')}: memory_gb: {data['memory_gb']!r} leaves no memory for a job: 1 GiB of a "
                          "card is kept for CUDA's context (usable = memory_gb - 1)")
    count = data.get("count")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise WhatifError(f"{at('count')}: count: {count!r} is not a whole number of GPUs >= 1")
    if need_count and count is None:
        raise WhatifError(f"{path}: missing field count (how many GPUs the box has); the form is:\n{YAML_FORM}")
    source = data.get("source") or {}
    if not isinstance(source, dict):
        raise WhatifError(f"{at('source')}: source: a mapping of field -> where the figure comes from")
    match = data.get("match") or [values["gpu"]]
    if isinstance(match, str):
        match = [match]
    if not isinstance(match, list) or not all(isinstance(m, str) and m.strip() for m in match):
        raise WhatifError(f"{at('match')}: match: {data['match']!r} is not a list of GPU names (as nvidia-smi "
                          "names them) that this entry stands for")
    return Hardware(**values, match=tuple(str(m) for m in match), source=source, where=str(path)), count


def builtin() -> dict[str, Hardware]:
    """The shipped entries by lower-case name (hardware/*.yaml)."""
    out = {}
    for p in sorted(HERE.glob("*.yaml")):
        hw, _ = from_yaml(p)
        out[hw.name.lower()] = replace(hw, where=f"tuneledger/hardware/{p.name}")
    return out


def known_line(with_count: bool = True) -> str:
    """The known kinds and the YAML form, for an error. `with_count`: written COUNTxKIND (--gpus), else
    the kind alone (--source-gpu)."""
    names = [h.name for h in builtin().values()]
    form = (f"written COUNTxKIND (e.g. 8x{names[0]}, 1x{names[-1]})" if with_count
            else f"written as the kind alone (e.g. {names[-1]})")
    return f"known GPU kinds: {', '.join(names)}, {form}; or a YAML file of your own:\n{YAML_FORM}"


def did_you_mean(count: str, kind: str, table: dict[str, Hardware]) -> str:
    """' Did you mean 8x4090-pcie?' for a kind that a known one starts with or nearly spells
    (8x4090, 8xrtx4090), else ''. `count` and `kind` as parse_gpus split them; count '' for a kind
    alone (' Did you mean 4090-pcie?')."""
    import difflib

    kind = kind.lower()
    names = {h.name.lower(): h.name for h in table.values()}
    near = [n for n in names if n.startswith(kind) or kind.replace("rtx", "").startswith(n.split("-")[0])]
    near = near or difflib.get_close_matches(kind, list(names), n=1, cutoff=0.6)
    return f" Did you mean {count + 'x' if count else ''}{names[near[0]]}?" if near else ""


def is_yaml(spec: str) -> bool:
    """True when a GPU spec names a YAML file (by its suffix, or an existing file) rather than a kind."""
    return spec.endswith((".yaml", ".yml")) or Path(spec).is_file()


def unknown_kind(flag: str, spec: str, name: str, count: str | None = None) -> WhatifError:
    """The one error for an unknown GPU, --gpus's and --source-gpu's: the spec, a guess, the known
    kinds and the YAML form. `count` is the COUNT of COUNTxKIND, None for a kind alone."""
    what = "GPU set" if count is not None else "GPU kind"
    return WhatifError(f"{flag} {spec!r}: unknown {what}.{did_you_mean(count or '', name, builtin())} "
                       f"{known_line(with_count=count is not None)}")


def lookup_kind(flag: str, spec: str, name: str, count: str | None = None) -> Hardware:
    """The shipped entry called `name` (case-blind) for option `flag` given `spec`; raises
    unknown_kind's error for any other name."""
    table = builtin()
    if name.lower() not in table:
        raise unknown_kind(flag, spec, name, count)
    return table[name.lower()]


def parse_gpus(spec: str) -> tuple[Hardware, int]:
    """`8x4090-pcie` or a YAML path -> (Hardware, count). Raises WhatifError listing the known
    kinds and the YAML form for anything else."""
    if is_yaml(spec):
        hw, count = from_yaml(Path(spec), need_count=True)
        return hw, box_count(int(count), f"{spec}: count")
    m = re.fullmatch(r"(\d+)\s*[xX]\s*(.+)", spec.strip())
    if not m:
        raise unknown_kind("--gpus", spec, spec.strip(), "1")
    hw = lookup_kind("--gpus", spec, m.group(2), m.group(1))
    count = int(m.group(1))
    if count < 1:
        raise WhatifError(f"--gpus {spec!r}: the count must be at least 1")
    return hw, box_count(count, f"--gpus {spec!r}")


# GPUs in one box: an HGX board and the largest PCIe servers hold 8. The model's all-reduce is a
# ring over one box's link (link_gbs); more GPUs than a box holds would cross a network between
# boxes, for which no entry has a figure.
BOX_GPUS = 8


def box_count(count: int, where: str) -> int:
    """`count` if one box holds that many GPUs (BOX_GPUS), else WhatifError naming `where`."""
    if count > BOX_GPUS:
        raise WhatifError(f"{where}: {count} GPUs: whatif models one box of at most {BOX_GPUS} (an HGX board holds 8); "
                          "more would cross a network between boxes, whose bandwidth no hardware entry gives")
    return count


def source_kind(spec: str) -> Hardware:
    """--source-gpu: a kind (`H200-sxm`) or a YAML file (its `count`, if any, is not used). Raises
    WhatifError as parse_gpus does."""
    return from_yaml(Path(spec))[0] if is_yaml(spec) else lookup_kind("--source-gpu", spec, spec.strip())


def for_ledger_gpu(name: str) -> Hardware | None:
    """The shipped entry whose `match` fragments appear in a ledger's GPU name ('NVIDIA H200')."""
    for hw in builtin().values():
        if any(frag.lower() in name.lower() for frag in hw.match):
            return hw
    return None
