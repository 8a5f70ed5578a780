"""Write tuneledger's own demo dataset: src/tuneledger/data/demo.jsonl.

The default dry-run needs instruction data that runs anywhere and that we may ship, so the
project writes its own: worked answers about batch arithmetic, run-time estimates, memory units,
long multiplication and sorting, in English and Chinese, single- and multi-turn, in both the
alpaca and the messages format. Every answer is computed, so every answer is right. Lengths
spread from ~60 to ~900 tokens, like real instruction data. Deterministic: same file every time.

    python scripts/make_demo_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "tuneledger" / "data" / "demo.jsonl"


def accumulation(r: random.Random) -> dict:
    world = r.choice([1, 2, 4, 8])
    micro = r.choice([1, 2, 4])
    accum = r.choice([1, 2, 4, 8])
    glob = world * micro * accum
    if r.random() < 0.5:
        return {"instruction": f"I fine-tune on {world} GPUs with micro-batch {micro} and want a global batch of {glob}. "
                               "What gradient accumulation do I need?",
                "input": "",
                "output": f"Gradient accumulation = global batch / (micro-batch x world size) = {glob} / ({micro} x {world}) "
                          f"= {glob} / {micro * world} = {accum}.\n\nEach optimizer step then sees {micro} x {accum} = "
                          f"{micro * accum} samples per GPU, {glob} across all {world} GPUs, so the learning rate and "
                          "schedule you tuned for that global batch still apply."}
    return {"instruction": f"我在 {world} 张卡上训练，每卡 micro-batch 为 {micro}，全局 batch 要保持 {glob}。梯度累积步数应设为多少？",
            "input": "",
            "output": f"梯度累积 = 全局 batch / (micro-batch × 卡数) = {glob} / ({micro} × {world}) = {accum}。\n\n"
                      f"这样每次优化器更新时，每张卡处理 {micro * accum} 条样本，{world} 张卡合计 {glob} 条，"
                      "和原来的全局 batch 一致，学习率不用改。"}


def eta(r: random.Random) -> dict:
    records = r.randrange(20_000, 400_000, 1000)
    glob = r.choice([8, 16, 32, 64])
    s_step = round(r.uniform(0.4, 4.0), 2)
    save_every = r.choice([100, 200, 500])
    save_s = round(r.uniform(2, 30), 1)
    steps = -(-records // glob)
    saves = steps // save_every
    total = steps * s_step + saves * save_s
    h, rem = divmod(total, 3600)
    return {"instruction": "Estimate how long one epoch of fine-tuning will take.",
            "input": f"Records: {records}. Global batch: {glob}. Dry-run: {s_step} s per optimizer step. "
                     f"A checkpoint every {save_every} steps takes {save_s} s to save.",
            "output": f"1. Optimizer steps per epoch = ceil({records} / {glob}) = {steps}.\n"
                      f"2. Training time = {steps} x {s_step} s = {steps * s_step:,.0f} s.\n"
                      f"3. Checkpoints = floor({steps} / {save_every}) = {saves}, costing {saves} x {save_s} s = {saves * save_s:,.0f} s.\n"
                      f"4. Total = {total:,.0f} s, about {int(h)} h {rem / 60:.0f} min.\n\n"
                      "The estimate holds only if the dry-run measured steady-state steps: exclude the first few "
                      "steps, which include compilation, allocator warm-up and data-loader start."}


def units(r: random.Random) -> dict:
    mib = r.randrange(1_000, 140_000)
    gib = mib / 1024
    gb = mib * 1024 * 1024 / 1e9
    return {"instruction": f"Convert {mib} MiB to GiB and to GB, and say whether it fits a 24 GB card.",
            "input": "",
            "output": f"{mib} MiB / 1024 = {gib:.2f} GiB.\n{mib} MiB x 1,048,576 bytes = {mib * 1048576:,} bytes = {gb:.2f} GB.\n"
                      f"A '24 GB' card such as the RTX 4090 has 24 GiB (24,564 MiB as nvidia-smi reports it), so "
                      f"{'it fits, with ' + format(24564 - mib, ',') + ' MiB to spare' if mib < 24564 else 'it does not fit: ' + format(mib - 24564, ',') + ' MiB too many'}."}


def multiply(r: random.Random) -> dict:
    a, b = r.randrange(100, 99_999), r.randrange(10, 9_999)
    lines = []
    total = 0
    for place, digit in enumerate(reversed(str(b))):
        part = a * int(digit) * 10 ** place
        total += part
        lines.append(f"- {a} x {digit} x {10 ** place} = {part:,} (running total {total:,})")
    zh = r.random() < 0.3
    head = f"用竖式计算 {a} × {b}，写出每一步。" if zh else f"Multiply {a} by {b} step by step."
    tail = f"\n\n所以 {a} × {b} = {a * b:,}。" if zh else f"\n\nSo {a} x {b} = {a * b:,}."
    return {"instruction": head, "input": "", "output": "\n".join(lines) + tail}


def sort_numbers(r: random.Random) -> dict:
    xs = [r.randrange(-500, 500) for _ in range(r.randrange(4, 14))]
    steps, work = [], list(xs)
    for i in range(1, len(work)):
        key, j = work[i], i - 1
        while j >= 0 and work[j] > key:
            work[j + 1] = work[j]
            j -= 1
        work[j + 1] = key
        steps.append(f"Insert {key}: {work[: i + 1]}")
    return {"instruction": "Sort these numbers in ascending order with insertion sort, showing each insertion.",
            "input": ", ".join(map(str, xs)),
            "output": "\n".join(steps) + f"\n\nSorted: {', '.join(map(str, sorted(xs)))}."}


def conversation(r: random.Random) -> dict:
    world, micro = r.choice([2, 4, 8]), r.choice([1, 2])
    glob = world * micro * r.choice([1, 2, 4])
    s_a = round(r.uniform(0.8, 2.0), 2)
    s_c = round(s_a * r.uniform(0.9, 0.99), 2)
    msgs = [
        {"role": "system", "content": "You are a careful ML engineer who answers with numbers."},
        {"role": "user", "content": f"On {world} GPUs my preset A (micro-batch 1, gradient checkpointing on) runs at {s_a} s/step. "
                                    "Will turning gradient checkpointing off halve the time?"},
        {"role": "assistant", "content": "Probably not. Gradient checkpointing trades memory for time by recomputing the "
                                         "forward pass during backward, which costs about a third more compute. Turning it off "
                                         "can only save that recomputation, and only if the GPU has idle capacity to gain. "
                                         "Look at GPU utilisation first: at 90% or more the GPU is already busy and the gain is small."},
        {"role": "user", "content": f"I measured preset C (micro-batch 2, checkpointing off): {s_c} s/step. What did I gain?"},
        {"role": "assistant", "content": f"You gained {(s_a - s_c) / s_a * 100:.1f}% per step ({s_a} s to {s_c} s). "
                                         "That small a gain says the step time is set by compute or communication, not by "
                                         "the recomputation. Keep the global batch at "
                                         f"{glob} and look at the all-reduce share and the GPU utilisation before changing more."},
    ]
    return {"messages": msgs}


GENERATORS = [(accumulation, 90), (eta, 90), (units, 60), (multiply, 120), (sort_numbers, 90), (conversation, 50)]


def main() -> None:
    r = random.Random(20261129)
    records = [gen(r) for gen, n in GENERATORS for _ in range(n)]
    r.shuffle(records)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    print(f"wrote {len(records)} records to {OUT}")


if __name__ == "__main__":
    main()
