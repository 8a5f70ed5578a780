"""Host time of Trainer's per-micro-batch `model.train()` on Qwen2.5-7B's module tree with LoRA r=64
on all seven projections (built on the meta device: no weights, the same 2,333 modules), against
train_mode.TrainWalk's check of a kept list of flags. Median of 20 calls each, in ms.

    .venv/bin/python bench/train_walk_cost.py
"""

import statistics
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Qwen2Config

from tuneledger.train_mode import TrainWalk


def median_ms(fn, n=20):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


cfg = Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                  num_key_value_heads=4, vocab_size=152064)
with torch.device("meta"):
    m = AutoModelForCausalLM.from_config(cfg)
m = get_peft_model(m, LoraConfig(r=64, lora_alpha=128, lora_dropout=0.0, target_modules=[
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
walk = TrainWalk()


def skipped():
    with walk.skipped(m):
        m.train()


print(f"modules: {sum(1 for _ in m.modules())}")
print(f"model.train() (the stock walk): {median_ms(m.train):.3f} ms median of 20")
print(f"TrainWalk, every module training: {median_ms(skipped):.3f} ms median of 20")
