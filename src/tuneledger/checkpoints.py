"""Checkpoints that can be trusted: a manifest written last, verified before any resume or export.

transformers' Trainer writes checkpoint-N file by file; a kill, a full disk or a crashed rank can
leave any subset of them. After every save, rank 0 writes `tuneledger_manifest.json` last: every
file of the checkpoint with its size in bytes and a content hash (xxh3-128; 0.42 s for 2,000 MiB
on this project's 2-core CI machine, page-cached; a 7B QLoRA checkpoint is about 2 GB), and the
step's health: its loss and grad norm, and the largest |weight| of the adapter. A checkpoint
counts only if its manifest exists, every listed file is there with that size and hash, and its
health is good (finite loss, grad norm and weights, every |weight| <= MAX_ABS_WEIGHT). A
checkpoint that fails is never deleted: before a resume from an older good one it is renamed to
`damaged-checkpoint-N` (outside the Trainer's rotation, which globs `checkpoint-*`), and the
warning names the file or the number that failed.

Finding one is here too: the newest that verifies (`last_checkpoint`), the one with the lowest
eval loss (`best_checkpoint`), and the adapter a run, checkpoint or `checkpoint-best` names
(`find_checkpoint`, for export, chat and eval).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

MANIFEST = "tuneledger_manifest.json"
CONFIG = "tuneledger_config.json"  # the run's resolved config (settings check on resume)
DATA = "tuneledger_data.json"  # sha256 of every data file the checkpoint was trained on
# What a resume needs besides the RNG state: adapter, optimizer, scheduler, step, our settings.
REQUIRED = ("adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "scheduler.pt",
            "trainer_state.json", CONFIG)
DAMAGED_PREFIX = "damaged-"
# LoRA factors start near 1/sqrt(in) (A) and 0 (B) and stay of order 1 when training works; a
# weight 1,000x past that is an update that blew up (learning_rate=1e30 left 1e30), not a model.
MAX_ABS_WEIGHT = 1e3
HASH = "xxh3_128"


def content_hash(path: Path) -> str:
    """xxh3-128 hex digest of a file's bytes (blake2b-128 where xxhash is missing, named so)."""
    try:
        import xxhash

        h, name = xxhash.xxh3_128(), HASH
    except ImportError:
        import hashlib

        h, name = hashlib.blake2b(digest_size=16), "blake2b_128"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return f"{name}:{h.hexdigest()}"


def step_of(path: Path) -> int | None:
    tail = path.name.removeprefix("checkpoint-")
    return int(tail) if path.name.startswith("checkpoint-") and tail.isdigit() else None


def files_of(ckpt: Path) -> dict[str, int]:
    """{relative path: size in bytes} of every file under `ckpt` but the manifest."""
    return {str(f.relative_to(ckpt)): f.stat().st_size for f in sorted(ckpt.rglob("*"))
            if f.is_file() and f.name != MANIFEST}


def write_manifest(ckpt: Path, step: int, health: dict | None = None) -> None:
    """Seal `ckpt`: list every file with its size and content hash, and the step's `health`
    ({"loss", "grad_norm", "max_abs_weight", "finite_weights"}), written to a temporary name and
    renamed, so the manifest itself is whole or absent. Raises ValueError naming a REQUIRED file
    that is missing."""
    sizes = files_of(ckpt)
    missing = [f for f in REQUIRED if f not in sizes]
    if missing:
        raise ValueError(f"{ckpt} is missing {', '.join(missing)}; not sealing it")
    files = {name: {"bytes": n, "hash": content_hash(ckpt / name)} for name, n in sizes.items()}
    tmp = ckpt / (MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"step": step, "files": files, "health": health}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt / MANIFEST)


