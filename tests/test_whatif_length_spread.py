"""bench/whatif_length_spread.py: the same ledger with only its length spread moved. At the ledger's
own sd it predicts what whatif predicts from the ledger itself; a narrower spread shortens the
sync wait of 8 ranks and nothing before it."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEDGER = ROOT / "bench/results/whatif-2026-12-04/tune-cand1-A-dryrun.json"


def test_the_ledgers_own_spread_reproduces_whatif_and_a_narrower_one_waits_less(tmp_path):
    out = tmp_path / "spread.md"
    p = subprocess.run([sys.executable, str(ROOT / "bench/whatif_length_spread.py"), str(LEDGER), "--gpus", "8x4090-pcie",
                        "--sd", "88", "168.4", "--steps", "17377", "--save-steps", "200", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    narrow, own = (json.loads((tmp_path / f"spread-sd{sd}.json").read_text())["predictions"][0] for sd in ("88", "168.4"))
    direct = subprocess.run([sys.executable, "-m", "tuneledger", "whatif", str(LEDGER), "--gpus", "8x4090-pcie", "--steps",
                             "17377", "--save-steps", "200", "--json", str(tmp_path / "direct.json")],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert direct.returncode == 0, direct.stderr[-2000:]
    assert abs(own["s_per_step"] - json.loads((tmp_path / "direct.json").read_text())["predictions"][0]["s_per_step"]) < 1e-3
    assert narrow["step"]["sync_wait"] < own["step"]["sync_wait"] - 0.05
    assert narrow["step"]["allreduce"] == own["step"]["allreduce"] and narrow["s_per_step"] < own["s_per_step"]
    assert "| A | 168.4 (the ledger) |" in out.read_text()


def test_bad_input_is_one_line_naming_the_file_or_the_option(tmp_path):
    (tmp_path / "bad.json").write_text("not json{")
    (tmp_path / "nolen.json").write_text('{"stats": {}}')
    led = json.loads(LEDGER.read_text())
    led["stats"]["length"]["p95"] = "900"
    (tmp_path / "textp95.json").write_text(json.dumps(led))
    (tmp_path / "adir.md").mkdir()
    (tmp_path / "sdtaken-sd88.json").mkdir()
    for args, says in (([str(tmp_path / "missing.json")], "missing.json: cannot read the dry-run ledger"),
                       ([str(tmp_path / "bad.json")], "bad.json:1:1: not valid JSON"),
                       ([str(tmp_path / "nolen.json")], "nolen.json: no 'presets' list"),
                       ([str(tmp_path / "textp95.json")], "textp95.json: stats.length.p95: '900': input should be a valid number"),
                       ([str(LEDGER), "--gpus", "8xFoo"], "--gpus '8xFoo': unknown GPU set"),
                       ([str(LEDGER), "--steps", "0"], "--steps: 0: a whole number >= 1"),
                       ([str(LEDGER), "--out", str(tmp_path / "adir.md")], "adir.md: a folder"),
                       ([str(LEDGER), "--out", str(tmp_path / "nowhere/o.md")], "its folder does not exist"),
                       ([str(LEDGER), "--out", "/proc/o.md"], "cannot write in /proc"),
                       ([str(LEDGER), "--out", str(tmp_path / "sdtaken.md")], "sdtaken-sd88.json beside it is a folder"),
                       ([str(LEDGER), "--sd", "-5"], "--sd -5: an sd is a finite number of tokens from 0 to 100,000"),
                       ([str(LEDGER), "--sd", "1e308"], "--sd 1e+308: an sd is"),
                       ([str(LEDGER), "--sd", "nan"], "--sd nan: an sd is")):
        sd = [] if "--sd" in args else ["--sd", "88"]
        gpus = [] if "--gpus" in args else ["--gpus", "8x4090-pcie"]
        out = [] if "--out" in args else ["--out", str(tmp_path / "o.md")]
        p = subprocess.run([sys.executable, str(ROOT / "bench/whatif_length_spread.py"), *args, *sd, *gpus, *out],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["adir.md", "bad.json", "nolen.json", "sdtaken-sd88.json", "textp95.json"]


def test_an_interrupted_run_writes_nothing_and_leaves_nothing_running(tmp_path):
    """SIGTERM mid-run: exit 130 with a line, no table, no per-sd JSON, no scratch folder left."""
    import os
    import signal
    import time

    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir()
    p = subprocess.Popen([sys.executable, str(ROOT / "bench/whatif_length_spread.py"), str(LEDGER), "--gpus", "8x4090-pcie",
                          "--sd", *[str(x) for x in range(40, 400, 4)], "--out", str(tmp_path / "o.md")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    deadline = time.time() + 120
    while not any((tmp_path / "tmp").iterdir()) and time.time() < deadline:  # the scratch folder: the sds have begun
        time.sleep(0.05)
    time.sleep(1.0)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "interrupted: nothing written" in err, err
    assert sorted(f.name for f in tmp_path.iterdir()) == ["tmp"] and not any((tmp_path / "tmp").iterdir())
