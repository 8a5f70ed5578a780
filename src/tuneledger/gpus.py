"""`tuneledger gpus`: which GPUs are really free, and why.

    tuneledger gpus [--max-used-mib 1024] [--pick N] [--uuid] [--json]

A GPU is free when its memory in use is under --max-used-mib AND it runs no compute process,
whatever its utilisation: an inference server waiting for requests reads 0% utilisation while
it holds 21.7 GB (the field report's shared 8-GPU machine), and that GPU is not free.

Prints one line per GPU with the verdict and its reason. `--pick N` prints a CUDA_VISIBLE_DEVICES
value for N free GPUs on stdout (the table goes to stderr), e.g.

    export CUDA_VISIBLE_DEVICES=$(tuneledger gpus --pick 2)

NVML numbers GPUs in PCI bus order and ignores CUDA_VISIBLE_DEVICES. CUDA numbers them the same
way when they are all the same model, so --pick prints indices then; on a machine with mixed
models (CUDA puts the fastest first) it prints UUIDs, which CUDA_VISIBLE_DEVICES also accepts.

Exit codes: 0 the table was printed (and --pick found N free GPUs); 1 NVML unavailable, or fewer
than N free GPUs for --pick.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from tuneledger.monitor.backends import PynvmlBackend
from tuneledger.monitor.sampler import Monitor
from tuneledger.words import count_at_least, plural

# Default for --max-used-mib. An idle GPU with no context should read near 0 (NVML memory v2
# leaves the driver's reservation out; what an idle H200 reads is for the device run to confirm);
# a CUDA context with nothing allocated takes a few hundred MiB, and a desktop's display server
# (a graphics, not compute, process) some more. 1 GiB tolerates that residue, while any real
# tenant is far above it: 7B QLoRA at micro-batch 1 peaks at 11 GiB (h200-baseline.md), the field
# report's idle vLLM held 21.7 GB and its one usable-but-tight card already held 4.8 GB. A context
# under 1 GiB is still caught by the process check.
MAX_USED_MIB = 1024.0
# Below this utilisation a GPU that holds memory is doing no work: most likely a server waiting
# for requests. NVML utilisation is the share of time any kernel ran, so an idle server reads 0-2%.
IDLE_UTIL_PCT = 5


def _gib(mib: float) -> str:
    return f"{mib / 1024:.1f} GiB"


def verdict(row: dict, max_used_mib: float = MAX_USED_MIB) -> tuple[str, str]:
    """("free" | "busy" | "unknown", reason) for one monitor row (monitor.sampler.sample's dict).

    free: memory used < max_used_mib and no compute process. When NVML cannot list processes the
    verdict rests on memory alone and the reason says so. A row that is not ok is "unknown".
    """
    if row.get("status") != "ok" or row.get("mem_used_mib") is None:
        return "unknown", f"unknown: {row.get('error') or 'not sampled'}"
    used, total = row["mem_used_mib"], row.get("mem_total_mib")
    n, util = row.get("n_procs"), row.get("util_gpu_pct")
    util_txt = f"util {util}%" if util is not None else "util n/a"
    of_total = f" of {_gib(total)}" if total else ""
    if used >= max_used_mib or n:
        if used >= max_used_mib:
            who = (f"held by {n} process{'es' if n != 1 else ''}" if n
                   else "held by no process NVML can list (another container or VM, or a leaked context)"
                   if n == 0 else "held (process list unavailable)")
            what = f"{_gib(used)}{of_total} {who}"
            idle = " (idle server: memory held, no work)" if util is not None and util < IDLE_UTIL_PCT else ""
        else:
            what = f"{n} compute process{'es' if n != 1 else ''} holding {used:,.0f} MiB"
            idle = ""
        pids = row.get("procs")
        return "busy", f"busy: {what}, {util_txt}{idle}" + (f"; pid:MiB {pids}" if pids else "")
    if n is None:
        return "free", f"free: {used:,.0f} MiB used{of_total}, {util_txt}; process list unavailable, judged on memory alone"
    note = " (busy with non-compute work, e.g. graphics)" if util is not None and util >= 50 else ""
    return "free", f"free: {used:,.0f} MiB used{of_total}, no compute process, {util_txt}{note}"


def judge(rows: list[dict], max_used_mib: float = MAX_USED_MIB) -> list[dict]:
    """Each GPU row with `verdict` and `reason` added (rows without a GPU index are dropped)."""
    out = []
    for r in rows:
        if r.get("gpu") is None:
            continue
        v, why = verdict(r, max_used_mib)
        out.append({**r, "verdict": v, "reason": why})
    return out


def pick(judged: list[dict], n: int, use_uuid: bool | None = None) -> str | None:
    """CUDA_VISIBLE_DEVICES value for the first n free GPUs by index, or None if fewer are free.
    use_uuid None: UUIDs only when the GPUs are not all the same model (see the module doc)."""
    free = sorted((r for r in judged if r["verdict"] == "free"), key=lambda r: r["gpu"])
    if len(free) < n:
        return None
    if use_uuid is None:
        use_uuid = len({r.get("name") for r in judged}) > 1
    return ",".join(str(r["uuid"] if use_uuid else r["gpu"]) for r in free[:n])


def render(judged: list[dict], max_used_mib: float, stream: Any) -> None:
    from tuneledger.tables import print_table
    from rich.table import Table

    t = Table(title=f"tuneledger gpus: free = under {max_used_mib:,.0f} MiB used and no compute process",
              title_justify="left")
    for col, just in (("GPU", "right"), ("name", "left"), ("used / total MiB", "right"), ("util", "right"),
                      ("procs", "right"), ("verdict", "left")):
        t.add_column(col, justify=just)
    style = {"free": "green", "busy": "red", "unknown": "yellow"}
    for r in judged:
        used = f"{r['mem_used_mib']:,.0f} / {r['mem_total_mib']:,.0f}" if r.get("mem_used_mib") is not None else "-"
        t.add_row(str(r["gpu"]), str(r.get("name") or "-"), used,
                  f"{r['util_gpu_pct']}%" if r.get("util_gpu_pct") is not None else "-",
                  str(r["n_procs"]) if r.get("n_procs") is not None else "-",
                  f"[{style[r['verdict']]}]{r['reason']}[/]")
    # Auto width on a terminal; 160 columns into a pipe or file, so reasons are not cut short.
    print_table(t, file=stream, width=160)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("gpus", help="which GPUs are really free (memory and processes, not utilisation); --pick N",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-used-mib", type=float, default=MAX_USED_MIB, metavar="MIB",
                   help=f"a GPU using this much memory or more is busy (default {MAX_USED_MIB:.0f})")
    p.add_argument("--pick", type=count_at_least(1), default=None, metavar="N", help="print CUDA_VISIBLE_DEVICES for N free GPUs, or exit 1")
    p.add_argument("--uuid", action="store_true", help="--pick prints UUIDs even when the GPUs are all alike")
    p.add_argument("--json", action="store_true", help="print the rows with verdicts as JSON instead of the table")
    p.set_defaults(func=run, backend=None)


def run(args: argparse.Namespace) -> int:
    messages: list[str] = []
    mon = Monitor(args.backend or PynvmlBackend(), pcie=False, warn=messages.append)
    try:
        rows = mon.poll()
    finally:
        mon.close()
    judged = judge(rows, args.max_used_mib)
    if not judged:
        reason = rows[0].get("error") if rows else "no rows"
        print(f"tuneledger gpus: {reason}", file=sys.stderr)
        return 1
    table_stream = sys.stderr if args.pick is not None else sys.stdout
    if args.json:
        print(json.dumps(judged, indent=1), file=table_stream)
    else:
        render(judged, args.max_used_mib, table_stream)
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        print(f"note: CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']} is set; NVML lists every GPU of the "
              "machine regardless, in its own (PCI bus) numbering", file=sys.stderr)
    if args.pick is None:
        return 0
    value = pick(judged, args.pick, True if args.uuid else None)
    n_free = sum(r["verdict"] == "free" for r in judged)
    if value is None:
        print(f"tuneledger gpus: {plural(args.pick, 'free GPU')} wanted, {n_free} free of {len(judged)}", file=sys.stderr)
        return 1
    print(value)
    return 0
