"""The `tuneledger` command: one subcommand per verb, each in its own module.

Every verb module exposes `add_parser(subparsers)` which registers its subcommand and sets
`func` to a callable taking the parsed args and returning an exit code. Imports of torch and
friends happen inside the verbs, so `tuneledger --help` and config errors answer in well under a
second.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tuneledger import __version__

# Exit codes (docs/runs-and-output.md): 2 for bad input, whichever part of it is bad: the command
# line, the config (a key, a value) or the data (a file that cannot be read, too many invalid
# records). 1 is a check of the machine or the model that failed, or a run that failed.
BAD_INPUT = 2

# Module names under tuneledger/, in the order `--help` lists them (a package's verb is its .cli).
VERBS = ["stats", "dryrun", "tune", "train", "synth", "gguf_import", "preflight", "export", "quantize", "chat", "evaluate", "monitor.cli", "gpus", "whatif"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tuneledger",
        description="Measure before you train: token stats, dry-runs with a ledger, DDP LoRA/QLoRA training.",
    )
    parser.add_argument("--version", action="version", version=f"tuneledger {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for name in VERBS:
        try:
            module = importlib.import_module(f"tuneledger.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"tuneledger.{name}":
                continue  # verb not built yet
            raise
        module.add_parser(sub)
    for verb in sub.choices.values():
        for action in verb._actions:
            if type(action) is argparse._StoreAction and action.option_strings:
                action.__class__ = StoreOnce
    return parser


class StoreOnce(argparse._StoreAction):
    """An option that takes a value (`--gpus 8x4090-pcie`), given twice with different values: the
    last one is used, as argparse does, but said (a `key=value` given twice is said alike:
    config_load.parse_overrides). build_parser makes every such option of every verb one of these
    (`--preset` twice is refused: config_load). Which options were given rides on the namespace as
    `_given`, dropped after parsing (main)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault("_given", {})
        if self.dest in given and given[self.dest] != values:
            print(f"note: {option_string} is given twice on the command line ({given[self.dest]!r}, then {values!r}): "
                  "the last one is used", file=sys.stderr)
        given[self.dest] = values
        setattr(namespace, self.dest, values)


def merge_preset(args: argparse.Namespace) -> None:
    """`--preset D` and `preset=D` mean the same in every verb that takes a preset: the verb reads
    args.preset, and for one preset the config sees the override preset=D. Raises ConfigError."""
    if not (hasattr(args, "preset") and hasattr(args, "items")):
        return
    from tuneledger.config_load import preset_from_cli

    items, args.preset = preset_from_cli(list(args.items), args.preset, getattr(args, "preset_all", False))
    args.items = items + ([f"preset={args.preset}"] if args.preset and args.preset != "ALL" else [])


def announce_template(args: argparse.Namespace) -> None:
    """The `template:` line (templateinfo) at the start of stats, dryrun and train, read from the
    model folder's files without loading the tokenizer; nothing for a model that is not a local
    folder (a hub id: its template is known once the verb downloads it). Raises ConfigError."""
    if args.verb not in ("stats", "dryrun", "train") or not hasattr(args, "items"):
        return
    from pathlib import Path

    from tuneledger.config_load import from_cli
    from tuneledger.templateinfo import local_chat_template, template_line

    cfg = from_cli(list(args.items))
    if Path(cfg.model_name_or_path).is_dir():
        line = template_line(cfg.template, local_chat_template(cfg.model_name_or_path), cfg.model_name_or_path)
        print(line, file=sys.stderr, flush=True)


def _glue_dashed_values(argv: list[str]) -> list[str]:
    """`--budget -5m` as `--budget=-5m`: argparse takes a value that starts with '-' (and is not a
    plain number) for an option and answers "expected one argument"; glued, the option's own
    check names what is wrong with the value. Only for a value that starts with '-' and a digit."""
    out: list[str] = []
    for tok in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and len(tok) > 1 and tok[0] == "-" and tok[1].isdigit():
            out[-1] = f"{out[-1]}={tok}"
        else:
            out.append(tok)
    return out


def main(argv: list[str] | None = None) -> int:
    import os

    # transformers' Trainer imports torch inductor, which starts a pool of compile-worker processes
    # at import (torch 2.5: TORCH_WARM_POOL). Nothing here compiles; the pool cost start-up CPU and
    # held the command's exit for seconds (tens on a loaded 2-core machine). A compile still works.
    os.environ.setdefault("TORCH_WARM_POOL", "0")
    from tuneledger import quiet

    quiet.no_bars_off_a_terminal()  # before the imports below: tqdm reads it at its import
    from tuneledger.config import ConfigError
    from tuneledger.model import PreflightError

    quiet.install()
    parser = build_parser()
    # The config file and `key=value` overrides may come before or after the options (`dryrun
    # --preset all cfg.yaml lora_rank=8`); argparse stops collecting positionals at the first
    # option, so collect the rest.
    args, extra = parser.parse_known_args(_glue_dashed_values(sys.argv[1:] if argv is None else argv))
    stray = [e for e in extra if e.startswith("-") or not ("=" in e or e.endswith((".yaml", ".yml")))]
    if stray or (extra and not hasattr(args, "items")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    vars(args).pop("_given", None)
    if extra:
        args.items = list(args.items) + extra
    if not getattr(args, "func", None):
        parser.print_help()
        return BAD_INPUT
    try:
        merge_preset(args)
        announce_template(args)
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"tuneledger {args.verb}: config error: {e}", file=sys.stderr)
        return BAD_INPUT
    except PreflightError as e:  # e.g. model.locate_model, which each verb calls before anything heavy
        print(f"tuneledger {args.verb}: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 1)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        from tuneledger.files import disk_full

        if disk_full(e):
            # A full disk at any file operation (a lock, a job file, a ledger, safetensors' or a
            # tokenizer's own writes, which raise their own types) is the user's to fix: one line
            # naming it, not a traceback. Saves name their checkpoint (guards.DiskFullError).
            where = getattr(e, "filename", None)
            print(f"tuneledger {args.verb}: disk full: {e}. Free space{f' on the filesystem of {where}' if where else ''} "
                  "(`df -h`), then run the same command again", file=sys.stderr)
            return 1
        # A DataError can only come from tuneledger.data once imported; importing it here would
        # load numpy and the tokenizer code for `--help` and config errors too.
        data = sys.modules.get("tuneledger.data")
        if data is None or not isinstance(e, data.DataError):
            raise
        print(f"tuneledger {args.verb}: {e}", file=sys.stderr)
        return BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
