"""Datasets by name: LLaMA-Factory's `dataset_info.json` in `dataset_dir`.

`dataset: identity,alpaca_en_demo` looks each name up in <dataset_dir>/dataset_info.json. An entry
is a local file (`file_name`, relative to dataset_dir; a folder means every .json/.jsonl in it) or a
hub dataset (`hf_hub_url`, with optional `subset` and `split`), in one of two formattings:

  alpaca    columns: prompt (default "instruction"), query ("input"), response ("output"),
            system, history
  sharegpt  columns: messages ("conversations"), system; tags: role_tag ("from"), content_tag
            ("value"), user_tag ("human"), assistant_tag ("gpt"), system_tag ("system")

Each record is rewritten into the canonical alpaca / sharegpt record that data.to_messages reads,
and an error names the user's own column (a renamed `question` stays `question`). A renamed column
is also the answer to "my keys are question/answer": add an entry with
`"columns": {"prompt": "question", "response": "answer"}`.

An entry that is neither a .json/.jsonl path nor a name in dataset_info.json is an error listing
the names there. A hub dataset is downloaded once into cache_dir as JSONL; offline (no network,
HF_HUB_OFFLINE=1 or HF_DATASETS_OFFLINE=1) it fails at once, naming the dataset and the fix.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuneledger.data import DataError, Invalid

ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "system": "system", "history": "history"}
SHAREGPT_COLUMNS = {"messages": "conversations", "system": "system"}
SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                 "system_tag": "system", "observation_tag": "observation", "function_tag": "function_call"}
# Entry keys that ask for something we do not read; the error says what to do instead.
UNSUPPORTED = {
    "ms_hub_url": "download it (make fetch USE_MODELSCOPE_HUB=1 is for models; for data, save the file) and set file_name",
    "om_hub_url": "download the file and set file_name",
    "script_url": "run the loading script yourself, save the records as .json/.jsonl and set file_name",
    "cloud_file_name": "copy the file locally and set file_name",
    "ranking": "preference (ranking) data is for DPO/RM stages; tuneledger does SFT only",
    "num_samples": "use max_samples (a cap per dataset, as in LLaMA-Factory)",
}
# Columns that only multimodal or tool data use: a record that holds one is not text SFT.
UNUSED_COLUMNS = ("tools", "images", "videos", "audios", "chosen", "rejected", "kto_tag")


@dataclass
class Source:
    """One dataset of the config: its files and how to read their records."""

    name: str  # as written in `dataset`
    files: list[Path]
    formatting: str | None = None  # None: a plain file, its records' format is detected per record
    columns: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    def spec(self) -> dict:
        """What changes the records read from the files (part of the cache key)."""
        return {"formatting": self.formatting, "columns": self.columns, "tags": self.tags}

    def convert(self, obj: Any, where: str) -> Any:
        """The record in a canonical format (see module doc), or Invalid naming the user's field."""
        if self.formatting is None or isinstance(obj, Invalid) or not isinstance(obj, dict):
            return obj
        if self.formatting == "alpaca":
            c = self.columns
            for key in ("prompt", "response"):
                if c[key] not in obj:
                    return Invalid(where, c[key], "missing", "missing field")
            return {canon: obj[c[key]] for key, canon in ALPACA_COLUMNS.items() if c.get(key) in obj}
        c, t = self.columns, self.tags
        turns = obj.get(c["messages"])
        if not isinstance(turns, list):
            return Invalid(where, c["messages"], "missing" if turns is None else "must be a list of turns",
                           "missing field" if turns is None else "wrong type")
        roles = {t["user_tag"]: "human", t["assistant_tag"]: "gpt", t["system_tag"]: "system"}
        conv = []
        for j, turn in enumerate(turns):
            if not isinstance(turn, dict):
                return Invalid(where, f"{c['messages']}[{j}]", "must be an object", "wrong type")
            role = turn.get(t["role_tag"])
            if role not in roles:
                tool = role in (t["observation_tag"], t["function_tag"])
                return Invalid(where, f"{c['messages']}[{j}].{t['role_tag']}",
                               f"role {role!r} is not {t['user_tag']!r}, {t['assistant_tag']!r} or {t['system_tag']!r}"
                               + (" (tool-call data is not supported)" if tool else ""), "unsupported role")
            conv.append({"from": roles[role], "value": turn.get(t["content_tag"])})
        out: dict[str, Any] = {"conversations": conv}
        if c.get("system") in obj:
            out["system"] = obj[c["system"]]
        return out

    def field_name(self, canonical: str) -> str:
        """The user's name of a canonical field (`instruction` -> `question`), for error messages."""
        if self.formatting == "alpaca":
            back = {canon: self.columns[key] for key, canon in ALPACA_COLUMNS.items() if key in self.columns}
            head, dot, rest = canonical.partition("[")
            return back.get(head, head) + (dot + rest if dot else "")
        if self.formatting == "sharegpt":
            head, dot, rest = canonical.partition("[")
            msgs = self.columns["messages"]
            rest = rest.replace("].from", f"].{self.tags['role_tag']}").replace("].value", f"].{self.tags['content_tag']}")
            return (msgs if head == "conversations" else self.columns.get(head, head)) + (dot + rest if dot else "")
        return canonical


def _is_path(entry: str) -> bool:
    return entry.endswith((".json", ".jsonl")) or "/" in entry or os.sep in entry or Path(entry).is_file()


