"""How much of a whatif prediction rests on the spread of sample lengths: the same ledger predicted
again with its length summary's p95 moved so that the model's sd, (p95 - median) / 1.645
(costmodel.length_sd), takes each value asked. Nothing else in the ledger changes. A sensitivity,
not a measurement: it says how the step's parts move with a spread that the source does not give.

Why: the field report's 8x4090 run gives its data's mean (666 tokens), longest (1,070) and count
(278,024 records), not their spread; the ledgers it is predicted from were measured on
conversations drawn from N(666, 180) clipped to [64, 1070] (bench/make_fieldlen_data.py), an
assumption. With micro-batch 1 the sync wait of 8 ranks follows that sd (docs/whatif.md).

    python bench/whatif_length_spread.py LEDGER --gpus 8x4090-pcie --sd 60 90 120 168 \
        --steps 17377 --save-steps 200 --out bench/results/<dir>/length-spread.md

Writes a markdown table (one row per preset and sd: s/step and its parts, tokens/s) and the whatif
--json of each sd beside it, all at the end (an interrupted run writes nothing). The ledger and
--gpus are checked by whatif itself first, so its errors name them. Exit 2 for bad input (whatif's
own message, an sd outside 0-100,000 tokens, an --out that is a folder or in none); 130 when
interrupted (Ctrl-C or SIGTERM); 1 when a whatif run on a changed copy fails (its output is printed).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import shutil
import signal
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_SD = 100_000  # tokens: beyond any context length, so beyond a typo's reach (1e308 overflowed)
sys.path.insert(0, str(ROOT / "src"))
# whatif in this process, not a child: a SIGTERM or Ctrl-C then stops all of it (a child was left running)
from tuneledger.cli import main as tuneledger  # noqa: E402


def with_sd(ledger: dict, sd: float) -> dict:
    """A copy of `ledger` whose stats.length p95 gives sd tokens by (p95 - median) / 1.645."""
    out = json.loads(json.dumps(ledger))
    length = out["stats"]["length"]
    length["p95"] = length["median"] + round(1.645 * sd)
    return out


def whatif_quietly(argv: list[str]) -> tuple[int, str]:
    """tuneledger whatif in this process: (exit code, what it printed)."""
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        try:
            rc = tuneledger(argv)
        except SystemExit as e:  # argparse's own errors
            rc = e.code if isinstance(e.code, int) else 2
    return rc, said.getvalue()


def positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text}: a whole number >= 1")
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ledger")
    ap.add_argument("--gpus", required=True)
    ap.add_argument("--sd", type=float, nargs="+", required=True, help="sds of sample lengths to try, tokens")
    ap.add_argument("--steps", type=positive)
    ap.add_argument("--save-steps", type=positive)
    ap.add_argument("--out", required=True, help="the markdown table; each sd's whatif --json beside it")
    a = ap.parse_args()
    if bad := [sd for sd in a.sd if not math.isfinite(sd) or not 0 <= sd <= MAX_SD]:  # the model clamps a negative sd to 0
        ap.error(f"--sd {' '.join(f'{sd:g}' for sd in bad)}: an sd is a finite number of tokens from 0 to {MAX_SD:,}")
    out = Path(a.out)
    if out.is_dir() or not out.parent.is_dir():
        ap.error(f"--out {a.out}: {'a folder' if out.is_dir() else 'its folder does not exist'}; give a file path (.md)")
    if taken := [p.name for p in [out.with_name(f"{out.stem}-sd{sd:g}.json") for sd in a.sd] if p.is_dir()]:
        ap.error(f"--out {a.out}: {', '.join(taken)} beside it is a folder, where an output goes")
    try:  # a folder that cannot take the outputs is found now, not after every sd
        tempfile.NamedTemporaryFile(dir=out.parent, prefix=".write-check-").close()
    except OSError as e:
        ap.error(f"--out {a.out}: cannot write in {out.parent} ({e.strerror or e})")
    extra = (["--steps", str(a.steps)] if a.steps else []) + (["--save-steps", str(a.save_steps)] if a.save_steps else [])
    # whatif on the ledger as given first: its errors then name the user's file and option, not a copy's
    rc, said = whatif_quietly(["whatif", a.ledger, "--gpus", a.gpus, *extra])
    if rc == 130:
        raise KeyboardInterrupt
    if rc != 0:
        print(said.strip(), file=sys.stderr)
        return rc
    ledger = json.loads(Path(a.ledger).read_text())  # whatif read and checked it (stats.length included)
    length = ledger["stats"]["length"]
    measured = (length["p95"] - length["median"]) / 1.645
    rows = ["| preset | sd (tokens) | s/step | micro-batches | all-reduce | sync wait | optimizer | data wait "
            "| beyond the micro-batches | tokens/s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    # Every output is made in a scratch folder and moved beside --out at the end: an interrupted run
    # leaves the last complete set, not new JSONs beside an old table.
    with tempfile.TemporaryDirectory() as tmp:
        made = []
        for sd in a.sd:
            src = Path(tmp) / f"sd{sd:g}.json"
            src.write_text(json.dumps(with_sd(ledger, sd)))
            pred = Path(tmp) / f"{out.stem}-sd{sd:g}.json"
            rc, said = whatif_quietly(["whatif", str(src), "--gpus", a.gpus, "--json", str(pred), *extra])
            if rc == 130:
                raise KeyboardInterrupt
            if rc != 0:
                print(said, file=sys.stderr)
                return 1
            made.append(pred)
            for r in json.loads(pred.read_text())["predictions"]:
                s = r["step"]
                beyond = s["allreduce"] + s["sync_wait"] + s["optimizer"] + s["data_wait"]
                rows.append(f"| {r['preset']} | {sd:g}{' (the ledger)' if abs(sd - measured) < 0.5 else ''} "
                            f"| {r['s_per_step']:.3f} | {s['micro_batches']:.3f} | {s['allreduce']:.3f} "
                            f"| {s['sync_wait']:.3f} | {s['optimizer']:.3f} | {s['data_wait']:.3f} | {beyond:.3f} "
                            f"| {r['tokens_per_s']:,.0f} |")
        head = (f"whatif {a.ledger} --gpus {a.gpus}, its length sd ({measured:.0f} tokens measured) replaced by each "
                "value (bench/whatif_length_spread.py); seconds")
        table = Path(tmp) / out.name
        table.write_text(head + "\n\n" + "\n".join(rows) + "\n")
        for f in [*made, table]:  # the table last: it is what says the set is complete
            shutil.move(str(f), out.with_name(f.name))
    print(out.read_text())
    return 0


def stop_on_sigterm() -> None:
    """SIGTERM as Ctrl-C: the scratch folder is removed and the exit says so."""
    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM while cleaning up: ignored
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


if __name__ == "__main__":
    stop_on_sigterm()
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted: nothing written", file=sys.stderr)
        sys.exit(130)
