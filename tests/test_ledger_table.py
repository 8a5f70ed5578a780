"""The terminal ledger fits 100 columns, and the finding says 'tie' when the spreads overlap."""

import io

import pytest

from tuneledger import eta, ledger
from tuneledger.dryrun_report import finding, markdown, table


def row(preset, tokens_per_s, p10, p90, *, steps=4, sd=None, mem=130_000, mfu=0.383, fits=True):
    tokens_per_step = 8192.0
    s_step = tokens_per_step / tokens_per_s
    return {
        "preset": preset, "micro_batch": 8, "gradient_accumulation_steps": 2, "gradient_checkpointing": False,
        "packing": True, "s_per_step": s_step, "tokens_per_s": tokens_per_s, "tokens_per_s_per_gpu": tokens_per_s / 8,
        "tokens_per_step": tokens_per_step, "steps_measured": steps, "warmup_steps_excluded": 5,
        "step_spread": {"p10": p10, "p90": p90, "sd": (p90 - p10) / 2.56 if sd is None else sd},
        "mfu": mfu, "memory_mib": [{"peak_allocated": mem}], "fits_24gb": fits,
        "fits_24gb_note": "no (out of memory under 23 GiB; needs 126.9)" if fits is False else "yes (ran under a 23 GiB cap)",
        "save_s": 12.3, "checkpoint_bytes": 2e9,
        # A real prediction's shape (eta.predict), its total set to a long run's, for the widest ETA cell.
        "eta": {**eta.predict({"launch_s": 20.0, "model_load_s": 30.0}, [s_step] * 5, [s_step * (1 + d / 100) for d in range(-5, 6)],
                              total_steps=100_000, save_steps=200, save_s=12.3, finish_s=3.0),
                "total_s": 123 * 3600 + 45 * 60, "low_s": 122 * 3600, "high_s": 125 * 3600},
        "model": {"trainable_params": 161e6, "trainable_pct": 2.08, "attention": "sdpa"},
    }


def led(rows):
    return {"world_size": 8, "gpu": "NVIDIA H200", "synthetic": True, "presets": rows, "warmup_steps": 5}


def render(t, width):
    from rich.console import Console

    console = Console(width=width, file=io.StringIO(), record=True)
    console.print(t)
    return console.export_text()


def test_table_fits_100_columns_with_every_header_whole():
    rows = [row("D", 1_234_567, 0.0066, 0.0067, fits=False), row("C", 265_000, 0.030, 0.031),
            row("B", 200_000, 0.040, 0.041), row("A", 100_000, 0.080, 0.082)]
    text = render(table(led(rows + [{"preset": "E", "skipped": "global batch 16 is not divisible"}])), 100)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 100, text
    header = next(line for line in lines if "preset" in line and "order" in line)
    for col in ("order", "preset", "mb x acc", "s/step", "tokens/s", "MFU", "peak MiB", "24 GB", "ETA"):
        assert col in header, header
    assert "…" not in text and " rank " not in header  # no shrunk headers; "rank" reads as a DDP rank
    assert "1,234,567" in text and "123 h 45 min" in text and "130,000" in text


def test_markdown_keeps_the_columns_the_terminal_drops():
    rows = [row("A", 100_000, 0.080, 0.082)]
    md = markdown({**led(rows), "run_name": "r", "date": "d", "host": "h", "model": "m", "topology": {"link": "x", "matrix": ""},
                   "dataset": ["d.json"], "stats": {"records": {"valid": 1}, "tokens": {"trained": 1}, "steps_per_epoch": 1},
                   "global_batch_size": 16, "data_hash": "abc", "versions": {}, "dryrun_steps": 9, "config": {},
                   "presets": [{**rows[0], "split": {"method": "m", "forward_backward_s": 1, "forward_backward_per_micro_s": 1,
                                                     "micro_batches_per_step": 1, "allreduce_s": 0, "sync_wait_s": None,
                                                     "optimizer_s": 0, "other_s": 0, "data_wait_s": 0}, "allreduce": {}}]})
    assert "tokens/s/GPU" in md and "save (s)" in md and "p10-p90" in md and "out of memory" not in md
    assert "among the measured steps" not in md


