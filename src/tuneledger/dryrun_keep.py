"""What a dry-run keeps of the one before it: the earlier ledger's presets, the preset folders a
killed run set aside (put back), and the ledger's own log. dryrun.json names dryrun.log: a run
moves the log before it to dryrun.log.1 at its start (start_log), marks its log when it writes the
ledger (mark_log), and, when it measured nothing and the earlier ledger stays, puts that ledger's
log back under its name, its own beside it as dryrun.failed.log (keep_earlier_log). A run killed
(-9) before its end never marks its log: the next start sets that log aside as
dryrun.unfinished.log instead of moving it over the ledger's.
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


MARK = "dry-run ledger written: "  # + the ledger's "date": the last line of the log it names


def failed_log(log: Path, kind: str = "failed") -> Path:
    """dryrun.log -> dryrun.failed.log: the log of a run whose rows did not become the ledger
    (`kind` "unfinished": of a run killed before its end)."""
    return log.with_name(log.name.replace(".log", f".{kind}.log"))


def _ledger_date(ledger: Path) -> str | None:
    try:
        return json.loads(ledger.read_text()).get("date")
    except (OSError, ValueError, AttributeError):
        return None


def start_log(log: Path, ledger: Path, first_node: bool = True) -> Path | None:
    """At a dry-run's start: the log before it out of the way, `log` made empty. Returns where the
    ledger's log now is (dryrun.log.1; None when there was no log). When dryrun.log.1 is the
    ledger's (its mark) and dryrun.log is not (a run killed with -9 before its end), dryrun.log goes
    to dryrun.unfinished.log instead, so that the ledger's stays. Otherwise (logs from before the
    marks, nodes other than the first, which write no ledger) dryrun.log moves to .1."""
    one = log.with_name(log.name + ".1")
    earlier = None
    if log.exists():
        date = _ledger_date(ledger) if first_node else None
        if date and not marked(log, date) and marked(one, date):
            log.replace(failed_log(log, "unfinished"))  # renames only: a full disk allows them
        else:
            log.replace(one)
        earlier = one
    log.touch()
    return earlier


def mark_log(log: Path, date: str) -> None:
    """The ledger dated `date` is written from this run: its log says so last (start_log reads it).
    Written before the ledger: a stop between the two leaves the old ledger and a marked log, which
    start_log then does not take for the old ledger's."""
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"{MARK}{date}\n")


def marked(log: Path, date: str) -> bool:
    """Whether `log` ends with the mark of the ledger dated `date` (its last 4 KiB are read)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 4096))
            return f"{MARK}{date}".encode() in f.read()
    except OSError:
        return False


def keep_earlier_log(log: Path, earlier: Path | None) -> Path | None:
    """The earlier ledger is kept: its log goes back to `log` (dryrun.log, which the ledger names)
    and this run's log to dryrun.failed.log, beside dryrun.failed.json. Returns where this run's
    log went (None when nothing moved: no earlier log, or a rename failed)."""
    if earlier is None or not earlier.exists():
        return None
    failed = failed_log(log)
    try:
        log.replace(failed)
        earlier.replace(log)
    except OSError:
        return None
    return failed


def kept_log_words(log: Path, moved: Path | None) -> str:
    """The clause after "... is left as it was" that says where each log is."""
    if moved is None:
        return ""
    return (f" with its log {log.name}; this run's log is {moved} (the lines above that name {log.name} "
            f"meant that file)")
