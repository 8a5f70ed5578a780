"""The environment variables behind make bench's A/B rows, checked by the launcher (dryrun, train,
tune) before any rank starts: a value none of them reads is one sentence and exit 2 there, not a
traceback per rank after every model load, nor a run that silently ignores it. An empty value is
the same as unset (the default). Each variable is read where it acts (the module named below);
the ledger's levers line says how every row ran (its `env` entry: `active()`).
TUNELEDGER_PROFILE_STEP has its own check (profile_step.py), run here too, and so do
TUNELEDGER_MEMORY_STEP and TUNELEDGER_SYNC_DEBUG (step numbers). A TUNELEDGER_ name that nothing reads (a misspelt
variable) is warned of, with the name it is closest to: it would change nothing.
"""

from __future__ import annotations

import difflib
import os
import sys

from tuneledger.config import ConfigError

# variable: (accepted values, what each does, where it is read)
CHOICES = {
    "TUNELEDGER_ADDMM": (("inplace", "copy"), "inplace: the LoRA term added into the GEMM's output (the default); "
                         "copy: out of place", "fused_lora.py"),
    "TUNELEDGER_LIGER_BACKWARD": (("liger",), "liger: Liger's own fused cross-entropy backward (unset: ours, "
                                  "without its host syncs)", "liger_backward.py"),
    "TUNELEDGER_TRAIN_WALK": (("every",), "every: Trainer's model.train() walks every module at every micro-batch "
                              "(unset: only when a module left training mode)", "train_mode.py"),
    "TUNELEDGER_NF4_OP": (("custom",), "custom: our NF4 kernel as a plain custom op, not a triton_op", "nf4_kernel.py"),
    "TUNELEDGER_CUDAGRAPHS": (("0", "1"), "1: compiled layers as CUDA graphs", "compiled.py"),
    "TUNELEDGER_DEQUANT": (("graph",), "graph: NF4 dequantized in the compiled graph", "compiled.py"),
    "TUNELEDGER_CHECKPOINT_OUTSIDE": (("0", "1"), "1: transformers' checkpoint around the compiled layers",
                                      "compiled.py"),
    "TUNELEDGER_CHECKPOINT_POLICY": (("prefer",), "prefer: the partitioner may save instead of recompute",
                                     "compiled.py"),
    "TUNELEDGER_CUDNN_SDPA": (("0", "1"), "1: cuDNN's SDPA kernels allowed", "speed.py"),
    "TUNELEDGER_OFFLOAD": (("stream",), "stream: use_unsloth_gc's copies to and from host memory on side streams "
                           "beside the compute, each copied back ahead of its layer's backward", "offload.py"),
    "TUNELEDGER_GUARDS": (("dict-tags", "skip-modules"), "dict-tags: Dynamo's recursive dict tags for the compiled "
                          "layers' guards; skip-modules: no guards on module attributes (unsafe)", "compiled.py"),
}


SYNC_DEBUG = "TUNELEDGER_SYNC_DEBUG"  # a step number: warn at every host sync of that step (probes.SyncDebug)
# Every other TUNELEDGER_ variable something reads (the check's warning is for names outside all of them).
OTHERS = {
    "TUNELEDGER_PROFILE_STEP": "profile_step.py", "TUNELEDGER_MEMORY_STEP": "profile_step.py, memory_step.py", SYNC_DEBUG: "worker.py",
    "TUNELEDGER_GRACE_S": "docker-compose.yml, the seconds a stopped trainer has to save",
    "TUNELEDGER_WRITES": "docker/entrypoint.sh", "TUNELEDGER_BACKOFF_S": "docker/entrypoint.sh",
    "TUNELEDGER_UID": "docker/entrypoint.sh", "TUNELEDGER_GID": "docker/entrypoint.sh",
    "TUNELEDGER_HOST": "nodes.py, the monitor", "TUNELEDGER_IMAGE": "nodes.py",
    "TUNELEDGER_GPU": "the Makefile", "TUNELEDGER_BUILDER": "docker/build", "TUNELEDGER_USE_UNSLOTH": "launch.py, set by the launcher",
    "TUNELEDGER_SHARED": "tests", "TUNELEDGER_REQUIRE_SHARED": "tests", "TUNELEDGER_TEST_TIMEOUT": "tests",
    "TUNELEDGER_TRAINER_PYTHON": "tests", "TUNELEDGER_CRASH_AFTER_STEP": "tests (a rank that crashes)",
}


def value(name: str) -> str:
    """The variable's value, stripped; "" when unset or empty (the default)."""
    return os.environ.get(name, "").strip()


def check() -> None:
    """Raise ConfigError naming the first variable of CHOICES (or a step number: TUNELEDGER_PROFILE_STEP, _MEMORY_STEP, _SYNC_DEBUG) whose
    value is set, not empty, and not one it accepts."""
    from tuneledger import profile_step

    for line in unknown():  # first: a refusal below must not hide a misspelt name beside it
        print(line, file=sys.stderr, flush=True)
    for name, (accepted, what, _) in CHOICES.items():
        v = value(name)
        if v and v not in accepted:
            raise ConfigError(f"{name}={v!r}: use {' or '.join(accepted)} ({what}), or unset it")
    profile_step.requested()
    profile_step.memory_requested()
    sync_debug_step()


def sync_debug_step() -> int | None:
    """TUNELEDGER_SYNC_DEBUG's step, None when unset or empty; raises ConfigError as
    profile_step.step_number."""
    from tuneledger.profile_step import step_number

    return step_number(SYNC_DEBUG, "the optimizer step whose host-device syncs are warned of")


def unknown() -> list[str]:
    """A warning for each TUNELEDGER_ variable set in the environment that nothing reads, with the
    known name it is closest to: a misspelt A/B variable would otherwise leave both rows the same."""
    known = [*CHOICES, *OTHERS]
    out = []
    for name in sorted(n for n in os.environ if (n.startswith("TUNELEDGER_") and n not in known) or _near_prefix(n)):
        cut = len(name.split("_", 1)[0]) + 1  # compared without the prefix that every name shares
        near = difflib.get_close_matches(name[cut:], [k[len("TUNELEDGER_"):] for k in known], n=1, cutoff=0.6)
        out.append(f"warning: {name} is not a variable tuneledger reads, so it changes nothing"
                   + (f" (did you mean TUNELEDGER_{near[0]}?)" if near else f" (the A/B variables: {', '.join(CHOICES)})"))
    return out


def _near_prefix(name: str) -> bool:
    """TUNELEGDER_X, TUNELEDGR_X: a misspelt prefix, which the TUNELEDGER_ scan would not see."""
    head = name.split("_", 1)[0]
    return "_" in name and head != "TUNELEDGER" and difflib.SequenceMatcher(None, head, "TUNELEDGER").ratio() >= 0.8


def active() -> str:
    """The A/B variables set in this environment, as the ledger records them
    ("TUNELEDGER_ADDMM=copy, TUNELEDGER_TRAIN_WALK=every"), or "" when none is."""
    return ", ".join(f"{name}={value(name)}" for name in CHOICES if value(name))
