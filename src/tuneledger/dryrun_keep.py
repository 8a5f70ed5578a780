"""What a dry-run keeps of the one before it: the earlier ledger's presets, the preset folders a
killed run set aside (put back), and, when this run measured nothing and the earlier ledger stays,
that ledger's own log back under its name (this run's beside it as dryrun.failed.log).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def earlier_presets(path: Path) -> set[str]:
    """The presets an existing dry-run ledger measured (none if it is absent or unreadable)."""
    try:
        rows = json.loads(path.read_text()).get("presets") or []
        return {r["preset"] for r in rows if isinstance(r, dict) and "s_per_step" in r}
    except (OSError, ValueError, AttributeError, TypeError, KeyError):
        return set()


def put_back_earlier(presets_dir: Path) -> list[str]:
    """Every preset folder a dry-run killed (-9) mid-preset left set aside (`<preset>.earlier`, its
    own folder without a result) back in place, whichever presets this run measures. Returns their
    names."""
    back = []
    for earlier in sorted(presets_dir.glob("*.earlier")) if presets_dir.is_dir() else []:
        name = earlier.name.removesuffix(".earlier")
        run_dir = earlier.with_name(name)
        if (run_dir / "result.json").exists():
            shutil.rmtree(earlier, ignore_errors=True)  # measured since: the set-aside one is older
        else:
            put_back(earlier, run_dir, run_dir.with_name(f"{name}.failed"))
            back.append(name)
    return back


def put_back(earlier: Path, run_dir: Path, failed: Path) -> None:
    """The preset's earlier folder back at `run_dir`; what a failed or stopped run left there goes
    to `failed` (replacing an older one). Renames only: a full disk allows them."""
    shutil.rmtree(failed, ignore_errors=True)
    if run_dir.exists():
        run_dir.rename(failed)
    earlier.rename(run_dir)


def keep_earlier_log(log: Path, earlier: Path | None) -> str:
    """The earlier ledger is kept: its log goes back to `log` (dryrun.log, which the ledger names)
    and this run's log to dryrun.failed.log, beside dryrun.failed.json. Returns the clause that
    says where this run's log is ("" when nothing moved: no earlier log, or a rename failed)."""
    if earlier is None or not earlier.exists():
        return ""
    failed = log.with_name(log.name.replace(".log", ".failed.log"))
    try:
        log.replace(failed)
        earlier.replace(log)
    except OSError:
        return ""
    return f" with its log {log.name}; this run's log is {failed}"
