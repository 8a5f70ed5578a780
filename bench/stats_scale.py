"""`tuneledger stats` at scale: synthetic alpaca data (its own text, no licence) of a given size,
counted with the real Qwen2.5 tokenizer. A benchmark, not a test.

    python bench/stats_scale.py --mb 80 --mb 800 --tokenizer ../shared/assets/qwen2.5-tokenizer --out bench/results/x

Memory, sampled every 0.25 s from /proc (the stats process is `main`; its map and save workers
and datasets' queue manager are the tree):
  main peak RSS        VmHWM, the kernel's own peak of the main process (anonymous + file + shmem)
  main peak anon/file  the largest RssAnon and RssFile seen. Anonymous memory is the process's
                       own (heap, Python objects); file-backed pages are memory-mapped files
                       (the Arrow data, the libraries), clean, dropped by the kernel under pressure
  tree peak PSS        the largest sum of Pss_Anon / Pss_File (smaps_rollup) over the tree: pages
                       shared by forked workers counted once, unlike a sum of RSS
Time: wall; CPU seconds of the main process and of everything else in the tree (getrusage of
the waited children, less main's), so that a per-core rate holds on a machine shared with other
work: tokens per CPU-second of the tokenizing workers. `project` gives the wall time at N cores:
main's CPU (serial: reading, validating, saving) plus the workers' CPU spread over N.

The input files and caches stay under --work (/tmp/stats_scale): never commit them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
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


def _status(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "RssAnon", "RssFile", "RssShmem", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _pss(pid: int) -> tuple[int, int]:
    anon = file = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key == "Pss_Anon":
                anon = int(value.split()[0]) * 1024
            elif key == "Pss_File":
                file = int(value.split()[0]) * 1024
    return anon, file


class Sampler:
    """Peaks of the process `pid` and its tree, and when its first child came and its last went."""

    def __init__(self, pid: int):
        self.proc = psutil.Process(pid)
        self.peak = {"main_hwm": 0, "main_anon": 0, "main_file": 0, "tree_pss_anon": 0, "tree_pss_file": 0,
                     "tree_rss": 0}
        self.main_cpu = 0.0
        self.children_seen: list[float] = []
        self.timeline: list[tuple[float, int, int]] = []  # (s, main anon MB, main file MB) when either moved 16 MB

    def sample(self, t: float) -> None:
        try:
            st = _status(self.proc.pid)
            main_pss = _pss(self.proc.pid)
            self.main_cpu = sum(self.proc.cpu_times()[:2])
            kids = self.proc.children(recursive=True)
        except (OSError, psutil.Error):  # it has just ended
            return
        self.peak["main_hwm"] = max(self.peak["main_hwm"], st.get("VmHWM", 0))
        self.peak["main_anon"] = max(self.peak["main_anon"], st.get("RssAnon", 0))
        self.peak["main_file"] = max(self.peak["main_file"], st.get("RssFile", 0))
        point = (round(t, 1), st.get("RssAnon", 0) >> 20, st.get("RssFile", 0) >> 20)
        if not self.timeline or max(abs(point[1] - self.timeline[-1][1]), abs(point[2] - self.timeline[-1][2])) >= 16:
            self.timeline.append(point)
        (anon, file), rss = main_pss, st.get("VmRSS", 0)
        for k in kids:
            try:
                a, f = _pss(k.pid)
                rss += _status(k.pid).get("VmRSS", 0)
            except OSError:
                continue
            anon, file = anon + a, file + f
        self.peak["tree_pss_anon"] = max(self.peak["tree_pss_anon"], anon)
        self.peak["tree_pss_file"] = max(self.peak["tree_pss_file"], file)
        self.peak["tree_rss"] = max(self.peak["tree_rss"], rss)
        if kids:
            self.children_seen.append(t)


def run_stats(data: Path, tokenizer: str, cache: Path, workers: int | None, log_path: Path) -> dict:
    cmd = [sys.executable, "-m", "tuneledger", "stats", f"model_name_or_path={tokenizer}", f"dataset={data}",
           f"cache_dir={cache}", f"output_dir={cache.parent / 'run'}", "template=qwen", "cutoff_len=4096",
           "max_invalid_ratio=1", "global_batch_size=1"]
    if workers:
        cmd.append(f"preprocessing_num_workers={workers}")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log_path, "w+") as log:  # a file, not a pipe: a full pipe would stall the run
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        sampler = Sampler(p.pid)
        while p.poll() is None:
            sampler.sample(time.perf_counter() - t0)
            time.sleep(0.25)
        wall = time.perf_counter() - t0
        log.seek(0)
        out = log.read()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    tree_cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    stats = json.loads((cache.parent / "run" / "stats.json").read_text()) if p.returncode == 0 else {}
    tokens = (stats.get("tokens") or {}).get("total") or 0
    cores = len(os.sched_getaffinity(0))
    worker_cpu = max(tree_cpu - sampler.main_cpu, 1e-9)
    seen = sampler.children_seen
    return {"rc": p.returncode, "wall_s": round(wall, 1), "records": (stats.get("records") or {}).get("total"),
            "tokens": tokens, "cores": cores,
            **{f"{k}_gb": round(v / 1e9, 3) for k, v in sampler.peak.items()},
            "main_cpu_s": round(sampler.main_cpu, 1), "worker_cpu_s": round(worker_cpu, 1),
            "workers_s": round(seen[-1] - seen[0], 1) if seen else 0.0,
            "tokens_per_s_per_core_wall": round(tokens / wall / cores) if tokens else None,
            "tokens_per_cpu_s_workers": round(tokens / worker_cpu) if tokens else None,
            "main_timeline_mb": sampler.timeline,
            "progress_lines": [line for line in out.splitlines() if line.startswith(("reading ", "tokenizing "))][-4:],
            "tail": out[-1200:]}


def project(r: dict, cores: int, tokens: float | None = None) -> float:
    """Wall seconds at `cores` for `tokens` (default: this run's): main's CPU as it was (serial)
    plus the workers' CPU per token, spread over `cores`."""
    tokens = tokens or r["tokens"]
    return r["main_cpu_s"] * tokens / r["tokens"] + r["worker_cpu_s"] * tokens / r["tokens"] / cores


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, action="append", required=True)
    ap.add_argument("--tokenizer", required=True, help="a folder with the tokenizer (a model folder works)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--workers", type=int, default=None, help="preprocessing_num_workers (default: every core)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/stats_scale"))
    ap.add_argument("--project-tokens", type=float, default=185e6, help="tokens of the projection (the field report's)")
    ap.add_argument("--project-cores", type=int, default=16)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    tok = Path(a.tokenizer)
    if not (tok / "config.json").is_file():  # stats reads a model's config.json: make a tiny model around the tokenizer
        model = a.work / "tinyq"
        if not (model / "config.json").is_file():
            sys.path.insert(0, str(ROOT / "src"))
            from tuneledger.synth import write_synthetic_model

            write_synthetic_model("tiny", model, tokenizer=str(tok), device="cpu", force=True)
        tok = model
    rows = []
    for mb in a.mb:
        work = a.work / f"{mb:g}mb"
        data = work / "data.json"
        if not data.is_file():
            work.mkdir(parents=True, exist_ok=True)
            write_data(data, mb)
        shutil.rmtree(work / "cache", ignore_errors=True)  # no cache hit from an earlier run
        shutil.rmtree(work / "run", ignore_errors=True)
        r = {"mb": mb, "file_mb": round(data.stat().st_size / 1e6, 1),
             **run_stats(data, str(tok), work / "cache", a.workers, a.out / f"stats-{mb:g}mb.log")}
        if r["tokens"]:
            r[f"projected_{a.project_cores}_cores_s"] = round(project(r, a.project_cores, a.project_tokens), 1)
        rows.append(r)
        print(f"stats_scale {mb:g} MB: {r['records']} records, {r['tokens']:,} tokens, wall {r['wall_s']} s; main peak RSS "
              f"{r['main_hwm_gb']} GB (anon {r['main_anon_gb']}, file {r['main_file_gb']}); tree PSS anon "
              f"{r['tree_pss_anon_gb']} file {r['tree_pss_file_gb']} GB (RSS sum {r['tree_rss_gb']}); CPU main "
              f"{r['main_cpu_s']} s, workers {r['worker_cpu_s']} s; {r['tokens_per_s_per_core_wall']} tokens/s per core "
              f"(wall, {r['cores']} cores), {r['tokens_per_cpu_s_workers']} tokens per worker CPU-second; "
              f"{a.project_tokens / 1e6:g}M tokens on {a.project_cores} cores: "
              f"{r.get(f'projected_{a.project_cores}_cores_s')} s; rc {r['rc']}", flush=True)
        (a.out / "stats_scale.json").write_text(json.dumps(rows, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
