"""The environment variables behind make bench's A/B rows, checked by the launcher (dryrun, train,
tune) before any rank starts: a value none of them reads is one sentence and exit 2 there, not a
traceback per rank after every model load, nor a run that silently ignores it. An empty value is
the same as unset (the default). Each variable is read where it acts (the module named below);
the ledger's levers line says how every row ran. TUNELEDGER_PROFILE_STEP has its own check
(profile_step.py), run here too.
"""

from __future__ import annotations

import os

from tuneledger.config import ConfigError

# variable: (accepted values, what each does, where it is read)
CHOICES = {
    "TUNELEDGER_ADDMM": (("inplace", "copy"), "inplace: the LoRA term added into the GEMM's output (the default); "
                         "copy: out of place", "fused_lora.py"),
    "TUNELEDGER_LIGER_BACKWARD": (("liger",), "liger: Liger's own fused cross-entropy backward (unset: ours, "
                                  "without its host syncs)", "liger_backward.py"),
    "TUNELEDGER_TRAIN_WALK": (("every",), "every: Trainer's model.train() walks every module at every micro-batch "
                              "(unset: only when a module left training mode)", "train_mode.py"),
    "TUNELEDGER_CUDAGRAPHS": (("0", "1"), "1: compiled layers as CUDA graphs", "compiled.py"),
    "TUNELEDGER_DEQUANT": (("graph",), "graph: NF4 dequantized in the compiled graph", "compiled.py"),
    "TUNELEDGER_CHECKPOINT_OUTSIDE": (("0", "1"), "1: transformers' checkpoint around the compiled layers",
                                      "compiled.py"),
    "TUNELEDGER_CHECKPOINT_POLICY": (("prefer",), "prefer: the partitioner may save instead of recompute",
                                     "compiled.py"),
    "TUNELEDGER_CUDNN_SDPA": (("0", "1"), "1: cuDNN's SDPA kernels allowed", "speed.py"),
}


def value(name: str) -> str:
    """The variable's value, stripped; "" when unset or empty (the default)."""
    return os.environ.get(name, "").strip()


def check() -> None:
    """Raise ConfigError naming the first variable of CHOICES (or TUNELEDGER_PROFILE_STEP) whose
    value is set, not empty, and not one it accepts."""
    from tuneledger import profile_step

    for name, (accepted, what, _) in CHOICES.items():
        v = value(name)
        if v and v not in accepted:
            raise ConfigError(f"{name}={v!r}: use {' or '.join(accepted)} ({what}), or unset it")
    profile_step.requested()
