"""Does a compiled decoder layer give each layer its own gradients? Eager against compiled, on a
small random NF4 Qwen2 (4 layers, Qwen2.5's head ratios), for peft's LoRA over bitsandbytes'
4-bit matmul and for tuneledger's fused projection, padded and packed (varlen attention).

Prints one line per case: the worst gradient error relative to the eager gradient's norm, the
parameter it is on, and the loss both ways. bf16 rounding alone stays near 1e-2; a gradient
computed with another layer's weights is of order 1.

    python bench/compile_check.py [--device cuda] [--out compile_check.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from tuneledger import compiled as compiled_layers, fused_lora, speed  # noqa: E402


def write_model(path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=4096, max_position_embeddings=4096, tie_word_embeddings=False)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def build(path: Path, device: str, fused: bool, attn: str, compiled: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.bfloat16)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map={"": device}, quantization_config=q,
                                             attn_implementation=attn)
    m.config.use_cache = False
    m = get_peft_model(m, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                     task_type="CAUSAL_LM"))
    torch.manual_seed(1)
    for n, p in m.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.02)
    fused_lora.fuse_lora(m, fused)
    if compiled:  # by hand: compiled_layers.compile_layers refuses the unfused 4-bit path this measures
        torch._dynamo.config.optimize_ddp = False
        for layer in m.base_model.model.model.layers:
            layer.compile(dynamic=None)
    return m


def batches(device: str, packed: bool) -> list[dict]:
    g = torch.Generator().manual_seed(2)
    out = []
    for lengths in ([96, 160, 64], [200, 56, 120]):  # two micro-batches: one shape change, as in training
        if packed:
            ids = torch.randint(0, 4096, (1, sum(lengths)), generator=g)
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            pos = torch.cat([torch.arange(n) for n in lengths])[None]
            out.append({"input_ids": ids, "labels": ids, "position_ids": pos, "cu_seq_lens_q": cu,
                        "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths)})
        else:
            ids = torch.randint(0, 4096, (len(lengths), max(lengths)), generator=g)
            out.append({"input_ids": ids, "labels": ids})
    return [{k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()} for b in out]


def grads(m, data: list[dict]) -> tuple[list[float], dict]:
    m.train()
    losses = []
    for b in data:  # accumulate over both micro-batches, as the Trainer does
        loss = m(**b).loss
        loss.backward()
        losses.append(round(loss.item(), 5))
    return losses, {n: p.grad.float().clone() for n, p in m.named_parameters() if p.requires_grad}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default="peft-padded,fused-padded,peft-packed,fused-packed")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "nf4-check"
        write_model(path)
        for case in args.cases.split(","):
            kind, layout = case.split("-")
            packed = layout == "packed"
            attn = speed.pick_attention("varlen" if packed else "sdpa", packed, args.device)[0]
            data = batches(args.device, packed)
            res = {}
            for compiled in (False, True):
                torch._dynamo.reset()
                res[compiled] = grads(build(path, args.device, kind == "fused", attn, compiled), data)
            (l0, g0), (l1, g1) = res[False], res[True]
            worst = max((((g0[n] - g1[n]).norm() / g0[n].norm()).item(), n) for n in g0)
            row = {"case": case, "attention": attn, "worst_rel_grad_err": round(worst[0], 5), "param": worst[1],
                   "loss_eager": l0, "loss_compiled": l1, "compile": compiled_layers.compile_stats(),
                   "torch": torch.__version__}
            rows.append(row)
            print(f"compile_check {case}: worst rel grad err {worst[0]:.2e} ({worst[1]}); loss eager {l0} "
                  f"compiled {l1}; {row['compile']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
