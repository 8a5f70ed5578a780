"""One tokenized cache, every rank: per-rank memory of a CPU 2-rank run (gloo, the tiny model). A
benchmark, not a test.

    python bench/rank_cache.py --data /tmp/stats_scale/80mb/data.json --tokenizer ../shared/assets/qwen2.5-tokenizer --out bench/results/x

1. `stats` makes the cache (one process, before any rank).
2. `train --cpu --nproc 2` on it (a cache hit), then again with the cache deleted first (the
   launcher makes it, then starts the ranks). Sampled every 0.25 s: each rank's (a
   tuneledger.worker process) RssAnon, RssFile, Pss_Anon, Pss_File; the launcher's; whether any
   process other than the launcher's map workers tokenized (the ranks' logs say nothing of it).
3. The data path alone on 2 gloo ranks (torchrun, this file's --rank mode): each rank loads the
   cache as worker.py does (datasets.load_from_disk, memory-mapped) and reads every record of its
   half, once as is ("shared": the pages are the kernel's page cache, one copy for both ranks)
   and once with keep_in_memory=True ("private": what each rank holds without a shared
   memory-mapped cache). Each rank measures itself after the read.

Inputs and caches stay under --work (/tmp/rank_cache): never commit them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def mem(pid: int | str = "self") -> dict:
    """RssAnon, RssFile, Pss_Anon, Pss_File of a process, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("Pss_Anon", "Pss_File"):
                out[k] = int(v.split()[0]) * 1024
    return out


def rank_main(mode: str, path: str, out: str) -> None:
    """One rank of step 3: load the cache, read every record of this rank's half, say its memory."""
    import datasets
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    datasets.disable_progress_bars()
    before = mem()
    ds = datasets.load_from_disk(path, keep_in_memory=mode == "private").select_columns(["input_ids", "labels"])
    tokens = 0
    for i in range(rank, len(ds), world):  # what a DistributedSampler hands this rank over an epoch
        row = ds[i]  # both columns, as the collator gets them
        tokens += len(row["input_ids"])
    dist.barrier()  # both ranks hold what they read before either measures
    after = mem()
    dist.barrier()
    Path(out).with_suffix(f".rank{rank}.json").write_text(json.dumps({"mode": mode, "rank": rank, "records": len(range(rank, len(ds), world)),
                                                                      "tokens": tokens, "before": before, "after": after}))
    dist.destroy_process_group()


def sample_tree(p: subprocess.Popen, t0: float) -> dict:
    """Peaks per process role while `p` runs: 'launcher' (p), 'rank N' (tuneledger.worker), 'map'
    (the launcher's tokenizing workers: python children of the launcher that are not torchrun)."""
    import psutil

    root = psutil.Process(p.pid)
    peaks: dict[str, dict] = {}
    first: dict[str, float] = {}
    seen_cmd: dict[str, str] = {}
    while p.poll() is None:
        try:
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            break
        cmds = {q.pid: " ".join(_cmd(q)) for q in procs}
        parents = {q.pid: _ppid(q) for q in procs}
        run_pids = {pid for pid, cmd in cmds.items() if "tuneledger.torchrun" in cmd or "torch.distributed.run" in cmd}
        ranks = sorted(pid for pid, cmd in cmds.items() if parents[pid] in run_pids)
        for q in procs:
            if q.pid == root.pid:
                role = "launcher"
            elif q.pid in run_pids:
                role = "torchrun"
            elif q.pid in ranks:
                role = f"rank {ranks.index(q.pid)}"
            elif parents[q.pid] in ranks:
                role = "children of the ranks"
            else:
                role = "launcher's children (map workers, queue manager)"
            seen_cmd.setdefault(role, cmds[q.pid][:200])
            try:
                m = mem(q.pid)
            except OSError:
                continue
            first.setdefault(role, round(time.perf_counter() - t0, 1))
            cur = peaks.setdefault(role, {})
            for k, v in m.items():
                cur[k] = max(cur.get(k, 0), v)
        time.sleep(0.25)
    return {"peaks_gb": {r: {k: round(v / 1e9, 3) for k, v in m.items()} for r, m in sorted(peaks.items())},
            "first_seen_s": first, "command": seen_cmd}


