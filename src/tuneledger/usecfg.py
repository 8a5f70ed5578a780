"""The command line of the verbs that use a trained model: export, chat and eval.

    tuneledger export|chat|eval RUN [key=value ...]
    tuneledger export|chat|eval CONFIG.yaml [key=value ...]

RUN is a run name (runs/RUN) or a folder (run, checkpoint-N, export). CONFIG.yaml is a LLaMA-Factory
merge, inference or predict yaml (model_name_or_path + adapter_name_or_path, ...) or a training
config, whose run (output_dir, else runs/<run_name>) is the one used. Its keys, and `key=value`
after it, are judged per verb by llamafactory_use (read, ignored with the reason, or refused naming
what to use instead); every problem is reported at once, as for training configs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuneledger.config import FIELDS, ConfigError
from tuneledger.config_load import key_lines, parse_overrides, read_yaml_mapping, suggest
from tuneledger.words import plural

_ANNOUNCED: set[str] = set()


@dataclass
class Use:
    """What a verb reads from its command line. `run`: the adapter, run or export folder to use
    (None: the model `base` alone); `base`: the model under the adapter (None: the run's own record);
    `keys`: every key read, by LLaMA-Factory name, overrides applied; `job`: JobConfig fields (eval)."""

    verb: str
    where: str  # the config file, or "command line"
    run: str | None
    base: str | None
    keys: dict[str, Any] = field(default_factory=dict)
    job: dict[str, Any] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)

    def get(self, key: str, default: Any = None) -> Any:
        value = self.keys.get(key)
        return default if value is None else value


def is_config(item: str) -> bool:
    return item.endswith((".yaml", ".yml")) and not Path(item).is_dir()


def resolve_use(verb: str, items: list[str]) -> Use:
    """`[RUN | CONFIG.yaml] [key=value ...]` of export, chat or eval -> Use.

    Raises ConfigError naming the file, the key (and its line) and what to do: for refused and
    unknown keys, a benchmark eval config, more than one RUN/CONFIG, and nothing to load.
    """
    from tuneledger.llamafactory_use import benchmark_eval, classify_use

    files = [i for i in items if "=" not in i]
    if len(files) > 1:
        raise ConfigError(f"one RUN or CONFIG.yaml expected, got {files}")
    first = files[0] if files else None
    config = first if first is not None and is_config(first) else None
    raw = read_yaml_mapping(config, "config") if config else {}
    where = config or "command line"
    bench = benchmark_eval(raw)
    if bench:
        raise ConfigError(f"{where}: {bench}")
    lines = key_lines(Path(config)) if config else {}
    over = parse_overrides([i for i in items if "=" in i])
    keys, ignored, problems = {}, [], []
    for source, values in ((where, raw), ("command-line overrides", over)):
        for key, value in values.items():
            at = f"{source}:{lines[key]}" if source == where and key in lines else source
            verdict = classify_use(verb, key, value, FIELDS)
            if verdict is None:
                close = suggest(key)
                problems.append(f"{at}: unknown key '{key}'." + (f" Did you mean '{close}'?" if close else ""))
            elif verdict.status == "refused":
                problems.append(f"{at}: {key}: {value!r} is not supported by `tuneledger {verb}`: {verdict.text}")
            elif verdict.status == "ignored":
                if value is not None:  # `quantization_bit: null` asks for nothing: nothing to report
                    ignored.append(f"{key}: {verdict.text}")
                keys.pop(key, None)
            else:
                keys[key] = value
                keys.update(verdict.updates)
    if problems:
        head = f"{len(problems)} problem{'s' if len(problems) > 1 else ''} in {where} + overrides"
        raise ConfigError(f"{head}:\n  " + "\n  ".join(problems))
    base = keys.get("model_name_or_path")
    if config is None:
        run = first
    elif keys.get("adapter_name_or_path"):
        run = str(keys["adapter_name_or_path"])
    elif "dataset" in raw:  # a training config: the run it trains; its base is the run's own record
        run = str(keys.get("output_dir") or f"runs/{keys.get('run_name') or 'run'}")
        base = over.get("model_name_or_path")
    else:
        run = None
    if config is not None and run is not None and not (Path(run).exists() or (len(Path(run).parts) == 1 and (Path("runs") / run).exists())):
        key = "adapter_name_or_path" if keys.get("adapter_name_or_path") else ("output_dir" if keys.get("output_dir") else "run_name")
        at = f"{where}:{lines[key]}" if key in lines else where
        raise ConfigError(f"{at}: {key}: {run} does not exist" + (
            "; point adapter_name_or_path at a run folder or one of its checkpoint-N folders"
            if key == "adapter_name_or_path" else "; this config's run has not been trained yet (tuneledger train it)"))
    if run is None and not base:
        raise ConfigError(f"{where}: nothing to load: give adapter_name_or_path (the adapter) with model_name_or_path "
                          "(its base), or a RUN (runs/RUN or a folder)")
    training = [i for i in ignored if ": a training setting: " in i]
    # A training config's own settings are the run's, which the verb reads from the run's record:
    # listing them would only repeat the config back. An LF merge/inference yaml's are worth a line.
    shown = [i for i in ignored if i not in training] + (
        [f"{plural(len(training), 'training setting')} ({', '.join(i.split(':')[0] for i in training[:4])}"
         f"{', ...' if len(training) > 4 else ''}): {verb} uses the model as it was trained"] if training and "dataset" not in raw else [])
    text = "\n  ".join(shown)
    if shown and text not in _ANNOUNCED:
        _ANNOUNCED.add(text)
        n = len(ignored) if "dataset" not in raw else len(shown)
        print(f"config: {plural(n, 'key')} accepted and ignored by `tuneledger {verb}` "
              f"(docs/llamafactory-keys.md):\n  {text}", file=sys.stderr, flush=True)
    job = {k: v for k, v in keys.items() if k in FIELDS and k not in ("model_name_or_path", "output_dir", "run_name")}
    return Use(verb, where, run, str(base) if base else None, keys, job, ignored)
