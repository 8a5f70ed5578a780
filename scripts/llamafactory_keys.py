"""LLaMA-Factory's config keys, and the docs table of what tuneledger does with each.

    python scripts/llamafactory_keys.py names /path/to/LLaMA-Factory   # refresh the key list
    python scripts/llamafactory_keys.py docs                           # rewrite docs/llamafactory-keys.md

`names` reads the argument dataclasses that `llamafactory-cli train` parses (ModelArguments,
DataArguments, TrainingArguments, FinetuningArguments, GeneratingArguments in
src/llamafactory/hparams/, with their bases) by parsing the source (no import, so LLaMA-Factory
need not be installed), adds the fields of transformers' Seq2SeqTrainingArguments that its
TrainingArguments inherits (from the transformers installed here), and writes
src/tuneledger/data/llamafactory_keys.json: name -> {"group": the dataclass, "default": the
default when it is a literal}. LLaMA-Factory is Apache-2.0 (see NOTICE).

`docs` writes the table from tuneledger.llamafactory, the code that classifies the keys, so the
table cannot drift from it; tests/test_llamafactory.py fails when the committed file is stale.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS_JSON = ROOT / "src" / "tuneledger" / "data" / "llamafactory_keys.json"
DOC = ROOT / "docs" / "llamafactory-keys.md"
TRAIN_CLASSES = ["ModelArguments", "DataArguments", "TrainingArguments", "FinetuningArguments", "GeneratingArguments"]


def _default(call: ast.expr | None) -> object:
    """The literal default of `x: T = field(default=...)` or `x: T = value`; "?" when not literal."""
    if call is None:
        return "?"
    if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "field":
        kw = {k.arg: k.value for k in call.keywords}
        if "default" not in kw:
            return "?"
        call = kw["default"]
    try:
        return ast.literal_eval(call)
    except ValueError:
        if isinstance(call, ast.Attribute):  # an enum member, e.g. AttentionFunction.AUTO
            return f"{getattr(call.value, 'id', '?')}.{call.attr}"
        return "?"


def lf_fields(checkout: Path) -> dict[str, dict]:
    classes: dict[str, tuple[list, list[str]]] = {}
    for f in sorted((checkout / "src" / "llamafactory" / "hparams").glob("*.py")):
        for node in ast.parse(f.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef):
                fields = [(s.target.id, _default(s.value)) for s in node.body
                          if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
                classes[node.name] = (fields, [b.id for b in node.bases if isinstance(b, ast.Name)])

    out: dict[str, dict] = {}

    def walk(name: str, top: str) -> None:
        if name not in classes:
            return
        fields, bases = classes[name]
        for base in bases:
            walk(base, top)
        for key, default in fields:
            if not key.startswith("_"):
                out.setdefault(key, {"group": top, "default": default})

    for cls in TRAIN_CLASSES:
        walk(cls, cls)
    return out


def hf_fields() -> dict[str, dict]:
    import transformers

    out = {}
    for f in dataclasses.fields(transformers.Seq2SeqTrainingArguments):
        if f.name.startswith("_") or not f.init:
            continue
        d = f.default
        if isinstance(d, enum.Enum):
            d = d.value
        if d is dataclasses.MISSING or not isinstance(d, (str, int, float, bool, type(None), list)):
            d = "?"
        out[f.name] = {"group": f"Seq2SeqTrainingArguments (transformers {transformers.__version__})", "default": d}
    return out


def names(checkout: Path) -> None:
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    if (checkout / "COMMIT").is_file():  # an exported tree (git archive) names its commit here
        commit = (checkout / "COMMIT").read_text().strip()
    keys = {**hf_fields(), **lf_fields(checkout)}  # LLaMA-Factory's own field wins where both define one
    KEYS_JSON.write_text(json.dumps({
        "source": f"hiyouga/LLaMA-Factory {commit or '(unknown commit)'}, src/llamafactory/hparams (Apache-2.0)",
        "keys": dict(sorted(keys.items())),
    }, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(keys)} keys to {KEYS_JSON}")


def docs() -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from tuneledger.llamafactory_docs import markdown_table

    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(markdown_table())
    print(f"wrote {DOC}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["names"] and len(sys.argv) == 3:
        names(Path(sys.argv[2]))
    elif sys.argv[1:] == ["docs"]:
        docs()
    else:
        sys.exit(__doc__)
