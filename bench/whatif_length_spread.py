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
--json of each sd beside it. Exit 2 for a ledger without a length summary or an sd below 0; exit 1
when a whatif run fails (its output is printed).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
# whatif in this process, not a child: a SIGTERM or Ctrl-C then stops all of it (a child was left running)
from tuneledger.cli import main as tuneledger  # noqa: E402


def with_sd(ledger: dict, sd: float) -> dict:
    """A copy of `ledger` whose stats.length p95 gives sd tokens by (p95 - median) / 1.645."""
    out = json.loads(json.dumps(ledger))
    length = out["stats"]["length"]
    length["p95"] = length["median"] + round(1.645 * sd)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ledger")
    ap.add_argument("--gpus", required=True)
    ap.add_argument("--sd", type=float, nargs="+", required=True, help="sds of sample lengths to try, tokens")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--save-steps", type=int)
    ap.add_argument("--out", required=True, help="the markdown table; each sd's whatif --json beside it")
    a = ap.parse_args()
    if bad := [sd for sd in a.sd if not math.isfinite(sd) or sd < 0]:  # the model clamps a negative sd to 0
        ap.error(f"--sd {' '.join(f'{sd:g}' for sd in bad)}: an sd is a finite number of tokens >= 0")
    try:
        ledger = json.loads(Path(a.ledger).read_text())
        length = ledger["stats"]["length"]
        measured = (length["p95"] - length["median"]) / 1.645
    except (OSError, ValueError) as e:
        ap.error(f"{a.ledger}: not a readable JSON ledger ({e})")
    except (KeyError, TypeError) as e:
        ap.error(f"{a.ledger}: no stats.length.p95 and .median (a dry-run ledger's length summary): {e!r} missing")
    out = Path(a.out)
    rows = ["| preset | sd (tokens) | s/step | micro-batches | all-reduce | sync wait | optimizer | data wait "
            "| beyond the micro-batches | tokens/s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for sd in a.sd:
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / f"sd{sd:g}.json"
            src.write_text(json.dumps(with_sd(ledger, sd)))
            pred = out.with_name(f"{out.stem}-sd{sd:g}.json")
            cmd = ["whatif", str(src), "--gpus", a.gpus, "--json", str(pred)]
            cmd += ["--steps", str(a.steps)] if a.steps else []
            cmd += ["--save-steps", str(a.save_steps)] if a.save_steps else []
            said = io.StringIO()
            with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
                try:
                    rc = tuneledger(cmd)
                except SystemExit as e:  # argparse's own errors
                    rc = e.code if isinstance(e.code, int) else 1
            if rc != 0:
                print(said.getvalue())
                return 1
        for r in json.loads(pred.read_text())["predictions"]:
            s = r["step"]
            beyond = s["allreduce"] + s["sync_wait"] + s["optimizer"] + s["data_wait"]
            rows.append(f"| {r['preset']} | {sd:g}{' (the ledger)' if abs(sd - measured) < 0.5 else ''} "
                        f"| {r['s_per_step']:.3f} | {s['micro_batches']:.3f} | {s['allreduce']:.3f} "
                        f"| {s['sync_wait']:.3f} | {s['optimizer']:.3f} | {s['data_wait']:.3f} | {beyond:.3f} "
                        f"| {r['tokens_per_s']:,.0f} |")
    head = (f"whatif {a.ledger} --gpus {a.gpus}, its length sd ({measured:.0f} tokens measured) replaced by each "
            "value (bench/whatif_length_spread.py); seconds")
    out.write_text(head + "\n\n" + "\n".join(rows) + "\n")
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
