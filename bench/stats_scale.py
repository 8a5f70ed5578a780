"""`tuneledger stats` at scale: synthetic alpaca data (its own text, no licence) of a given size,
counted with the real Qwen2.5 tokenizer; records wall time, peak RSS (the process tree's, map
workers included, and the main process's alone: sampled every 0.2 s; the tree's sum counts
pages the workers share with it more than once) and tokens/s per core. A benchmark, not a test.

    python bench/stats_scale.py --mb 80 --mb 800 --tokenizer ../shared/assets/qwen2.5-tokenizer --out bench/results/x
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the model trains on records of questions and answers each one a short text about data loss step batch rank "
         "memory token kernel time value error file line field learning rate gradient checkpoint adapter weight "
         "数据 模型 训练 显存 梯度 批次 问题 回答 文本 长度").split()


def write_data(path: Path, mb: float, seed: int = 0) -> int:
    """A JSON list of alpaca records, about `mb` MB; returns the record count."""
    rng = random.Random(seed)
    n, size = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        f.write("[\n")
        while size < mb * 1e6:
            words = max(40, int(rng.gauss(520, 140)))
            text = " ".join(rng.choice(WORDS) for _ in range(words))
            cut = rng.randint(10, 60)
            rec = json.dumps({"instruction": " ".join(text.split()[:cut]), "input": "", "output": " ".join(text.split()[cut:])},
                             ensure_ascii=False)
            line = ("," if n else "") + rec + "\n"
            f.write(line)
            size += len(line.encode())
            n += 1
        f.write("]\n")
    return n


def run_stats(data: Path, tokenizer: str, cache: Path, workers: int | None) -> dict:
    cmd = [sys.executable, "-m", "tuneledger", "stats", f"model_name_or_path={tokenizer}", f"dataset={data}",
           f"cache_dir={cache}", f"output_dir={cache.parent / 'run'}", "template=qwen", "cutoff_len=4096",
           "max_invalid_ratio=1", "global_batch_size=1"]
    if workers:
        cmd.append(f"preprocessing_num_workers={workers}")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    t0 = time.perf_counter()
    log = open(cache.parent / "stats.log", "w+")  # a file, not a pipe: a full pipe would stall the run
    p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    peak = main_peak = 0
    proc = psutil.Process(p.pid)
    while p.poll() is None:
        try:
            main = proc.memory_info().rss
            rss = main + sum(c.memory_info().rss for c in proc.children(recursive=True))
            peak, main_peak = max(peak, rss), max(main_peak, main)
        except psutil.Error:
            pass
        time.sleep(0.2)
    log.seek(0)
    out = log.read()
    log.close()
    wall = time.perf_counter() - t0
    stats = json.loads((cache.parent / "run" / "stats.json").read_text()) if p.returncode == 0 else {}
    tokens = (stats.get("tokens") or {}).get("total") or 0
    cores = workers or os.cpu_count()
    return {"rc": p.returncode, "wall_s": round(wall, 1), "peak_rss_gb": round(peak / 1e9, 2),
            "main_peak_rss_gb": round(main_peak / 1e9, 2), "tokens": tokens,
            "records": (stats.get("records") or {}).get("total"), "cores": cores,
            "tokens_per_s_per_core": round(tokens / wall / cores) if tokens else None, "tail": out[-1500:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, action="append", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--work", type=Path, default=Path("/tmp/stats_scale"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for mb in a.mb:
        work = a.work / f"{mb:g}mb"
        shutil.rmtree(work, ignore_errors=True)  # no cache hit from an earlier run
        work.mkdir(parents=True)
        data = work / "data.json"
        n = write_data(data, mb)
        r = {"mb": mb, "file_mb": round(data.stat().st_size / 1e6, 1), "records_written": n,
             **run_stats(data, a.tokenizer, work / "cache", a.workers)}
        rows.append(r)
        print(f"stats_scale {mb:g} MB: {r['records']} records, {r['tokens']:,} tokens, wall {r['wall_s']} s, "
              f"peak RSS {r['peak_rss_gb']} GB (tree; main process {r['main_peak_rss_gb']} GB), {r['tokens_per_s_per_core']} tokens/s per core ({r['cores']} cores), "
              f"rc {r['rc']}", flush=True)
    (a.out / "stats_scale.json").write_text(json.dumps(rows, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