def unhealthy(health: dict | None) -> str | None:
    """Why a step's recorded health is not good, or None. No record (a manifest from before
    health was kept) is not evidence of harm: None."""
    if not health:
        return None
    for key in ("loss", "grad_norm"):
        v = health.get(key)
        if v is not None and not math.isfinite(v):
            return f"its step's {key.replace('_', ' ')} is {v}"
    if health.get("finite_weights") is False:
        return "its adapter holds NaN or Inf weights"
    m = health.get("max_abs_weight")
    if m is not None and m > MAX_ABS_WEIGHT:
        return f"its adapter's largest |weight| is {m:.3g} (> {MAX_ABS_WEIGHT:g}: the update blew up)"
    return None


def problem(ckpt: Path, hashes: bool = True) -> str | None:
    """Why `ckpt` cannot be resumed from or exported, naming the file or the number (None: it
    verifies). `hashes`: also re-hash every file against the manifest (bit flips in place)."""
    ckpt = Path(ckpt)
    manifest = ckpt / MANIFEST
    if not manifest.is_file():
        return (f"{manifest} is missing: the save did not finish (killed or disk full during it), or the "
                "checkpoint was written before tuneledger sealed checkpoints")
    try:
        sealed = json.loads(manifest.read_text())
        files = sealed["files"]
    except (ValueError, KeyError) as e:
        return f"{manifest} is unreadable ({e})"
    for name, entry in files.items():
        size, digest = (entry, None) if isinstance(entry, int) else (entry.get("bytes"), entry.get("hash"))
        f = ckpt / name
        if not f.is_file():
            return f"{f} is missing"
        got = f.stat().st_size
        if got != size:
            return f"{f} has {got:,} bytes, the manifest says {size:,} (truncated or rewritten)"
        if hashes and digest and content_hash(f).split(":")[-1] != digest.split(":")[-1]:
            return f"{f} does not match its content hash in the manifest (changed in place: bit flips, or rewritten)"
    for name in REQUIRED:
        if name not in files:
            return f"{ckpt / name} is not in the manifest"
    bad = unhealthy(sealed.get("health"))
    if bad:
        return f"{ckpt} is sealed but not good: {bad}"
    return None


