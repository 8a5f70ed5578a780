"""Print the blocks of a pip-compile lock whose package names pass a filter, hashes and all.

    python lockfilter.py --keep pip requirements.txt            # only pip's block
    python lockfilter.py --drop 'torch|nvidia-.*-cu12' requirements.txt

A block is a `name==version \\` line with its `--hash` continuation lines; comments are dropped.
Patterns are regular expressions matched against the whole normalised name (PEP 503). Used by
docker/install.sh to install the lock without the torch build it replaces.
"""

from __future__ import annotations

import argparse
import re
import sys


def blocks(text: str) -> list[tuple[str, str]]:
    """(normalised name, block text) for every requirement in a pip-compile lock."""
    out: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line[0].isspace():
            if not out:
                raise ValueError(f"continuation line before any requirement: {line!r}")
            out[-1][1].append(line)
            continue
        name = re.split(r"[=<>!~ ;@\[]", line, maxsplit=1)[0]
        out.append((re.sub(r"[-_.]+", "-", name).lower(), [line]))
    return [(name, "\n".join(lines)) for name, lines in out]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--keep", metavar="REGEX", help="print only these packages")
    group.add_argument("--drop", metavar="REGEX", help="print all but these packages")
    ap.add_argument("lock")
    args = ap.parse_args(argv)
    pattern = re.compile(args.keep or args.drop)
    with open(args.lock, encoding="utf-8") as f:
        found = blocks(f.read())
    chosen = [b for name, b in found if bool(pattern.fullmatch(name)) == bool(args.keep)]
    if args.keep and not chosen:
        print(f"lockfilter: no package in {args.lock} matches {args.keep!r}", file=sys.stderr)
        return 1
    # A continuation line ends with "\"; the last line of a block does not.
    sys.stdout.write("".join(b + "\n" for b in chosen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
