#!/usr/bin/env bash
# The host probe's spread on one idle machine: 20 rounds, seconds apart; each round is the median of
# 20 probes (probes.host_probe_us, 2,000 torch.add calls each), as a run's ledger keeps its median.
#   bash bench/results/cpu-2026-12-04-host-probe/run.sh > bench/results/cpu-2026-12-04-host-probe/probe.log
cd "$(dirname "$0")/../../.." && PYTHONPATH=src ${PY:-.venv/bin/python} - <<'PY'
import os, statistics, time, platform
import torch
from tuneledger.probes import host_probe_us
print(f"host: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, load {os.getloadavg()}, torch {torch.__version__}")
meds = []
for i in range(20):
    m = statistics.median(host_probe_us() for _ in range(20))
    meds.append(m)
    print(f"round {i + 1:2d}: median of 20 probes {m:.3f} µs per torch op")
    time.sleep(2)
print(f"spread of the 20 medians: {min(meds):.2f}-{max(meds):.2f} µs, median {statistics.median(meds):.2f}")
PY