def scan(out_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(newest checkpoint-N that verifies, [(newer or older checkpoint that does not, why)])."""
    found = sorted((p for p in Path(out_dir).glob("checkpoint-*") if p.is_dir() and step_of(p) is not None),
                   key=step_of, reverse=True)
    good, bad = None, []
    for p in found:
        why = problem(p)
        if why:
            bad.append((p, why))
        elif good is None:
            good = p
    return good, bad


def set_aside(bad: list[tuple[Path, str]]) -> list[Path]:
    """Rename each damaged checkpoint-N to damaged-checkpoint-N (never deleted: a person decides).
    The resumed run would otherwise write over it at step N, or the Trainer's rotation delete it."""
    moved = []
    for p, _ in bad:
        dest = p.with_name(DAMAGED_PREFIX + p.name)
        n = 1
        while dest.exists():
            dest, n = p.with_name(f"{DAMAGED_PREFIX}{p.name}.{n}"), n + 1
        p.rename(dest)
        moved.append(dest)
    return moved


def set_aside_ones(out_dir: Path) -> list[Path]:
    """The damaged-checkpoint-N folders an earlier start set aside in `out_dir`, by name."""
    return sorted(Path(out_dir).glob(DAMAGED_PREFIX + "checkpoint-*")) if Path(out_dir).is_dir() else []


def size_of(ckpt: Path) -> int:
    """Bytes of one checkpoint on disk (every file, the manifest included)."""
    return sum(f.stat().st_size for f in Path(ckpt).rglob("*") if f.is_file())


# What a resume needs but a user of the adapter does not: kept in checkpoint-N only.
TRAINING_ONLY = ("optimizer.pt", "scheduler.pt", "trainer_state.json", "training_args.bin", MANIFEST, CONFIG, DATA)
FINAL = "tuneledger_final.json"  # which checkpoint the adapter at the run's root came from


def publish_final(ckpt: Path, out_dir: Path, finished: bool | None = None) -> list[str]:
    """Put the final adapter and tokenizer at the run's root, where LLaMA-Factory leaves them
    (`output_dir/adapter_model.safetensors`, ...), so tools that follow LF's layout find them.
    Each file is copied to a temporary name and renamed, so a reader sees the old file or the new
    one (the adapter's size once more on disk: 646 MB for Qwen2.5-7B at r=64). Returns the names published; writes FINAL last."""
    import shutil

    ckpt, out_dir = Path(ckpt), Path(out_dir)
    names = []
    for f in sorted(ckpt.iterdir()):
        if not f.is_file() or f.name in TRAINING_ONLY or f.name.startswith("rng_state"):
            continue
        tmp = out_dir / f".{f.name}.tmp"
        tmp.unlink(missing_ok=True)
        shutil.copy2(f, tmp)  # a copy, not a hard link: damage to one must not reach the other
        os.replace(tmp, out_dir / f.name)
        names.append(f.name)
    final = {"checkpoint": ckpt.name, "step": step_of(ckpt), "files": names}
    if finished is not None:  # False: a stopped run's newest adapter, not the end of training
        final["finished"] = finished
    (out_dir / (FINAL + ".tmp")).write_text(json.dumps(final, indent=1))
    os.replace(out_dir / (FINAL + ".tmp"), out_dir / FINAL)
    return names


def time_publish(run_dir: Path) -> float | None:
    """Seconds to copy a dry-run's checkpoint's adapter and tokenizer as `train` does after its
    last save (publish_final, into the run's root: the adapter's size again, 646 MB at r=64 on
    Qwen2.5-7B), for the ETA's finish part; into a scratch folder in `run_dir`, removed after. None
    when there is no checkpoint, or the copy failed (a full disk: the train's own disk check says so)."""
    import shutil
    import time

    ckpts = sorted(run_dir.glob("checkpoint-*"))
    if not ckpts:
        return None
    scratch = run_dir / ".publish-probe"
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        scratch.mkdir()
        t0 = time.perf_counter()
        publish_final(ckpts[-1], scratch)
        return time.perf_counter() - t0
    except OSError as e:
        print(f"dry-run: could not time the final adapter's copy ({e}); the ETA's finish leaves it out", file=sys.stderr)
        return None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# ------------------------------------------------------------------------- finding checkpoints
class LoadError(RuntimeError):
    """The run, checkpoint or base cannot be found or loaded; the message says which and what to do.
    The verbs exit with `exit_code` (docs/runs-and-output.md)."""

    exit_code = 1


class RunNotFound(LoadError):
    """The run named on the command line is not there: bad input (exit 2), as a config file, a
    dataset or a model that is not there."""

    exit_code = 2


def last_checkpoint(out_dir: Path, require: tuple[str, ...] = ()) -> str | None:
    """The newest checkpoint-N in out_dir whose manifest verifies (problem), or None.
    `require`: files it must also hold."""
    done = [p for p in Path(out_dir).glob("checkpoint-*") if step_of(p) is not None
            and all((p / f).is_file() for f in require)]
    for p in sorted(done, key=step_of, reverse=True):
        if problem(p) is None:
            return str(p)
    return None


def best_checkpoint(out_dir: Path) -> tuple[str, float] | None:
    """(path, eval loss) of the complete checkpoint-N with the lowest eval loss, or None when no
    checkpoint was evaluated. The losses are the newest checkpoint's log history (an eval at step N
    runs before the save at step N, so it is in checkpoint-N's state)."""
    newest = last_checkpoint(out_dir)
    if not newest:
        return None
    history = json.loads((Path(newest) / "trainer_state.json").read_text()).get("log_history", [])
    losses = {h["step"]: h["eval_loss"] for h in history if "eval_loss" in h}
    done = {step_of(p): p for p in Path(out_dir).glob("checkpoint-*") if step_of(p) is not None and problem(p) is None}
    scored = sorted((losses[step], step) for step in done if step in losses)
    return (str(done[scored[0][1]]), scored[0][0]) if scored else None


_WARNED: set[str] = set()


def _root_copy_verifies(run: Path, ckpt: Path) -> bool:
    """True when every adapter file at the run's root (publish_final's copy of `ckpt`) matches the
    size and content hash that `ckpt`'s own manifest gives it, and the adapter's files are there."""
    try:
        files = json.loads((ckpt / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return False
    names = [n for n in files if n.startswith("adapter_")]
    if "adapter_config.json" not in names or not any(n.endswith(".safetensors") or n.endswith(".bin") for n in names):
        return False
    for name in names:
        entry, f = files[name], run / name
        size, digest = (entry, None) if isinstance(entry, int) else (entry.get("bytes"), entry.get("hash"))
        if not f.is_file() or f.stat().st_size != size or not digest:
            return False
        if content_hash(f).split(":")[-1] != digest.split(":")[-1]:
            return False
    return True


def find_checkpoint(path: Path) -> Path:
    """`path` itself if it holds an adapter, else its newest complete checkpoint-N; <run>/checkpoint-best
    is the run's checkpoint with the lowest eval loss (best_checkpoint). A run's root holds
    a copy of its final adapter (FINAL names the checkpoint it came from): that
    checkpoint is returned while it is there. Raises LoadError."""
    final, final_why = None, ""  # the run's final checkpoint, when neither it nor its copy at the root verifies
    if (path / FINAL).is_file():
        named = path / str(json.loads((path / FINAL).read_text()).get("checkpoint", ""))
        if named != path and (named / "adapter_config.json").is_file():
            why = problem(named)
            if why is None:
                return named
            if _root_copy_verifies(path, named):
                # The checkpoint was damaged after training; its copy at the root is the same adapter.
                if str(named) not in _WARNED:
                    _WARNED.add(str(named))
                    print(f"WARNING: {named.name} does not verify ({why}); its copy at {path}/ does (the same "
                          f"hashes as its manifest): using that", file=sys.stderr, flush=True)
                return path
            final, final_why = named, why
    elif (path / "adapter_config.json").is_file():
        # A sealed checkpoint is used only if it verifies (files, hashes, health); an adapter
        # folder from elsewhere (no manifest) is used as it is.
        why = problem(path) if (path / MANIFEST).is_file() else None
        if why:
            raise LoadError(f"{path} does not verify: {why}")
        return path
    if path.name == "checkpoint-best" and not path.exists():
        best = best_checkpoint(path.parent)
        if not best:
            raise LoadError(f"{path.parent} has no checkpoint with an eval loss: the run needs eval data (val_size or "
                            "eval_dataset) and a checkpoint at an eval step (eval_steps defaults to save_steps)")
        print(f"best checkpoint: {best[0]} (eval loss {best[1]:.4f})", flush=True)
        return Path(best[0])
    good, bad = scan(path) if path.is_dir() else (None, [])
    newer = [(p, why) for p, why in bad if good is None or int(p.name.split("-")[1]) > int(good.name.split("-")[1])]
    for p, why in newer:
        if str(p) not in _WARNED:  # export looks twice (the adapter, then its run's config)
            _WARNED.add(str(p))
            print(f"WARNING: {p.name} skipped: {why}", file=sys.stderr, flush=True)
    found = last_checkpoint(path, require=("adapter_config.json",))
    if final is not None and found and Path(found) != final and f"final:{final}" not in _WARNED:
        _WARNED.add(f"final:{final}")
        print(f"WARNING: the run's final adapter ({final.name}) does not verify ({final_why}), nor does its copy at {path}/: "
              f"using {Path(found).name}, the newest checkpoint that verifies (an earlier step than the run's end)",
              file=sys.stderr, flush=True)
    if not found:
        if not path.exists():
            siblings = sorted(p.name for p in path.parent.glob("checkpoint-*")) if path.parent.is_dir() else []
            raise LoadError(f"{path} does not exist" + (f"; {path.parent} has {', '.join(siblings)}" if siblings else ""))
        if bad:
            raise LoadError(f"no checkpoint of {path} verifies: " + "; ".join(f"{p.name}: {why}" for p, why in bad))
        raise LoadError(f"{path} has no adapter (adapter_config.json) and no complete checkpoint-N: train it first "
                        "(`tuneledger train` / make train), or name a run that was trained")
    return Path(found)
