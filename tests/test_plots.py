"""Pictures: the loss plot (train + eval, redrawn at each save) and the dry-run comparison."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tuneledger.plots import dryrun_plot, loss_plot, loss_series


def _png_size(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as im:
        return im.size


HISTORY = [{"step": 5, "loss": 2.0}, {"step": 10, "loss": 1.5}, {"step": 10, "eval_loss": 1.7},
           {"step": 15, "loss": 1.2}, {"step": 20, "loss": 1.0}, {"step": 20, "eval_loss": 1.4},
           {"step": 20, "train_runtime": 3.0}]


def test_loss_series_separates_train_and_eval():
    train, evals = loss_series(HISTORY)
    assert train == [(5, 2.0), (10, 1.5), (15, 1.2), (20, 1.0)]
    assert evals == [(10, 1.7), (20, 1.4)]


def test_loss_plot_writes_a_png_and_leaves_no_temporary(tmp_path):
    png = loss_plot(HISTORY, tmp_path / "run" / "training_loss.png", "run")
    assert png == tmp_path / "run" / "training_loss.png"
    w, h = _png_size(png)
    assert w > 300 and h > 200
    assert [p.name for p in png.parent.iterdir()] == ["training_loss.png"]
    assert loss_plot([{"step": 1, "train_runtime": 1.0}], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_plot_callback_redraws_at_each_save_on_rank_zero_only(tmp_path):
    pytest.importorskip("transformers")
    from tuneledger.trainer import PlotLoss

    png = tmp_path / "training_loss.png"
    cb = PlotLoss(png, "t")
    state = SimpleNamespace(is_world_process_zero=False, log_history=HISTORY[:2])
    cb.on_save(None, state, None)
    assert not png.exists()
    state.is_world_process_zero = True
    cb.on_save(None, state, None)  # checkpoint 1: an interrupted run keeps this picture
    first = png.read_bytes()
    state.log_history = HISTORY
    cb.on_save(None, state, None)
    assert png.read_bytes() != first


def _row(preset: str, tps: float, p10: float, p90: float, gpu_mib: float | None, rss_mib: int = 3000) -> dict:
    return {"preset": preset, "tokens_per_s": tps, "tokens_per_step": tps * 1.0,
            "step_spread": {"p10": p10, "p90": p90}, "memory_mib": [{"rank": 0, "peak_allocated": gpu_mib, "peak_rss": rss_mib}]}


def test_dryrun_plot_gpu_and_cpu_rows(tmp_path):
    rows = [_row("A", 1000, 0.9, 1.2, 20000), _row("D", 4000, 0.8, 1.1, 30000), {"preset": "B", "skipped": "x"}]
    png = dryrun_plot(rows, tmp_path / "dryrun.png", "gpu")
    assert png and _png_size(png)[0] > 500
    cpu = dryrun_plot([_row("A", 50, 0.9, 1.3, None)], tmp_path / "cpu.png", "cpu")
    assert cpu and cpu.stat().st_size > 0
    assert dryrun_plot([{"preset": "A", "skipped": "x"}], tmp_path / "no.png") is None


def seal(ckpt, step):
    """Stand-ins for what a save writes, then the manifest: only sealed checkpoints count (checkpoints.py)."""
    from tuneledger.checkpoints import REQUIRED, write_manifest

    for name in REQUIRED:
        if not (ckpt / name).exists():
            (ckpt / name).write_text("{}")
    write_manifest(ckpt, step)


def test_best_checkpoint_is_the_lowest_eval_loss_among_saved_ones(tmp_path):
    from tuneledger.checkpoints import best_checkpoint

    history = [{"step": 2, "eval_loss": 1.5}, {"step": 3, "eval_loss": 0.9}, {"step": 4, "eval_loss": 1.1},
               {"step": 6, "eval_loss": 1.2}]
    for step in (2, 4, 6):  # step 3 was evaluated but not saved
        ckpt = tmp_path / f"checkpoint-{step}"
        ckpt.mkdir()
        (ckpt / "trainer_state.json").write_text(json.dumps({"log_history": [h for h in history if h["step"] <= step]}))
        seal(ckpt, step)
    assert best_checkpoint(tmp_path) == (str(tmp_path / "checkpoint-4"), 1.1)
    assert best_checkpoint(tmp_path / "nothing") is None


def test_dryrun_pictures_draw_the_gpu_samples_and_the_comparison(tmp_path):
    """The dry-run's picture step as a GPU run reaches it (NVML rows present), on fake NVML: a CPU
    dry-run has no samples, so this branch is otherwise only run on a GPU."""
    from datetime import datetime, timedelta, timezone

    from tuneledger.dryrun import pictures
    from tuneledger.monitor.backends import FakeGpu, FakeNvml
    from tuneledger.monitor.sampler import sample

    b = FakeNvml([FakeGpu(used_mib=30000.0, util_gpu=95)])
    b.init()
    t0 = datetime(2026, 12, 2, 12, 0, tzinfo=timezone.utc)
    samples = [r for i in range(6) for r in sample(b, "h", now=t0 + timedelta(seconds=i))]
    led = {"gpu": "NVIDIA H200", "windows": [{"label": "preset D", "start": (t0 + timedelta(seconds=1)).isoformat(),
                                              "end": (t0 + timedelta(seconds=4)).isoformat()}]}
    png = pictures(led, [_row("D", 4000, 0.8, 1.1, 30000)], samples, tmp_path, "dry-run r: 1 x")
    assert png == tmp_path / "dryrun.png" and led["comparison_plot"] == str(png)
    assert led["plot"] == str(tmp_path / "dryrun-gpus.png") and _png_size(tmp_path / "dryrun-gpus.png")[0] > 300
    bare = {"gpu": "cpu", "windows": []}
    assert pictures(bare, [_row("D", 40, 0.8, 1.1, None)], [], tmp_path / "cpu", "dry-run r: 2 x") is not None
    assert "plot" not in bare  # no NVML rows, no GPU picture