def load_info(dataset_dir: str | Path) -> dict:
    path = Path(dataset_dir) / "dataset_info.json"
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{path} not found: dataset names are looked up there (LLaMA-Factory's dataset_info.json); "
                        "set dataset_dir to the folder that holds it, or give files (dataset: a.json,b.jsonl)") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None
    if not isinstance(info, dict):
        raise DataError(f"{path}: must map dataset names to entries, got {type(info).__name__}")
    return info


def from_entry(name: str, entry: Any, dataset_dir: Path, cache_dir: str) -> Source:
    where = f"{dataset_dir / 'dataset_info.json'}: '{name}'"
    if not isinstance(entry, dict):
        raise DataError(f"{where}: must be an object with file_name or hf_hub_url")
    for key, instead in UNSUPPORTED.items():
        if entry.get(key) and not (key in ("ms_hub_url", "om_hub_url") and (entry.get("file_name") or entry.get("hf_hub_url"))):
            raise DataError(f"{where}: {key} is not supported: {instead}")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in ("alpaca", "sharegpt"):
        raise DataError(f"{where}: formatting {formatting!r} is not supported; use alpaca or sharegpt")
    columns, tags = entry.get("columns") or {}, entry.get("tags") or {}
    if not isinstance(columns, dict) or not isinstance(tags, dict):
        raise DataError(f"{where}: columns and tags must be objects")
    defaults = ALPACA_COLUMNS if formatting == "alpaca" else SHAREGPT_COLUMNS
    unknown = [k for k in columns if k not in defaults and k not in UNUSED_COLUMNS]
    if unknown:
        raise DataError(f"{where}: columns {unknown} are not {formatting} columns ({', '.join(defaults)})")
    used = [k for k in columns if k in UNUSED_COLUMNS]
    if used:
        raise DataError(f"{where}: columns {used} (tools, images, preference pairs) are not supported: tuneledger "
                        "trains text-only SFT; list a text dataset")
    bad_tags = [k for k in tags if k not in SHAREGPT_TAGS]
    if bad_tags:
        raise DataError(f"{where}: tags {bad_tags} unknown; sharegpt tags are {', '.join(SHAREGPT_TAGS)}")
    if entry.get("file_name"):
        path = dataset_dir / entry["file_name"]
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".jsonl"))
            if not files:
                raise DataError(f"{where}: folder {path} holds no .json/.jsonl file")
        elif path.is_file():
            files = [path]
        else:
            raise DataError(f"{where}: file {path} not found")
    elif entry.get("hf_hub_url"):
        files = [hub_file(name, entry, cache_dir, where)]
    else:
        raise DataError(f"{where}: has neither file_name nor hf_hub_url")
    # Only the columns the entry names change; every default is spelled out so the cache key and the
    # error messages see the whole mapping.
    full_columns = {k: v for k, v in {**defaults, **columns}.items() if v}
    full_tags = {**SHAREGPT_TAGS, **tags} if formatting == "sharegpt" else {}
    return Source(name, files, formatting, full_columns, full_tags)


def hub_file(name: str, entry: dict, cache_dir: str, where: str) -> Path:
    """Download a hub dataset (hf_hub_url, subset, split) once into cache_dir as JSONL; DataError when offline."""
    url, subset, split = entry["hf_hub_url"], entry.get("subset"), entry.get("split", "train")
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in f"{url}-{subset or ''}-{split}")
    out = Path(cache_dir) / "hub-datasets" / f"{safe}.jsonl"
    if out.is_file():
        return out
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    fix = (f"download it where there is a network (datasets.load_dataset({url!r}).to_json(...)), put the file in "
           f"the dataset folder and give the entry a file_name")
    if os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "YES") or os.environ.get("HF_DATASETS_OFFLINE") in ("1", "true", "YES"):
        raise DataError(f"{where}: hub dataset {url} cannot be downloaded: offline mode (HF_HUB_OFFLINE / "
                        f"HF_DATASETS_OFFLINE is set). {fix}")
    try:  # one short request first, so no network fails in seconds, not after the library's retries
        from huggingface_hub import HfApi

        HfApi(endpoint=endpoint).dataset_info(url, timeout=10)
    except Exception as e:
        raise DataError(f"{where}: hub dataset {url} cannot be reached at {endpoint}: {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}. {fix}") from None
    import datasets

    ds = datasets.load_dataset(url, subset, split=split)
    tmp = out.with_name(out.name + ".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    ds.to_json(str(tmp), force_ascii=False)
    tmp.rename(out)
    return out


def resolve_sources(entries: list[str], dataset_dir: str | Path, cache_dir: str) -> list[Source]:
    """Each `dataset` entry as a Source: a file path as it is, a name through dataset_info.json.

    Raises DataError naming the entry: a missing file, an unknown name (with the close ones), an
    entry that asks for something not supported, or a hub dataset that cannot be reached.
    """
    dataset_dir = Path(dataset_dir)
    out, info = [], None
    for entry in entries:
        if _is_path(entry):
            p = Path(entry)
            if p.is_dir():
                raise DataError(f"dataset {p} is a directory; list its .json/.jsonl files (dataset: a.json,b.jsonl)")
            if not p.is_file():
                raise DataError(f"dataset file {p} not found (dataset: {', '.join(entries)})")
            out.append(Source(entry, [p]))
            continue
        if info is None:
            info = load_info(dataset_dir)
        if entry not in info:
            close = difflib.get_close_matches(entry, list(info), n=3, cutoff=0.6)
            raise DataError(f"dataset '{entry}' is neither a file nor a name in {dataset_dir / 'dataset_info.json'}"
                            + (f"; close names there: {', '.join(close)}" if close else f" ({len(info)} names there)"))
        out.append(from_entry(entry, info[entry], dataset_dir, cache_dir))
    return out
