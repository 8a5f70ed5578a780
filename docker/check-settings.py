"""Check that every setting has one default: Dockerfile and Dockerfile.quant ARGs, docker-compose.yml, .env.example.

Run by `make lint`. Fails when docker-compose.yml reads a variable that .env.example does not
document, or when a default differs between the three files (e.g. a new flash-attn wheel in the
Dockerfile but the old one in compose).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# Build args that compose fills from a differently named setting.
COMPOSE_FILES = ("docker-compose.yml", "docker-compose.gpu.yml", "docker-compose.cdi.yml")
ARG_FROM_SETTING = {"USER_UID": "HOST_UID", "USER_GID": "HOST_GID",
                    "PYTHON": "IMAGE_PYTHON", "PYTHON_APT_PACKAGES": "IMAGE_PYTHON_APT_PACKAGES"}


def main(root: Path) -> int:
    args = {m[1]: m[2].strip('"') for f in ("Dockerfile", "Dockerfile.quant")
            for m in re.finditer(r"^ARG (\w+)=(.*)$", (root / f).read_text(), re.M)}
    compose = {m[1]: m[2] for m in re.finditer(r"\$\{(\w+):?-([^}]*)\}", "".join((root / f).read_text() for f in COMPOSE_FILES))}
    # A setting is a line NAME=value; "# NAME=value" documents one that is unset by default (make
    # or compose fills it). Quotes around a value are .env syntax, not part of it.
    env = {m[1]: m[2].strip('"') for m in re.finditer(r"^(?:# )?([A-Z][A-Z0-9_]*)=(.*)$", (root / ".env.example").read_text(), re.M)}
    problems = [f"docker-compose.yml reads {name}, which .env.example does not document"
                for name in compose if name not in env]
    for name, value in compose.items():
        if name in env and env[name] != value:
            problems.append(f"{name}: .env.example says {env[name]!r}, docker-compose.yml defaults to {value!r}")
    for arg, value in args.items():
        setting = ARG_FROM_SETTING.get(arg, arg)
        if setting in env and env[setting] != value:
            problems.append(f"{setting}: .env.example says {env[setting]!r}, a Dockerfile's ARG {arg} defaults to {value!r}")
    for p in problems:
        print(f"check-settings: {p}", file=sys.stderr)
    if not problems:
        print(f"check-settings: {len(env)} settings, one default each in Dockerfile, Dockerfile.quant, docker-compose.yml, .env.example")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")))
