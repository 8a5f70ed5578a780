"""`tuneledger gpus` against FakeNvml: free-GPU verdicts, reasons, --pick and exit codes.

The shared-machine case mirrors the field report (seeds/000): of eight 4090s, two hold an idle
vLLM (21.7 GB, 0% util), the best leftover holds 4.8 GB, the rest train.
"""

from __future__ import annotations

import argparse

import pytest

from tuneledger.cli import build_parser
from tuneledger.gpus import MAX_USED_MIB, judge, pick, run, verdict
from tuneledger.monitor.backends import FakeGpu, FakeNvml
from tuneledger.monitor.sampler import Monitor

GB_21_7 = 21.7 * 1024  # MiB


def row(**kw) -> dict:
    base = {"gpu": 0, "uuid": "GPU-a", "name": "NVIDIA GeForce RTX 4090", "status": "ok", "mem_used_mib": 2.0,
            "mem_total_mib": 24564.0, "util_gpu_pct": 0, "n_procs": 0, "procs": "", "error": None}
    base.update(kw)
    return base


def test_idle_server_at_0_percent_util_is_busy():
    v, why = verdict(row(mem_used_mib=GB_21_7, n_procs=1, procs="4242:22200", util_gpu_pct=0))
    assert v == "busy"
    assert why.startswith("busy: 21.7 GiB of 24.0 GiB held by 1 process, util 0% (idle server")
    assert "4242:22200" in why


def test_memory_held_with_no_visible_process_is_busy():
    # a container without the host's PID namespace: NVML lists no process, the memory is still taken
    v, why = verdict(row(mem_used_mib=4.8 * 1024, n_procs=0, util_gpu_pct=0))
    assert v == "busy" and "4.8 GiB" in why and "no process NVML can list" in why


def test_a_process_under_the_memory_threshold_still_makes_it_busy():
    v, why = verdict(row(mem_used_mib=412.0, n_procs=1, procs="99:400", util_gpu_pct=3))
    assert v == "busy" and why.startswith("busy: 1 compute process holding 412 MiB, util 3%")


def test_free_whatever_the_util_and_the_threshold_edge():
    v, why = verdict(row(mem_used_mib=3.0))
    assert v == "free" and why == "free: 3 MiB used of 24.0 GiB, no compute process, util 0%"
    v, why = verdict(row(mem_used_mib=300.0, util_gpu_pct=80))  # a display server's load
    assert v == "free" and "non-compute" in why
    assert verdict(row(mem_used_mib=MAX_USED_MIB - 1))[0] == "free"
    assert verdict(row(mem_used_mib=MAX_USED_MIB))[0] == "busy"
    assert verdict(row(mem_used_mib=2000.0), max_used_mib=4096)[0] == "free"


def test_busy_and_working_has_no_idle_note():
    v, why = verdict(row(mem_used_mib=13.6 * 1024, n_procs=1, util_gpu_pct=95))
    assert v == "busy" and "util 95%" in why and "idle" not in why


def test_process_list_unavailable_judged_on_memory():
    assert verdict(row(n_procs=None))[1].endswith("judged on memory alone")
    v, why = verdict(row(mem_used_mib=9000.0, n_procs=None))
    assert v == "busy" and "process list unavailable" in why


def test_unavailable_gpu_is_unknown_never_free():
    v, why = verdict(row(status="unavailable", mem_used_mib=None, error="GPU 3: GPU is lost"))
    assert (v, why) == ("unknown", "unknown: GPU 3: GPU is lost")


def shared_box() -> FakeNvml:
    """The field report's shared 8x 4090 machine, plus one truly free card (index 7)."""
    gpus = []
    for i in range(8):
        g = FakeGpu(name="NVIDIA GeForce RTX 4090", total_mib=24564.0)
        if i in (2, 5):  # idle vLLM
            g.used_mib, g.util_gpu, g.procs = GB_21_7, 0, [(5000 + i, GB_21_7 - 300)]
        elif i == 6:  # the leftover that still holds 4.8 GB
            g.used_mib, g.util_gpu, g.procs = 4.8 * 1024, 0, [(6000, 4.8 * 1024 - 300)]
        elif i == 7:
            g.used_mib = 0.0
        else:  # someone's training run
            g.used_mib, g.util_gpu, g.procs = 13.7 * 1024, 95, [(7000 + i, 13.7 * 1024 - 300)]
        gpus.append(g)
    return FakeNvml(gpus)


def test_judge_the_shared_machine():
    rows = Monitor(shared_box(), "h").poll()
    judged = judge(rows)
    assert [r["verdict"] for r in judged] == ["busy"] * 7 + ["free"]
    assert "(idle server" in judged[2]["reason"] and "(idle server" in judged[5]["reason"]
    assert "4.8 GiB" in judged[6]["reason"]
    assert pick(judged, 1) == "7"
    assert pick(judged, 2) is None


def test_pick_uses_indices_for_alike_gpus_and_uuids_for_mixed():
    judged = judge(Monitor(FakeNvml([FakeGpu(), FakeGpu(), FakeGpu()]), "h").poll())
    assert pick(judged, 2) == "0,1"
    assert pick(judged, 2, use_uuid=True) == "GPU-fake-0000,GPU-fake-0001"
    mixed = judge(Monitor(FakeNvml([FakeGpu(), FakeGpu(name="NVIDIA A100-SXM4-80GB")]), "h").poll())
    assert pick(mixed, 2) == "GPU-fake-0000,GPU-fake-0001"


def args(backend, *argv) -> argparse.Namespace:
    ns = build_parser().parse_args(["gpus", *argv])
    ns.backend = backend
    return ns


def test_run_pick_prints_only_the_value_on_stdout(capsys):
    assert run(args(shared_box(), "--pick", "1")) == 0
    out, err = capsys.readouterr()
    assert out == "7\n"
    assert "idle server" in err  # the table went to stderr


def test_run_pick_too_many_exits_1(capsys):
    assert run(args(shared_box(), "--pick", "2")) == 1
    out, err = capsys.readouterr()
    assert out == "" and "2 free GPUs wanted, 1 free of 8" in err


def test_run_table_and_json(capsys):
    assert run(args(shared_box())) == 0
    out = capsys.readouterr().out
    assert "free: 0 MiB used of 24.0 GiB" in out and out.count("busy:") == 7
    assert run(args(shared_box(), "--json", "--max-used-mib", "8000")) == 0
    import json

    judged = json.loads(capsys.readouterr().out)
    assert [r["verdict"] for r in judged][6:] == ["busy", "free"]  # 4.8 GB < 8000 MiB, but its process counts


def test_run_without_nvml_exits_1(capsys):
    assert run(args(FakeNvml(missing=True))) == 1
    assert "no GPU: NVML unavailable" in capsys.readouterr().err
    assert run(args(FakeNvml(missing=True), "--pick", "1")) == 1


def test_pick_must_be_positive(capsys):
    """A usage error, as any count option below its least (exit 2, argparse's line)."""
    with pytest.raises(SystemExit) as e:
        run(args(shared_box(), "--pick", "0"))
    assert e.value.code == 2 and "argument --pick: must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("env", ["0,1"])
def test_cuda_visible_devices_note(monkeypatch, capsys, env):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    run(args(shared_box()))
    assert "NVML lists every GPU" in capsys.readouterr().err
