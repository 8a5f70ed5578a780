"""Silence library messages that tell a tuneledger user nothing, at their source (logging filters).

Each entry says why it carries no information here. Everything else the libraries log still shows.
"""

from __future__ import annotations

import logging
import os
import sys

# logger name -> message prefixes dropped from it
DROPPED = {
    # bitsandbytes' CPU backend tries a hub kernel for 4-bit matmuls at import, per process. tuneledger
    # never runs 4-bit on a CPU (quantization needs CUDA), so the failure changes nothing.
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
}


class _Drop(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def no_bars_off_a_terminal() -> None:
    """No progress bars when stderr (where tqdm draws) is not a terminal: in a log file or a pipe
    (`make dryrun > log`, `| tee`) each redraw's carriage return left every state of the bar on
    one line (`tokenizing 500 records: 0%| ... 13%| ... 100%|`). TQDM_DISABLE is read when tqdm is
    imported, so this must run before the libraries load; it reaches the ranks (they inherit the
    environment) and datasets' and the hub's bars too (both are tqdm's, and pass no `disable`).
    A value the user set stands."""
    if not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")


def install() -> None:
    """Add the filters (idempotent). Call before the libraries are imported: some log at import."""
    for name, prefixes in DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(prefixes))


def quiet_worker_progress() -> None:
    """No 'Loading weights' bar per rank: with every rank drawing one through the launcher's pipe,
    each redraw became a line of its own. The launcher says which model it loads."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