def test_markdown_names_a_measured_step_that_the_profiler_or_the_memory_history_slowed():
    rows = [{**row("A", 100_000, 0.080, 0.082), "profiled_step": 3}, {**row("B", 90_000, 0.090, 0.092), "memory_step": 4}]
    split = {"method": "m", "forward_backward_s": 1, "forward_backward_per_micro_s": 1, "micro_batches_per_step": 1,
             "allreduce_s": 0, "sync_wait_s": None, "optimizer_s": 0, "other_s": 0, "data_wait_s": 0}
    md = markdown({**led(rows), "run_name": "r", "date": "d", "host": "h", "model": "m", "topology": {"link": "x", "matrix": ""},
                   "dataset": ["d.json"], "stats": {"records": {"valid": 1}, "tokens": {"trained": 1}, "steps_per_epoch": 1},
                   "global_batch_size": 16, "data_hash": "abc", "versions": {}, "dryrun_steps": 9, "config": {},
                   "presets": [{**r, "split": split, "allreduce": {}} for r in rows]})
    assert "Profiled with TUNELEDGER_PROFILE_STEP among the measured steps: A (step 3)." in md
    assert "Allocator history recorded with TUNELEDGER_MEMORY_STEP among the measured steps: B (step 4)." in md


def test_overlapping_spreads_tie_and_say_how_many_steps_would_separate_them():
    # The field case: A 266 tokens/s against C 265, p10-p90 ranges overlapping, from 4 steps.
    a, c = row("A", 266.0, 30.0, 32.5), row("C", 265.0, 30.2, 32.6)
    text = finding([a, c])
    assert text.startswith("presets A and C tie at 266 / 265 tokens/s")
    assert "fastest" not in text
    need = ledger.steps_to_separate(a, c)
    # n = 4 (cv_a^2 + cv_b^2) / d^2 with cv = sd / mean step time and d the relative difference.
    cv_a, cv_c = a["step_spread"]["sd"] / a["s_per_step"], c["step_spread"]["sd"] / c["s_per_step"]
    assert need == pytest.approx(4 * (cv_a**2 + cv_c**2) / (1 / 266) ** 2, rel=0.01)
    assert f"about {need:,} steady steps each" in text and f"dryrun_steps={need + 5}" in text


def test_clear_winner_is_fastest_and_compared_with_a():
    a, d = row("A", 100.0, 80.0, 82.0), row("D", 400.0, 20.0, 20.5)
    text = finding([a, d])
    assert text.startswith("preset D is fastest at 400 tokens/s, 4.00x preset A's 100")


def test_three_way_tie_names_them_all():
    rows = [row("A", 100.0, 80.0, 84.0), row("B", 99.0, 80.5, 84.5), row("C", 98.5, 81.0, 85.0), row("D", 50.0, 160, 165)]
    assert finding(rows).startswith("presets A, B and C tie at")


def test_equal_means_run_at_the_same_speed():
    assert "they run at the same speed" in finding([row("A", 100.0, 80, 84), row("B", 100.0, 80, 84)])


def test_markdown_puts_ddp_beside_f_per_gpu_when_memory_was_measured():
    r = {**row("A", 100_000, 0.080, 0.082), "split": {"method": "m", "forward_backward_s": 1, "forward_backward_per_micro_s": 1,
                                                      "micro_batches_per_step": 1, "allreduce_s": 0, "sync_wait_s": None,
                                                      "optimizer_s": 0, "other_s": 0, "data_wait_s": 0}, "allreduce": {},
         "per_gpu_peak": {"ddp_gib": 26.1, "activations_gib": 4.0, "f_gib": {1: 26.1, 2: 15.2, 4: 9.7, 8: 7.0},
                          "formula": "F's per-GPU peak at N GPUs = ..."}}
    md = markdown({**led([r]), "run_name": "r", "date": "d", "host": "h", "model": "m", "topology": {"link": "x", "matrix": ""},
                   "dataset": ["d.json"], "stats": {"records": {"valid": 1}, "tokens": {"trained": 1}, "steps_per_epoch": 1},
                   "global_batch_size": 16, "data_hash": "abc", "versions": {}, "dryrun_steps": 9, "config": {}})
    assert "## Per-GPU peak: DDP (one whole copy per GPU) against F (sharded), GiB" in md
    assert "| A | 26.1 | 26.1 | 15.2 | 9.7 | 7.0 |" in md and "F's per-GPU peak at N GPUs" in md


def test_what_a_longer_dry_run_would_tell_about_a_tie():
    same = ledger.separation(row("A", 100.0, 80, 84), row("B", 100.0, 80, 84), "A", "B")
    assert same.startswith("they run at the same speed")
    far = ledger.separation(row("A", 100.0, 60.0, 100.0), row("B", 100.01, 60.0, 100.0), "A", "B")
    assert far.startswith("they run at the same speed")  # over 10,000 steps: no practical run
    near = ledger.separation(row("A", 266.0, 30.0, 32.5), row("C", 265.0, 30.2, 32.6), "A", "C")
    assert near.startswith("about ") and "would separate A from C" in near
    # already apart by 2 standard errors over the steps measured, yet inside the spread
    a, b = row("A", 100.0, 0.070, 0.090, steps=400, sd=0.002), row("B", 103.0, 0.068, 0.088, steps=400, sd=0.002)
    assert "already differ by 2 standard errors over these 400 steps" in ledger.separation(a, b, "A", "B")


