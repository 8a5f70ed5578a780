"""Plain transformers + peft + bitsandbytes: the speed tuneledger must at least match.

Nothing of tuneledger's training path is used: the model loads with BitsAndBytesConfig onto
cuda:LOCAL_RANK, goes through peft's `prepare_model_for_kbit_training` (with non-reentrant
gradient checkpointing when the preset asks), gets LoRA on every linear projection, is wrapped in
DDP (find_unused_parameters=False) and trained by a hand loop: bf16 autocast, `no_sync` on every
micro-batch but the last, grad-norm clipping at 1.0, fused AdamW. The method of
../shared/notes/h200-baseline.md. Only the data is shared: the same tokenized records (the
`tuneledger stats` cache), the same seed-shuffled order, padded per micro-batch (A-C) or packed
padding-free with position_ids (D), so both see the same workload.

    python -m torch.distributed.run --nproc-per-node 2 bench/baseline_hf.py \
        --model DIR --data CACHE_DIR --preset A B C D --out baseline.json

Presets run one after another in one process group (a fresh model each), to spare the start-up.

Reports steady-state s/step and real (non-pad) tokens/s over `--steps` steps after `--warmup`: on the
mean step (the window's wall time, `tokens_per_s`) and on the median step (`tokens_per_s_median`),
and every step's loss (micro-batch means / accumulation, summed).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

PRESETS = {"A": (1, True, False), "B": (2, True, False), "C": (2, False, False), "D": (8, False, True)}


def batches(ds, micro: int, packed: bool, rank: int, world: int, seed: int, pad_id: int):
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(ds), generator=g).tolist()
    order = order[rank::world]
    while True:
        for i in range(0, len(order) - micro + 1, micro):
            rows = [ds[j] for j in order[i:i + micro]]
            if packed:
                ids = torch.tensor([t for r in rows for t in r["input_ids"]])[None]
                labels = torch.tensor([t if k else -100 for r in rows for k, t in enumerate(r["labels"])])[None]
                pos = torch.cat([torch.arange(len(r["input_ids"])) for r in rows])[None]
                yield {"input_ids": ids, "labels": labels, "position_ids": pos}, ids.numel()
            else:
                n = max(len(r["input_ids"]) for r in rows)
                ids = torch.full((micro, n), pad_id)
                labels = torch.full((micro, n), -100)
                mask = torch.zeros((micro, n), dtype=torch.long)
                for k, r in enumerate(rows):
                    L = len(r["input_ids"])
                    ids[k, :L], labels[k, :L], mask[k, :L] = torch.tensor(r["input_ids"]), torch.tensor(r["labels"]), 1
                yield {"input_ids": ids, "labels": labels, "attention_mask": mask}, int(mask.sum())


def micro_batches(it, accum: int, tokens: torch.Tensor):
    """One step's `accum` micro-batches from `batches()`, on the GPU, with their real tokens added
    to the device counter `tokens`: yields (index, batch)."""
    for m in range(accum):
        batch, n = next(it)
        tokens.add_(n)
        yield m, {k: v.cuda(non_blocking=True) for k, v in batch.items()}


def timed_steps(one_step, steps: int, warmup: int, tokens: torch.Tensor) -> tuple[float, list[float], list[float]]:
    """Run `warmup` + `steps` optimizer steps (`one_step()` returns the step's loss on the device).
    Returns (the measured window's wall time in s, its step durations in s sorted (CUDA events),
    every step's loss). `tokens` (a device counter the steps add to) restarts with the window."""
    marks, losses, t0 = [], [], 0.0
    for step in range(steps + warmup):
        if step == warmup:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            tokens.zero_()
        marks.append(torch.cuda.Event(enable_timing=True))
        marks[-1].record()
        losses.append(one_step())
    marks.append(torch.cuda.Event(enable_timing=True))
    marks[-1].record()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    durations = sorted(marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(warmup, len(marks) - 1))
    return wall, durations, [round(x, 4) for x in torch.stack(losses).tolist()]


def common_args(steps: int, warmup: int) -> argparse.ArgumentParser:
    """The arguments the peers share (this script and bench/peer_unsloth.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True, help="a tuneledger tokenized-dataset cache directory")
    ap.add_argument("--preset", required=True, nargs="+", choices=sorted(PRESETS))
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--lora-r", type=int, default=64)
    ap.add_argument("--lora-alpha", type=int, default=128)
    ap.add_argument("--out", required=True)
    return ap


def main() -> None:
    ap = common_args(25, 5)
    ap.add_argument("--lora-dropout", type=float, default=0.05)
    a = ap.parse_args()

    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    results = [run_preset(a, p, local) for p in a.preset]
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


def run_preset(a, preset: str, local: int) -> dict:
    import datasets
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    micro, gc, packed = PRESETS[preset]
    micro = max(1, min(micro, a.global_batch // world))
    accum = a.global_batch // (micro * world)

    tok = AutoTokenizer.from_pretrained(a.model)
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(a.model, quantization_config=bnb, dtype=torch.bfloat16,
                                                 device_map={"": local}, attn_implementation="sdpa")
    model.config.use_cache = False
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gc,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=a.lora_r, lora_alpha=a.lora_alpha, lora_dropout=a.lora_dropout,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local], find_unused_parameters=False)
    # from_pretrained returns eval mode: without train() gradient checkpointing and LoRA dropout are
    # silently off (a first run of this script measured exactly that, bench/results/h200-2026-11-30).
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)

    ds = datasets.load_from_disk(a.data).select_columns(["input_ids", "labels"])
    it = batches(ds, micro, packed, rank, world, 42, tok.pad_token_id)
    tokens = torch.zeros((), dtype=torch.int64, device="cuda")
    torch.cuda.reset_peak_memory_stats()

    def one_step() -> torch.Tensor:
        step_loss = torch.zeros((), device="cuda")
        for m, batch in micro_batches(it, accum, tokens):
            with (model.no_sync() if m < accum - 1 else nullcontext()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch).loss / accum
                loss.backward()
                step_loss += loss.detach().float()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return step_loss

    wall, durations, losses = timed_steps(one_step, a.steps, a.warmup, tokens)
    dist.all_reduce(tokens)
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**20], device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    out = {"preset": preset, "world_size": world, "micro_batch": micro, "accum": accum, "gc": gc, "packed": packed,
           "steps": a.steps, "warmup": a.warmup, "s_per_step": wall / a.steps,
           "s_per_step_median": durations[len(durations) // 2], "lora_dropout": a.lora_dropout,
           # mean step: the window's wall time; median step: the window's tokens per step at the median step
           "tokens_per_s": tokens.item() / wall, "tokens_per_s_median": tokens.item() / a.steps / durations[len(durations) // 2],
           "first_losses": losses, "tokens_per_s_per_gpu": tokens.item() / wall / world,
           "peak_allocated_mib": round(peak.item()), "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "lora_r": a.lora_r}
    if rank == 0:
        print(f"baseline {preset}: {out['s_per_step']:.3f} s/step, {out['tokens_per_s']:,.0f} tokens/s "
              f"({out['tokens_per_s_per_gpu']:,.0f}/GPU), peak {out['peak_allocated_mib']:,} MiB", flush=True)
    del model, opt
    torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    main()