def _ppid(q) -> int:
    try:
        return q.ppid()
    except Exception:
        return -1


def _cmd(q) -> list[str]:
    try:
        return q.cmdline()
    except Exception:
        return []


def run(cmd: list[str], log: Path, env: dict) -> dict:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        got = sample_tree(p, t0)
        p.wait()
    got.update(rc=p.returncode, wall_s=round(time.perf_counter() - t0, 1))
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", nargs=3, metavar=("MODE", "CACHE", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--data")
    ap.add_argument("--tokenizer")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/rank_cache"))
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    if a.rank:
        rank_main(*a.rank)
        return
    a.out.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    model = a.work / "tiny"
    if not (model / "config.json").is_file():
        sys.path.insert(0, str(ROOT / "src"))
        from tuneledger.synth import write_synthetic_model

        write_synthetic_model("tiny", model, tokenizer=a.tokenizer, device="cpu", force=True)
    cache, run_dir = a.work / "cache", a.work / "run"
    common = [f"model_name_or_path={model}", f"dataset={a.data}", f"cache_dir={cache}", "template=qwen", "cutoff_len=1024",
              "quantization_bit=null", "global_batch_size=2", "per_device_train_batch_size=1", "max_invalid_ratio=1",
              "report_to=none", "plot_loss=false", "save_steps=100000", "logging_steps=1", f"max_steps={a.steps}",
              "gradient_checkpointing=false"]
    tl = [sys.executable, "-m", "tuneledger"]
    result: dict = {"data": a.data, "data_mb": round(Path(a.data).stat().st_size / 1e6, 1)}
    for old in (cache, run_dir, a.work / "train-hit", a.work / "train-built"):  # nothing from an earlier run
        shutil.rmtree(old, ignore_errors=True)
    result["stats"] = run([*tl, "stats", *common, f"output_dir={run_dir}"], a.out / "stats.log", env)
    stats = json.loads((run_dir / "stats.json").read_text())
    path = cache / stats["cache_key"]
    result["cache"] = {"records": stats["records"]["valid"], "tokens": stats["tokens"]["total"],
                       "arrow_mb": round(sum(f.stat().st_size for f in path.glob("*.arrow")) / 1e6, 1)}
    print(f"cache {path}: {result['cache']}", flush=True)
    result["train_hit"] = run([*tl, "train", *common, f"output_dir={a.work / 'train-hit'}", "--cpu", "--nproc", "2"],
                              a.out / "train-cache-hit.log", env)
    shutil.rmtree(cache)
    result["train_built"] = run([*tl, "train", *common, f"output_dir={a.work / 'train-built'}", "--cpu", "--nproc", "2"],
                                a.out / "train-cache-built-by-launcher.log", env)
    for mode in ("shared", "private"):
        out = a.work / f"ranks-{mode}"
        got = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, "--rank",
                   mode, str(path), str(out)], a.out / f"ranks-{mode}.log", {**env, "GLOO_SOCKET_IFNAME": "lo"})
        got["ranks"] = [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in (0, 1)]
        result[f"ranks_{mode}"] = got
    (a.out / "rank_cache.json").write_text(json.dumps(result, indent=1))
    for key in ("train_hit", "train_built"):
        print(key, json.dumps(result[key]["peaks_gb"]), f"first seen {result[key]['first_seen_s']}", flush=True)
    for mode in ("shared", "private"):
        for r in result[f"ranks_{mode}"]["ranks"]:
            d = {k: round((r["after"][k] - r["before"][k]) / 1e9, 3) for k in r["after"]}
            print(f"ranks {mode} rank {r['rank']}: read {r['records']} records; after - before (GB): {d}", flush=True)


if __name__ == "__main__":
    main()
