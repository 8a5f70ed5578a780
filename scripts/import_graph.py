"""The modules of tuneledger and their imports, read from the source with `ast`, and their picture.

    python3 scripts/import_graph.py [OUT.png]    # the picture, default docs/architecture.png
    python3 scripts/import_graph.py --text       # the graph as text: each module and what it imports

Any Python 3.9+ runs it: reading the imports needs the standard library only (ast), so --text works
with the system python3. The picture needs matplotlib and networkx, imported only to draw; without
them it says so and how to get them (the project's .venv has both: .venv/bin/python
scripts/import_graph.py).

Every import counts, at module level or inside a function (the verbs import torch and friends
late, so `tuneledger --help` stays fast; a late import is still a dependency). The verbs are the
modules cli.py lists in VERBS. tests/test_imports.py reads the same graph to guard its
direction (verbs import only the core, the core imports no verb, no circles) and the modules'
size, so the picture shows what the test checks.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "tuneledger"
ENTRY = ("tuneledger.cli", "tuneledger.__main__")  # the command itself: it may reach every verb


def module_name(path: Path, package: Path = PACKAGE) -> str:
    """tuneledger.x.y for package/x/y.py; a package's __init__.py is the package itself."""
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, name: str, is_package: bool, known: set[str]) -> dict[str, int]:
    """{imported tuneledger module: first line} of one module's source. `from tuneledger.x import y`
    names module x.y when there is one, else x; relative imports are resolved against `name`."""
    found: dict[str, int] = {}
    base = name.split(".") if is_package else name.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = ".".join(base[:len(base) - node.level + 1] + [node.module or ""]).strip(".") if node.level \
                else node.module or ""
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import tuneledger.monitor.rows as r` names the module
                target = target.rpartition(".")[0]
            if target and target != name:
                found[target] = min(found.get(target, node.lineno), node.lineno)
    return found


def read_graph(package: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """{module: {module it imports: first line}} for every module of the package."""
    files = {module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    known = set(files)
    return {name: imports_of(p.read_text(encoding="utf-8"), name, p.name == "__init__.py", known)
            for name, p in files.items()}


def verbs(package: Path = PACKAGE) -> list[str]:
    """The verb modules: cli.py's VERBS (read, not imported), those that exist."""
    tree = ast.parse((package / "cli.py").read_text(encoding="utf-8"))
    listed = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "VERBS" for t in n.targets))
    have = set(read_graph(package))
    return [f"tuneledger.{v}" for v in listed if f"tuneledger.{v}" in have]


def layout(g, verb_modules: list[str]) -> dict[str, tuple[float, float]]:
    """Rows: the command on top, then the verbs, then the core by height (the longest chain of
    imports below a module), so what imports nothing is at the bottom and every import points
    down. Within a row, modules sit near what they import and what imports them (a few sweeps of
    the barycentre heuristic), which keeps the lines short."""
    import networkx as nx

    core = g.subgraph(n for n in g if n not in verb_modules and n not in ENTRY)
    # By strongly connected component, so that a circle (which the test refuses) still draws, in one row.
    dag = nx.condensation(core)
    height: dict[int, int] = {}
    for c in reversed(list(nx.topological_sort(dag))):
        height[c] = 1 + max((height[s] for s in dag.successors(c)), default=-1)
    top = max(height.values(), default=0)
    row = {n: 2 + top - height[c] for n, c in dag.graph["mapping"].items()}
    row.update({n: 1 for n in verb_modules if n in g})
    row.update({n: 0 for n in ENTRY if n in g})
    rows: dict[int, list[str]] = {}
    for n in sorted(g):
        rows.setdefault(row[n], []).append(n)
    for _ in range(6):
        index = {n: i / max(1, len(ns) - 1) for ns in rows.values() for i, n in enumerate(ns)}
        for r in sorted(rows):
            near = lambda n: [index[m] for m in (*g.successors(n), *g.predecessors(n))]  # noqa: E731
            rows[r].sort(key=lambda n: sum(near(n)) / len(near(n)) if near(n) else index[n])
    widest = max(len(ns) for ns in rows.values())
    return {n: ((i - (len(ns) - 1) / 2) / widest, -r) for r, ns in rows.items() for i, n in enumerate(ns)}


DRAWING = ("matplotlib", "networkx")


def missing_for_drawing() -> list[str]:
    """The packages the picture needs that this Python cannot import."""
    import importlib.util

    return [m for m in DRAWING if importlib.util.find_spec(m) is None]


def as_text(graph: dict[str, dict[str, int]], verb_modules: list[str]) -> str:
    """One line per module: its kind (the command, a verb, the core) and the modules it imports."""
    def kind(n: str) -> str:
        return "command" if n in ENTRY else "verb" if n in verb_modules else "core"

    short = lambda n: n.removeprefix("tuneledger.")  # noqa: E731
    width = max(len(short(n)) for n in graph)
    lines = [f"{short(n):<{width}}  {kind(n):<7}  -> {', '.join(short(d) for d in sorted(graph[n])) or '-'}"
             for n in sorted(graph)]
    return "\n".join(lines)


def draw(graph: dict[str, dict[str, int]], verb_modules: list[str], out: Path) -> None:
    """The modules as dots in rows (`layout`), coloured by kind: the command, the verbs, the core."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import networkx as nx

    g = nx.DiGraph()
    skip = {"tuneledger", "tuneledger.monitor"}  # the packages' __init__ hold no code of their own
    g.add_nodes_from(n for n in graph if n not in skip)
    g.add_edges_from((a, b) for a, deps in graph.items() for b in deps if a not in skip and b not in skip)
    pos = layout(g, verb_modules)
    kind = {n: "entry" if n in ENTRY else "verb" if n in verb_modules else "core" for n in g}
    colour = {"entry": "#9e9e9e", "verb": "#e07b39", "core": "#3a7dc9"}
    fig, ax = plt.subplots(figsize=(24, 14), dpi=100)
    nx.draw_networkx_edges(g, pos, ax=ax, edge_color="#7a7a7a", alpha=0.3, arrows=True, arrowsize=8, width=0.7,
                           node_size=1100)
    nx.draw_networkx_nodes(g, pos, ax=ax, node_color=[colour[kind[n]] for n in g], node_size=1100, alpha=0.85)
    nx.draw_networkx_labels(g, pos, ax=ax, labels={n: n.removeprefix("tuneledger.") for n in g}, font_size=8)
    for k, c in colour.items():
        ax.scatter([], [], color=c, label={"entry": "the command (cli.py)", "verb": "a verb (cli.VERBS)",
                                           "core": "the shared core"}[k])
    ax.legend(loc="lower left", frameon=False, fontsize=11)
    ax.set_title("tuneledger's modules and their imports (scripts/import_graph.py): an arrow goes from a module to one "
                 "it imports, downwards; a level one is a circle or a verb importing a verb, which tests/test_imports.py "
                 "refuses", fontsize=12)
    ax.axis("off")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if argv[:1] == ["--text"]:
        print(as_text(read_graph(), verbs()))
        return 0
    target = Path(argv[0]) if argv else ROOT / "docs" / "architecture.png"
    missing = missing_for_drawing()
    if missing:
        print(f"import_graph: drawing {target} needs {' and '.join(missing)}, which {sys.executable} cannot import. "
              f"Run it with the project's venv, which has them ({ROOT / '.venv' / 'bin' / 'python'} {Path(__file__).resolve()}; "
              f"`make venv` makes it), or install them ({sys.executable} -m pip install {' '.join(missing)}). "
              "`--text` lists the graph with the standard library alone.", file=sys.stderr)
        return 1
    draw(read_graph(), verbs(), target)
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
