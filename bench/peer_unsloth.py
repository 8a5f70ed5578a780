"""Unsloth as the speed peer, on the same GPU, model, data and LoRA settings as tuneledger's presets.

Unsloth is imported first (it patches transformers and peft globally), so this runs in a process of
its own. The model loads with FastLanguageModel in 4 bit (NF4, double quant, bf16 compute), gets
LoRA r/alpha on all seven projections with dropout 0 (Unsloth's fast path), and trains by a hand
loop like bench/baseline_hf.py's: padded micro-batches of the same tokenized records in the same
seeded order (Unsloth pads; it has no padding-free packing in this loop), accumulation to the global
batch, clipping at 1.0, fused AdamW. Gradient checkpointing, where the preset has it, is Unsloth's
own ("unsloth": offloaded). Time: CUDA events at step bounds; tokens are real (non-pad) tokens.

    UNSLOTH_DISABLE_STATISTICS=1 HF_HUB_OFFLINE=1 PYTHONPATH=.usite:$PYTHONPATH \
        python bench/peer_unsloth.py --model DIR --data CACHE_DIR --preset D C --out unsloth.json

Presets (micro-batch, checkpointing): A (1, on), B (2, on), C (2, off), D (8, off, padded here).
Each row: tokens/s on the mean step (the window's wall time) and on the median step, peak allocated
memory, every step's loss (micro-batch means / accumulation, summed). --memory: one more step after
them, its peak memory split by what holds it (memory-unsloth-<preset>.md, as TUNELEDGER_MEMORY_STEP's).
"""

from __future__ import annotations

import os

os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import unsloth  # noqa: E402,F401  (before transformers and peft)
from unsloth import FastLanguageModel  # noqa: E402

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline_hf import batches, common_args, micro_batches, timed_steps  # noqa: E402

PRESETS = {"A": (1, True), "B": (2, True), "C": (2, False), "D": (8, False)}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def run_preset(a, preset: str) -> dict:
    import datasets

    micro, gc = PRESETS[preset]
    accum = a.global_batch // micro
    t_load = time.perf_counter()
    model, tok = FastLanguageModel.from_pretrained(model_name=a.model, max_seq_length=a.cutoff, dtype=torch.bfloat16,
                                                   load_in_4bit=True, local_files_only=True)
    model = FastLanguageModel.get_peft_model(model, r=a.lora_r, lora_alpha=a.lora_alpha, lora_dropout=0.0,
                                             target_modules=TARGETS, bias="none",
                                             use_gradient_checkpointing="unsloth" if gc else False, random_state=42)
    FastLanguageModel.for_training(model)
    load_s = time.perf_counter() - t_load
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    ds = datasets.load_from_disk(a.data).select_columns(["input_ids", "labels"])
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    it = batches(ds, micro, False, 0, 1, 42, pad)
    tokens = torch.zeros((), dtype=torch.int64, device="cuda")
    torch.cuda.reset_peak_memory_stats()

    def one_step() -> torch.Tensor:
        step_loss = one_step_before_zero_grad(model, opt, it, accum, tokens)
        opt.zero_grad(set_to_none=True)
        return step_loss

    wall, durations, losses = timed_steps(one_step, a.steps, a.warmup, tokens)
    n_tokens = tokens.item()  # the timed window's: the profiled step below adds its own to the counter
    if a.profile:  # one more step, after the timed window, with tuneledger's own kernel-time table
        profile_step(one_step, a.warmup + a.steps + 1, Path(a.out).parent / f"profile-unsloth-{preset}")
    if a.memory:  # one more step, with tuneledger's split of its peak memory (TUNELEDGER_MEMORY_STEP's)
        from tuneledger.memory_step import Recorder, stop_recording

        rec, step = Recorder(), a.warmup + a.steps + 1 + bool(a.profile)
        try:
            rec.start()
            one_step_before_zero_grad(model, opt, it, accum, tokens)
            print(rec.finish(Path(a.out).parent / f"memory-unsloth-{preset}", step, model, opt), flush=True)
        except Exception as e:  # noqa: BLE001  the timed row above stands without it
            stop_recording()
            print(f"unsloth {preset}: no memory split ({type(e).__name__}: {e})", flush=True)
    median = durations[len(durations) // 2]
    out = {"engine": "unsloth", "engine_version": getattr(unsloth, "__version__", "?"), "preset": preset,
           "micro_batch": micro, "accum": accum, "gc": gc, "packed": False, "lora_dropout": 0.0,
           "steps": a.steps, "warmup": a.warmup, "s_per_step": wall / a.steps, "s_per_step_median": median,
           "tokens_per_s": n_tokens / wall, "tokens_per_s_median": n_tokens / a.steps / median,
           "peak_allocated_mib": round(torch.cuda.max_memory_allocated() / 2**20), "load_s": round(load_s, 1),
           "first_losses": losses, "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "lora_r": a.lora_r}
    print(f"unsloth {preset}: {out['s_per_step']:.3f} s/step (mean), {out['tokens_per_s']:,.0f} tokens/s (mean step), "
          f"{out['tokens_per_s_median']:,.0f} (median step), peak {out['peak_allocated_mib']:,} MiB", flush=True)
    del model, opt
    torch.cuda.empty_cache()
    return out


def one_step_before_zero_grad(model, opt, it, accum: int, tokens: torch.Tensor) -> torch.Tensor:
    """One optimizer step of `accum` micro-batches from `it`, its gradients kept (the memory split names
    them); returns the step's loss (micro-batch means / accumulation, summed)."""
    step_loss = torch.zeros((), device="cuda")
    for _, batch in micro_batches(it, accum, tokens):
        loss = model(**batch).loss / accum
        loss.backward()
        step_loss += loss.detach().float()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    opt.step()
    return step_loss


def profile_step(one_step, step: int, stem: Path) -> None:
    """Profile one call of `one_step` (optimizer step `step`, 1-based) and write tuneledger.profile's split of it to `<stem>.json`
    and `<stem>.md` (kernel time by category, idle, launches, top kernels), to set beside a
    tuneledger profile (TUNELEDGER_PROFILE_STEP) of the same preset."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from tuneledger import profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        t0 = time.perf_counter()
        one_step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    s = profile.summarize(profile.events(prof), wall)
    profile.save(s, stem, step)
    print(f"unsloth profile: {stem}.md, {wall * 1e3:.0f} ms wall, GPU kernels {s['kernel_s'] * 1e3:.0f} ms", flush=True)


def main() -> None:
    ap = common_args(16, 4)
    ap.add_argument("--cutoff", type=int, default=2048)
    ap.add_argument("--profile", action="store_true", help="profile one step after the timed ones (profile-unsloth-<preset>.md)")
    ap.add_argument("--memory", action="store_true",
                    help="split the peak memory of one more step (memory-unsloth-<preset>.md, tuneledger.memory_step)")
    a = ap.parse_args()
    rows = []
    for p in a.preset:
        try:
            rows.append(run_preset(a, p))
        except Exception as e:  # noqa: BLE001  one preset's failure is a row, not the end of the bench
            print(f"unsloth {p}: FAILED {type(e).__name__}: {e}", flush=True)
            rows.append({"engine": "unsloth", "preset": p, "error": f"{type(e).__name__}: {e}"})
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
