"""The monitor's CSV log: CsvLog appends sample rows to a daily <host>-<YYYY-MM-DD>.csv;
read_rows and read_window read them back, typed as the sampler returns them."""

from __future__ import annotations

import csv
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

from tuneledger.monitor.rows import COLUMNS, FLOAT_COLS, INT_COLS, parse_time


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "host"


def _cell(v: Any) -> Any:
    return "" if v is None else v


class CsvLog:
    """Appends sample rows to <out_dir>/<host>-<YYYY-MM-DD>.csv, switching file when the UTC date
    of a sample changes. Writes the header into a new or empty file and flushes every sample. An
    existing file with a different header (an older column set) is left alone: rows go to
    <host>-<date>.1.csv (.2, ...) instead, so one file never mixes two layouts."""

    def __init__(self, out_dir: str | Path, host: str):
        self.out_dir = Path(out_dir)
        self.host = safe_name(host)
        self._f: Any = None
        self._date: str | None = None
        self.path: Path | None = None

    def _open(self, date: str) -> None:
        self.close()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        header = ",".join(COLUMNS)
        k = 0
        while True:
            p = self.out_dir / (f"{self.host}-{date}.csv" if k == 0 else f"{self.host}-{date}.{k}.csv")
            if not p.exists() or p.stat().st_size == 0:
                break
            with open(p, encoding="utf-8") as f:
                if f.readline().rstrip("\r\n") == header:
                    break
            k += 1
        new = not p.exists() or p.stat().st_size == 0
        self._f = open(p, "a", newline="", encoding="utf-8")
        self._w = csv.writer(self._f, lineterminator="\n")
        if new:
            self._w.writerow(COLUMNS)
        self._date, self.path = date, p

    def write(self, rows: list[dict]) -> Path | None:
        """Append one sample's rows and flush. Returns the file written."""
        if not rows:
            return self.path
        date = str(rows[0]["timestamp"])[:10]
        if date != self._date:
            self._open(date)
        for r in rows:
            self._w.writerow([_cell(r.get(c)) for c in COLUMNS])
        self._f.flush()
        return self.path

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None


def _typed(raw: dict) -> dict:
    row = dict.fromkeys(COLUMNS)
    for k, v in raw.items():
        if k is None:
            continue
        if v is None or v == "":
            row[k] = None
        elif k in INT_COLS:
            row[k] = int(float(v))
        elif k in FLOAT_COLS:
            row[k] = float(v)
        else:
            row[k] = v
    return row


def read_rows(paths: str | Path | Iterable[str | Path]) -> list[dict]:
    """Rows from monitor CSVs (files, or folders whose *.csv are read in name order), typed as
    `sample` returns them. Raises FileNotFoundError for a path that does not exist."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.glob("*.csv"))
        elif p.exists():
            files.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such monitor CSV")
    rows: list[dict] = []
    for f in files:
        with open(f, newline="", encoding="utf-8") as fh:
            rows += [_typed(r) for r in csv.DictReader(fh)]
    return rows


_DATED = re.compile(r"-(\d{4}-\d\d-\d\d)(?:\.\d+)?\.csv$")


def read_window(out_dir: str | Path, start_iso: str | datetime, end_iso: str | datetime,
                host: str | None = None) -> list[dict]:
    """The sidecar's rows between start and end (inclusive), reading only the daily files that can
    hold them (<host>-<date>[.k].csv for the UTC dates of the window; any host unless given).
    Returns [] when the folder or the files do not exist: no sidecar ran."""
    t0, t1 = parse_time(start_iso), parse_time(end_iso)
    folder = Path(out_dir)
    if not folder.is_dir():
        return []
    days = {t0.date().isoformat(), t1.date().isoformat()}
    d = t0.date()
    while d.isoformat() < t1.date().isoformat():  # windows that span more than two days
        days.add(d.isoformat())
        d = d.fromordinal(d.toordinal() + 1)
    prefix = f"{safe_name(host)}-" if host else ""
    files = [f for f in sorted(folder.glob("*.csv"))
             if (m := _DATED.search(f.name)) and m[1] in days and f.name.startswith(prefix)
             and (not host or f.name[len(prefix):len(prefix) + 10] == m[1])]
    return [r for r in (read_rows(files) if files else []) if t0 <= parse_time(r["timestamp"]) <= t1]
