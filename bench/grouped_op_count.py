"""CPU proxy for grouped_lora's saving: aten ops dispatched in one forward + backward of a tiny
Qwen2 with LoRA on all seven projections (fused projections), ungrouped against grouped. Each op
is a kernel launch on a GPU in eager mode (compiled layers fuse the elementwise ones, not the
matmuls or bitsandbytes' dequantize calls). Usage: PYTHONPATH=src:tests python bench/grouped_op_count.py MODEL_DIR [--nf4]
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import test_grouped as tg  # the tests' model builder: the same LoRA set-up as tests/test_grouped.py


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    model_dir, nf4 = Path(sys.argv[1]), "--nf4" in sys.argv
    rows = {}
    for group in (False, True):
        m = tg._model(model_dir, group, quant=nf4)
        layers = m.config.num_hidden_layers
        x = tg.IDS.to(next(m.parameters()).device)
        tg._grads(m)  # first call outside the count (lazy initialisation)
        m.zero_grad(set_to_none=True)
        with Count() as c:
            m(input_ids=x, labels=x).loss.backward()
        rows[group] = c.ops
        mm = sum(v for k, v in c.ops.items() if k in ("mm", "addmm", "bmm", "matmul"))
        deq = sum(v for k, v in c.ops.items() if "dequantize" in k)
        print(f"grouped={group}: {sum(c.ops.values())} aten ops ({sum(c.ops.values()) / layers:.0f} per layer, "
              f"{layers} layers), matmuls {mm}, dequantize {deq}")
    total = [sum(rows[g].values()) for g in (False, True)]
    print(f"grouped / ungrouped: {total[1] / total[0]:.3f} ({total[0] - total[1]} fewer ops per forward + backward)")


if __name__ == "__main__":
    main()
