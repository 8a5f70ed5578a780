"""Gradient checkpointing with compiled decoder layers: where the checkpoint sits.

transformers' GradientCheckpointingLayer wraps each layer call in torch.utils.checkpoint, so a
compiled layer (layer.compile()) runs its whole compiled forward twice, each time saving what its
compiled backward needs, and the host launches three graphs per layer. With the checkpoint inside
the compiled region, AOT autograd's partitioner keeps only the layer's inputs and recomputes the
forward inside the backward graph (two graphs per layer, the recomputation fused with backward).

This compares, on a small random Qwen2 with LoRA on all seven projections (tuneledger's fused
projection, fused_lora.fuse_lora), for the same batches: eager without checkpointing (reference),
eager with transformers' checkpointing, compiled layers with transformers' checkpointing around
them, and compiled layers with the checkpoint inside (compiled.compile_layers(checkpoint=True)).
Prints per case the losses, the worst LoRA gradient error relative to the reference gradient's
norm, the activations saved for backward in the first step (MiB, saved_tensors_hooks; weights not counted), dynamo's graph and graph-break counts, and the time per step (host-bound on a CPU: not a
GPU figure). Exits 1 when a case's gradients differ from the reference beyond --tol.

    python bench/gc_compile_check.py [--device cuda [--nf4]] [--dropout 0.05] [--out gc_compile_check.json]

--nf4 loads the base in 4 bits (bitsandbytes NF4, as presets A-D): a dequantized bf16 weight that
a case saves for backward then shows in its saved MiB (the 4-bit weights themselves are not counted).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from tuneledger import compiled, fused_lora  # noqa: E402


def write_model(path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=2048, max_position_embeddings=1024, tie_word_embeddings=False)
    Qwen2ForCausalLM(cfg).save_pretrained(path)


def build(path: Path, device: str, dtype: torch.dtype, gc: bool, mode: str, dropout: float, nf4: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    kwargs = {}
    if nf4:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_compute_dtype=dtype, bnb_4bit_use_double_quant=True)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map={"": device}, attn_implementation="sdpa", **kwargs)
    m.config.use_cache = False
    for p in m.parameters():
        p.requires_grad_(False)
    if gc:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.enable_input_require_grads()
    torch.manual_seed(1)  # lora_A is drawn here
    m = get_peft_model(m, LoraConfig(r=16, lora_alpha=32, lora_dropout=dropout, target_modules="all-linear",
                                     task_type="CAUSAL_LM"))
    torch.manual_seed(1)
    for n, p in m.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.02)
    fused_lora.fuse_lora(m, True)
    line = "off"
    if mode != "eager":
        line = compiled.compile_layers(m, True, "cuda", True, nf4, checkpoint=mode.startswith("compiled-inside") and gc)
    m.train()
    return m, line


def batches(device: str, n: int) -> list[dict]:
    g = torch.Generator().manual_seed(2)
    out = []
    for i in range(n):
        length = 96 + 32 * (i % 3)  # three shapes, as padded micro-batches give
        ids = torch.randint(0, 2048, (2, length), generator=g)
        out.append({"input_ids": ids.to(device), "labels": ids.to(device)})
    return out


def run_case(path: Path, args, gc: bool, mode: str) -> dict:
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if args.device == "cuda" else "fp32")]
    m, line = build(path, args.device, dtype, gc, mode, args.dropout, args.nf4)
    losses, grads, times, saved = [], None, [], []

    weights = {p.untyped_storage().data_ptr() for p in m.parameters()}

    shapes: dict = {}

    def pack(t: torch.Tensor) -> torch.Tensor:  # activations only: a saved weight is a reference, no memory
        if t.untyped_storage().data_ptr() not in weights:
            saved[-1] += t.numel() * t.element_size()
            if len(saved) == 1:
                key = f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                shapes[key] = shapes.get(key, 0) + 1
        return t

    for i, b in enumerate(batches(args.device, args.steps)):
        torch.manual_seed(100 + i)  # dropout masks: the same draws in every case
        t = time.perf_counter()
        saved.append(0)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            loss = m(**b).loss
        loss.backward()
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(round(loss.item(), 6))
        if i == 0:
            grads = {n: p.grad.detach().float().clone() for n, p in m.named_parameters() if p.grad is not None}
        m.zero_grad(set_to_none=True)
    steady = sorted(times[3:]) or times
    return {"gc": gc, "mode": mode, "compile": line, "losses": losses, "grads": grads,
            "s_per_step_median": round(steady[len(steady) // 2], 4), "saved_mib_step0": round(saved[0] / 2**20, 2),
            "graphs": counters["stats"].get("unique_graphs", 0), "graph_breaks": sum(counters["graph_break"].values()),
            "graph_break_reasons": sorted(counters["graph_break"])[:5],
            "saved_step0": sorted(shapes.items(), key=lambda kv: -kv[1])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), help="default: bf16 on cuda, fp32 on a CPU")
    ap.add_argument("--nf4", action="store_true", help="a 4-bit base (bitsandbytes NF4; >= 0.49 quantizes on a CPU too)")
    ap.add_argument("--tol", type=float, default=None, help="relative gradient error allowed (default 1e-4 fp32, 3e-2 bf16: tests/test_speed.py's NF4_TOL)")
    ap.add_argument("--out")
    args = ap.parse_args()
    tol = args.tol or (3e-2 if args.device == "cuda" or args.dtype == "bf16" else 1e-4)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "model"
        write_model(path)
        cases = [(False, "eager"), (True, "eager"), (True, "compiled-outside"), (True, "compiled-inside"),
                 (True, "compiled-inside-prefer")]
        results = []
        for gc, mode in cases:
            # compiled.checkpoint_inside's policy: every op MUST_RECOMPUTE (default), or PREFER_RECOMPUTE
            os.environ["TUNELEDGER_CHECKPOINT_POLICY"] = "prefer" if mode.endswith("-prefer") else ""
            results.append(run_case(path, args, gc, mode))
    ref = results[0]["grads"]
    worst_all = 0.0
    for r in results:
        g = r.pop("grads")
        worst = max(((g[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-12)).item() for n in ref)
        r["grad_rel_err_max"] = worst
        worst_all = max(worst_all, worst)
        print(f"gc_compile_check {'GC' if r['gc'] else 'no GC'} {r['mode']:<20} compile={r['compile']!r} "
              f"graphs={r['graphs']} breaks={r['graph_breaks']} {r['s_per_step_median']:.4f} s/step "
              f"saved for backward {r['saved_mib_step0']} MiB "
              f"grad err {worst:.2e} losses {r['losses'][:4]}")
        print(f"  saved (shape dtype: count): {', '.join(f'{k}: {v}' for k, v in r['saved_step0'][:12])}")
        if r["graph_breaks"]:
            print(f"  graph breaks: {r['graph_break_reasons']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"torch": torch.__version__, "device": args.device, "nf4": args.nf4, "tol": tol,
                                              "cases": results}, indent=1))
    ok = worst_all <= tol
    print(f"gc_compile_check: {'ok' if ok else 'FAILED'}: worst gradient error {worst_all:.2e} (tolerance {tol:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