def _run(world: int, last_micro_s: float) -> dict:
    """A worker result of 4 steps x 2 micro-batches per rank, the last micro-batch `last_micro_s`."""
    steps, t = [], 0.0
    for i in range(4):
        micro = [1.0, last_micro_s]
        steps.append({"t_begin": t, "t_end": t + sum(micro) + 0.1, "wall_begin": 1000.0 + t, "wall_end": 1000.0 + t + sum(micro) + 0.1,
                      "micro_s": micro, "optimizer_s": 0.1, "data_wait_s": 0.0})
        t += sum(micro) + 0.1
    rank = {"rank": 0, "steps": steps, "cum_tokens": [100, 200, 300, 400], "gpu_name": "cpu",
            "peak_allocated_mib": None, "peak_reserved_mib": None, "step_losses": [1.0] * 4}
    return {"world_size": world, "ranks": [dict(rank, rank=r) for r in range(world)], "saves": [],
            "allreduce": {"median_s": 0.2} if world > 1 else {}}


def test_one_rank_has_no_sync_wait_and_two_ranks_do():
    """What the last (synchronising) micro-batch takes beyond the others is the all-reduce and the
    wait for a slower rank on 2 ranks; on one rank there is neither, and it stays in other_s (a
    `tune --nproc 1` pick was called communication-bound on 22% of 'sync wait')."""
    from tuneledger.ledger import summarize_run

    one = summarize_run(_run(1, 1.5), 1)["split"]
    assert one["allreduce_s"] == 0.0 and one["sync_wait_s"] == 0.0
    assert one["other_s"] == pytest.approx(0.5)
    two = summarize_run(_run(2, 1.5), 1)["split"]
    assert two["allreduce_s"] == pytest.approx(0.2) and two["sync_wait_s"] == pytest.approx(0.3)
    assert two["other_s"] == pytest.approx(0.0, abs=1e-9)


def test_a_preset_whose_own_settings_were_overridden_is_starred(tiny_model):
    """A `tune` candidate between the presets runs as `--preset A` with overrides: its row must not
    read as preset A. D's micro-batch cap (global / world) is D's own, not an override."""
    from tuneledger.config_load import load_config
    from tuneledger.config import preset_overrides
    from tuneledger.dryrun_report import label, override_lines

    base = {"model_name_or_path": str(tiny_model), "dataset": ["x.json"], "global_batch_size": 4}
    a = load_config(None, {**base, "preset": "A"})
    assert preset_overrides(a, 1) == {}
    packed = load_config(None, {**base, "preset": "A", "packing": True})
    assert preset_overrides(packed, 1) == {"packing": True}
    from tuneledger.config import resolve

    d = resolve(load_config(None, {**base, "preset": "D"}), 1)  # 8 capped at 4 / 1, as the dry-run runs it
    assert d.per_device_train_batch_size == 4 and preset_overrides(d, 1) == {}
    d24 = resolve(load_config(None, {**base, "preset": "D", "global_batch_size": 24}), 2)  # 12 per rank: 6 divides it
    assert d24.per_device_train_batch_size == 6 and preset_overrides(d24, 2) == {}
    row = {"preset": "A", "preset_overrides": {"packing": True}}
    assert label(row) == "A*" and label({"preset": "B", "preset_overrides": {}}) == "B"
    assert override_lines([row]) == ["* A: packing=True (the preset's own settings overridden)"]


def test_markdown_with_no_finished_preset_says_so_instead_of_an_empty_split_table():
    # A dry-run stopped (SIGTERM) before any preset's measured steps: only skipped rows.
    md = markdown({**led([{"preset": "A", "skipped": "stopped by SIGTERM before its measured steps"}]), "run_name": "r",
                   "date": "d", "host": "h", "model": "m", "topology": {"link": "x", "matrix": ""}, "dataset": ["d.json"],
                   "stats": {"records": {"valid": 1}, "tokens": {"trained": 1}, "steps_per_epoch": 1},
                   "global_batch_size": 16, "data_hash": "abc", "versions": {}, "dryrun_steps": 9, "config": {}})
    split = md.split("## Where the step time goes")[1].split("\n## ")[0]
    assert "No preset finished its measured steps" in split
    assert "| preset | forward+backward" not in split and "| --- |" not in split
    assert "| A | skipped: stopped by SIGTERM" in md
