"""The package's shape, read from the source with `ast` (scripts/import_graph.py, which also draws
docs/architecture.png): verbs import only the shared core, the core imports no verb, there is no
circle of imports, and no module grows past 450 lines. docs/architecture.md says where things go.
Every import counts, a function's late import too."""

import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import import_graph  # noqa: E402

MAX_LINES = 450


def verb_to_verb(graph: dict[str, dict[str, int]], verbs: list[str]) -> list[str]:
    return [f"{v} -> {d} (line {graph[v][d]})" for v in verbs for d in graph[v] if d in verbs]


def core_to_verb(graph: dict[str, dict[str, int]], verbs: list[str]) -> list[str]:
    core = [m for m in graph if m not in verbs and m not in import_graph.ENTRY]
    return [f"{m} -> {d} (line {graph[m][d]})" for m in core for d in graph[m]
            if d in verbs or d in import_graph.ENTRY]


def circles(graph: dict[str, dict[str, int]]) -> list[str]:
    """One line per knot of modules that import each other, with one circle through it."""
    g = nx.DiGraph([(a, b) for a, deps in graph.items() for b in deps])
    knots = [k for k in nx.strongly_connected_components(g) if len(k) > 1]
    out = []
    for k in sorted(knots, key=sorted):
        cycle = [a for a, _ in nx.find_cycle(g.subgraph(k))]
        out.append(f"{', '.join(sorted(k))}: " + " -> ".join(cycle + cycle[:1]))
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, int]]:
    return import_graph.read_graph()


@pytest.fixture(scope="module")
def verbs() -> list[str]:
    return import_graph.verbs()


def test_the_reader_sees_late_relative_and_aliased_imports(tmp_path):
    pkg = tmp_path / "tuneledger"
    (pkg / "sub").mkdir(parents=True)
    for f in ("__init__.py", "leaf.py", "sub/leaf.py"):
        (pkg / f).write_text("import os\n")
    (pkg / "sub" / "__init__.py").write_text("from . import leaf\n")
    (pkg / "a.py").write_text("import tuneledger.leaf as l\nfrom tuneledger import sub\n\n\ndef late():\n"
                              "    from tuneledger.sub.leaf import x\n    from .leaf import y\n")
    found = import_graph.read_graph(pkg)
    assert found["tuneledger.a"] == {"tuneledger.leaf": 1, "tuneledger.sub": 2, "tuneledger.sub.leaf": 6}
    assert found["tuneledger.sub"] == {"tuneledger.sub.leaf": 1}
    assert found["tuneledger.leaf"] == {}


def test_the_checks_catch_what_they_guard():
    bad = {"tuneledger.train": {"tuneledger.dryrun": 3, "tuneledger.config": 1}, "tuneledger.dryrun": {},
           "tuneledger.config": {"tuneledger.train": 9, "tuneledger.data": 2}, "tuneledger.data": {"tuneledger.config": 4}}
    verbs = ["tuneledger.train", "tuneledger.dryrun"]
    assert verb_to_verb(bad, verbs) == ["tuneledger.train -> tuneledger.dryrun (line 3)"]
    assert core_to_verb(bad, verbs) == ["tuneledger.config -> tuneledger.train (line 9)"]
    assert len(circles(bad)) == 1 and circles(bad)[0].startswith("tuneledger.config, tuneledger.data, tuneledger.train: ")


def test_the_verbs_are_cli_s(verbs):
    for v in ("stats", "dryrun", "train", "export", "quantize", "chat", "evaluate", "gpus", "monitor.cli", "preflight"):
        assert f"tuneledger.{v}" in verbs


def test_verbs_import_only_the_core(graph, verbs):
    bad = verb_to_verb(graph, verbs)
    assert not bad, ("a verb imports another verb; move what they share into a core module "
                     "(docs/architecture.md):\n  " + "\n  ".join(bad))


def test_the_core_imports_no_verb(graph, verbs):
    bad = core_to_verb(graph, verbs)
    assert not bad, "a core module imports a verb (or cli); move the name down:\n  " + "\n  ".join(bad)


def test_no_circle_of_imports(graph):
    found = circles(graph)
    assert not found, ("modules import each other; move the shared names down to the module that owns them:\n  "
                       + "\n  ".join(found))


def test_no_module_over_450_lines():
    sizes = {p.relative_to(ROOT): len(p.read_text(encoding="utf-8").splitlines())
             for p in import_graph.PACKAGE.rglob("*.py")}
    assert len(sizes) > 40
    big = [f"{p}: {n} lines" for p, n in sorted(sizes.items()) if n > MAX_LINES]
    assert not big, f"split by kind what holds more than {MAX_LINES} lines:\n  " + "\n  ".join(big)
