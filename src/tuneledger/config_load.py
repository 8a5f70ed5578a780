"""Reading a job config: YAML file -> preset -> `key=value` overrides -> a validated `JobConfig`.

Precedence, lowest first: the YAML file, then the preset (`preset: C`), then command-line
`key=value` overrides. A key that is not a JobConfig field is judged by llamafactory.py
(LLaMA-Factory's keys: implemented, ignored with the reason, or refused naming what to use
instead); every problem of a config is reported at once. The schema itself is config.py.
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tuneledger import llamafactory
from tuneledger.config import FIELDS, PRESETS, ConfigError, JobConfig
from tuneledger.llamafactory_use import benchmark_eval
from tuneledger.words import plural
from tuneledger.yaml_strict import DuplicateKey, StrictLoader


def _is_text(annotation: Any) -> bool:
    """True for str, str | None and Literal["a", "b"] fields: their values are taken verbatim."""
    import typing

    if annotation is str:
        return True
    if typing.get_origin(annotation) is typing.Literal:
        return all(isinstance(a, str) for a in typing.get_args(annotation))
    import types

    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return False  # dict[str, str], list[str], int, ...
    args = typing.get_args(annotation)
    return all(a is type(None) or _is_text(a) for a in args) and any(a is not type(None) for a in args)


def _value(key: str, raw: str) -> Any:
    field = JobConfig.model_fields.get(key)
    if field is not None and _is_text(field.annotation):
        # run_name=2024-01-01 or default_system=no are text, not a date or a boolean.
        return None if raw in ("", "null", "~") and type(None) in getattr(field.annotation, "__args__", ()) else raw
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {key}={raw!r}: not a valid value: {str(e).splitlines()[0]}") from None
    if isinstance(value, str):
        try:  # YAML 1.1 reads 1e-4 (no dot) as a string; users mean a number
            value = float(value)
        except ValueError:
            pass
    return value


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """Parse `key=value` strings. Text fields take the value verbatim; others read it as YAML
    (`1e-4`, `true`, `[a, b]`). `key.sub=value` sets one entry of a mapping field, so
    `placeholders.name=Ledgerly` needs no quoting in a shell or a Makefile.
    """
    out: dict[str, Any] = {}
    given: dict[str, list[str]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value")
        given.setdefault(key, []).append(raw)
        if "." in key:
            top, sub = key.split(".", 1)
            entry = out.setdefault(top, {})
            if not isinstance(entry, dict):
                raise ConfigError(f"override {item!r}: {top} was already set to {entry!r}")
            entry[sub] = raw
        else:
            out[key] = _value(key, raw)
    for key, raws in given.items():
        if len(set(raws)) > 1:
            # The last wins (make's variables come before ARGS, so ARGS can override them), but a key
            # typed twice with two values is often a slip: say which value is used, once per key.
            times = "twice" if len(raws) == 2 else f"{len(raws)} times"
            _note_once(f"note: {key} is given {times} on the command line ({', then '.join(repr(r) for r in raws)}): "
                       "the last one is used")
    return out


_NOTED: set[str] = set()


def _note_once(line: str) -> None:
    """`line` on stderr, once per process (a dry-run loads the config once per preset)."""
    if line not in _NOTED:
        _NOTED.add(line)
        print(line, file=sys.stderr, flush=True)


def suggest(key: str) -> str | None:
    """The one known key `key` is a close misspelling of, or None.

    Never a key of the other split: a key that names eval gets only eval keys, any other key gets
    none (`per_device_batch_size` means the training micro-batch, not the eval one).
    """
    pool = sorted(k for k in FIELDS if ("eval" in k) == ("eval" in key))
    close = difflib.get_close_matches(key, pool, n=1, cutoff=0.75)
    return close[0] if close else None


# Printed once per process: the verbs build a config more than once (dryrun: once per preset).
_ANNOUNCED: set[str] = set()


def screen_keys(raw: dict[str, Any], where: str, lines: dict[str, int] | None = None) -> tuple[dict, list[str], list[str]]:
    """Sort a config's keys: our fields (kept), LLaMA-Factory keys (see llamafactory.py), unknown.

    Returns (the fields to validate, one with any LLaMA-Factory alias applied; the ignored keys,
    each "key: why"; the problems, each naming the key, its line when known, and the fix).
    """
    keep, ignored, problems = {}, [], []
    for key, value in raw.items():
        at = f"{where}:{lines[key]}" if lines and key in lines else where
        if key in FIELDS:
            keep[key] = value
            continue
        verdict = llamafactory.classify(key, value)
        if verdict is None:
            close = suggest(key)
            problems.append(f"{at}: unknown key '{key}'." + (f" Did you mean '{close}'?" if close else ""))
        elif verdict.status == "implemented":
            keep.update(verdict.updates)
        elif verdict.status == "ignored":
            ignored.append(f"{key}: {verdict.text}")
        else:
            problems.append(f"{at}: {key}: {value!r} is not supported: {refusal_text(key, verdict.text)}")
    return keep, ignored, problems


def refusal_text(key: str, text: str) -> str:
    """A refusal's reason without its own opening "<key> ... is not supported": the line already
    says that once ("use_unsloth: True is not supported: ...")."""
    import re

    return re.sub(rf"^{re.escape(key)}\b[^:;]*? is not supported[:;,]?\s*", "", text) or text


def key_lines(path: Path) -> dict[str, int]:
    """Line (1-based) of each top-level key of a YAML mapping file; {} when it cannot be parsed."""
    try:
        node = yaml.compose(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, OSError):
        return {}
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {k.value: k.start_mark.line + 1 for k, _ in node.value if isinstance(k, yaml.ScalarNode)}


def read_yaml_mapping(path: str | Path, what: str) -> dict[str, Any]:
    """A YAML file whose top level is a mapping. Raises ConfigError naming the file (and line:
    invalid YAML, a key given twice in one mapping)."""
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=StrictLoader) or {}
    except FileNotFoundError:
        raise ConfigError(f"{what} file {path} not found") from None
    except DuplicateKey as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of key: value")
    return raw


def load_config(path: str | Path | None, overrides: list[str] | dict[str, Any] = ()) -> JobConfig:
    """Load a YAML job config, apply its preset and the overrides, and validate.

    Raises ConfigError naming the file and key for unknown keys, bad values or a bad preset.
    World-size-dependent numbers are resolved later by `resolve()`.
    """
    raw = read_yaml_mapping(path, "config") if path is not None else {}
    where = str(path) if path is not None else "command line"
    if benchmark_eval(raw):  # `task: mmlu_test`: one sentence, not a list of unknown keys
        raise ConfigError(f"{where}: {benchmark_eval(raw)}")
    over = parse_overrides(list(overrides)) if not isinstance(overrides, dict) else dict(overrides)
    # Every problem of the file and the overrides is reported at once, not one per run.
    lines = key_lines(Path(path)) if path is not None else {}
    raw, ignored, problems = screen_keys(raw, where, lines)
    over, ignored_over, problems_over = screen_keys(over, "command-line overrides")
    ignored, problems = ignored + ignored_over, problems + problems_over

    merged = dict(raw)
    preset = over.get("preset", raw.get("preset"))
    if preset is not None:
        preset = str(preset).upper()
        if preset not in PRESETS:
            problems.append(f"unknown preset '{preset}' (from {where} or overrides); choose one of {', '.join(PRESETS)}")
        else:
            merged.update(PRESETS[preset])
            merged["preset"] = preset
    for k, v in over.items():
        if k != "preset":
            # placeholders.name=X on the command line adds to the file's placeholders.
            merged[k] = {**merged[k], **v} if isinstance(v, dict) and isinstance(merged.get(k), dict) else v
    try:
        cfg = JobConfig(**{k: v for k, v in merged.items() if not (k == "preset" and problems)})
    except ValidationError as e:
        for err in e.errors():
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "bool_parsing":  # pydantic says what it could not read, not what it takes
                msg += ": use true or false (also yes/no, on/off, 1/0)"
            if not err["loc"]:
                problems.append(msg)
                continue
            key = str(err["loc"][0])
            at = "command-line overrides" if key in over else f"{where}:{lines[key]}" if key in lines else where
            if err["type"] == "missing":  # pydantic's input is then the whole merged config: defaults the user never gave
                problems.append(f"{at}: {key}: missing: give a config file (e.g. configs/tiny.yaml) or {key}=...")
                continue
            problems.append(f"{at}: {'.'.join(map(str, err['loc']))}: {msg} (got {err.get('input')!r})")
    if problems:
        head = f"{len(problems)} problem{'s' if len(problems) > 1 else ''} in {where} + overrides"
        raise ConfigError(f"{head}:\n  " + "\n  ".join(problems))
    text = "\n  ".join(ignored)
    if ignored and text not in _ANNOUNCED:
        _ANNOUNCED.add(text)
        print(f"config: {plural(len(ignored), 'LLaMA-Factory key')} accepted and ignored (they do not apply here; "
              f"docs/llamafactory-keys.md):\n  {text}", file=sys.stderr, flush=True)
    return cfg


def from_cli(items: list[str], default: str | None = None) -> JobConfig:
    """`[CONFIG.yaml] [key=value ...]` from a command line: the first item without '=' is the file."""
    files = [i for i in items if "=" not in i]
    if len(files) > 1:
        raise ConfigError(f"one config file expected, got {files}")
    return load_config(files[0] if files else default, [i for i in items if "=" in i])


def preset_from_cli(items: list[str], option: str | None, allow_all: bool = False) -> tuple[list[str], str | None]:
    """`--preset D` and `preset=D` are one setting in every verb that takes a preset.

    Returns (items without `preset=...`, the preset upper-cased, or None when neither is given).
    Raises ConfigError when the two forms disagree, for an unknown preset, and for `all` where
    the verb runs one preset (only the dry-run measures them all).
    """
    given = [i.partition("=")[2].strip() for i in items if i.partition("=")[0].strip() == "preset"]
    if option:
        given.append(option)
    wanted = sorted({g.upper() for g in given if g})
    if len(wanted) > 1:
        how = "--preset and preset=" if option and len(given) > 1 else "preset= more than once"
        raise ConfigError(f"presets {' and '.join(wanted)} both given ({how}); give one")
    preset = wanted[0] if wanted else None
    if preset == "ALL" and not allow_all:
        raise ConfigError(f"preset all runs every preset, which only dryrun does; choose one of {', '.join(PRESETS)}")
    if preset is not None and preset != "ALL" and preset not in PRESETS:
        raise ConfigError(f"unknown preset '{preset}'; choose one of {', '.join(PRESETS)}{' or all' if allow_all else ''}")
    return [i for i in items if i.partition("=")[0].strip() != "preset"], preset


def add_preset_option(parser: Any, allow_all: bool = False) -> None:
    """`--preset X` on a verb's parser; cli.main merges it with `preset=X` (preset_from_cli)."""
    def preset(value: str) -> str:  # argparse's own choices message would list 'ALL', as no user types it
        import argparse

        v = value.upper()
        if v in PRESETS or (allow_all and v == "ALL"):
            return v
        raise argparse.ArgumentTypeError(f"unknown preset '{value}'; choose one of {', '.join(PRESETS)}"
                                         + (" or all" if allow_all else ""))

    import argparse

    class Once(argparse.Action):
        # `--preset A --preset B` took B silently, where `preset=A preset=B` is refused: refused alike.
        def __call__(self, parser, namespace, value, option_string=None):
            before = getattr(namespace, self.dest, None)
            if before is not None and before != value:
                parser.error(f"presets {before} and {value} both given (--preset more than once); give one")
            setattr(namespace, self.dest, value)

    parser.add_argument("--preset", type=preset, action=Once,
                        metavar="{" + ",".join(PRESETS) + (",all}" if allow_all else "}"),
                        help="one preset, or all of them ranked (default: the config's preset)" if allow_all
                        else "the preset (same as preset=X; default: the config's)")
    parser.set_defaults(preset_all=allow_all)
