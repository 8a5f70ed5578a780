"""scripts/import_graph.py runs on any Python 3 (issue 21 (7)): reading the imports is the standard
library's ast, so `--text` works where nothing is installed; the picture needs matplotlib and
networkx, and without them the script says so and how to get them, without a traceback.
`python -S` stands for the system python3: the standard library and nothing else."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "import_graph.py"


def stdlib_python(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-I", "-S", str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_stdlib_alone_lists_the_graph(tmp_path):
    assert subprocess.run([sys.executable, "-I", "-S", "-c", "import matplotlib"], capture_output=True).returncode != 0
    p = stdlib_python("--text", cwd=tmp_path)  # from another folder: the script finds the package itself
    assert p.returncode == 0, p.stderr
    rows = {line.split()[0]: line for line in p.stdout.splitlines()}
    assert rows["chat"].split()[1] == "verb" and "loading" in rows["chat"].split("->")[1]
    assert rows["cli"].split()[1] == "command" and rows["checkpoints"].split()[1] == "core"
    assert len(rows) == len(list((ROOT / "src" / "tuneledger").rglob("*.py")))


def test_drawing_without_matplotlib_says_how_to_get_it(tmp_path):
    p = stdlib_python(str(tmp_path / "g.png"), cwd=tmp_path)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert "needs matplotlib and networkx" in p.stderr and "-m pip install matplotlib networkx" in p.stderr
    assert ".venv/bin/python" in p.stderr and "--text" in p.stderr
    assert not (tmp_path / "g.png").exists()


@pytest.mark.skipif(not Path("/usr/bin/python3").is_file(), reason="no system python3 at /usr/bin/python3")
def test_the_system_python3_runs_it(tmp_path):
    p = subprocess.run(["/usr/bin/python3", str(SCRIPT), "--text"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "chat" in p.stdout, p.stderr


def test_with_matplotlib_it_draws(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("networkx")
    out = tmp_path / "graph.png"
    p = subprocess.run([sys.executable, str(SCRIPT), str(out)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
