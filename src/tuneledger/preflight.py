"""`tuneledger preflight`: the checks that run before any weights load (preflight_checks.py), one
line each, `ok` or `FAIL` with the fix; exit 1 on the first failure.
"""

from __future__ import annotations

import argparse
from typing import Any

from tuneledger.config_load import add_preset_option, from_cli
from tuneledger.model import PreflightError
from tuneledger.preflight_checks import run_checks
from tuneledger.words import count_at_least


def run(args: argparse.Namespace) -> int:
    cfg = from_cli(args.items)
    try:
        for line in run_checks(cfg, None if not args.cpu else False, ranks_here=args.nproc):
            print(f"ok  {line}")
    except PreflightError as e:
        print(f"FAIL {e}")
        return getattr(e, "exit_code", 1)
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("preflight", help="check logging, bitsandbytes, disk and the model variant before loading weights")
    p.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]")
    add_preset_option(p)
    p.add_argument("--cpu", action="store_true", help="check as for a CPU run")
    p.add_argument("--nproc", type=count_at_least(1), help="ranks this host will start, for the host-memory check (default: one per visible GPU)")
    p.set_defaults(func=run)
