"""A dry-run preset's ledger row from its worker's result: the measured figures (`entry`), the
whole train command's ETA (`predict`, eta.py) and the bottleneck verdict (`verdict`, diagnose.py)."""

from __future__ import annotations

from tuneledger import eta as eta_
from tuneledger import ledger
from tuneledger.config import JobConfig, preset_overrides
from tuneledger.launch import used_gpus


def verdict(row: dict, rows: list[dict], nproc: int, cpu: bool = False) -> dict:
    """GPU figures of the steady window (from the sampler's rows) and the bottleneck verdict.
    Only the GPUs the ranks used count: an idle neighbour must not dilute the utilisation.
    `cpu`: a CPU run, whose verdict does not send the user to the GPU monitor."""
    from tuneledger.diagnose import diagnose, load_thresholds, memory_levers, untried_levers
    from tuneledger.monitor.summary import summarize_window

    gpu = summarize_window(rows, *row["window_utc"], gpus=used_gpus(nproc)) if rows else None
    total = max((g["mem_total_mib"] or 0) for g in gpu["gpus"]) if gpu and gpu["gpus"] else None
    # Allocated, not reserved: the caching allocator keeps freed blocks (packed batches of varying
    # length fragment it: 130 GiB reserved for 69 GiB allocated, preset D on one H200) and gives
    # them back before it would run out, so reserved memory overstates what the run needs.
    peak = max((m["peak_allocated"] or 0) for m in row["memory_mib"])
    split = row["split"]
    inputs = {
        "util_mean_pct": gpu["util_mean_pct"] if gpu else None,
        "mem_peak_frac": peak / total if total and peak else None,
        "allreduce_share": (split["allreduce_s"] + (split["sync_wait_s"] or 0.0)) / row["s_per_step"],
        "data_wait_share": split["data_wait_s"] / row["s_per_step"],
        "micro_batch": row["micro_batch"], "gradient_checkpointing": row["gradient_checkpointing"], "mfu": row["mfu"],
        "imbalance": gpu["imbalance"] if gpu else None, "util_spread_pts": gpu["util_spread_pts"] if gpu else None,
        "on_cpu": cpu, "untried_levers": untried_levers(row), "memory_levers": memory_levers(row),
    }
    return {"gpu_window": gpu, "diagnosis_inputs": inputs, "diagnosis": diagnose(inputs, load_thresholds())}


def predict(cfg: JobConfig, result: dict, stats: dict, startup: dict) -> dict:
    """The whole train command's ETA (eta.predict) from this preset's dry-run: `startup` holds the
    parts this process measured (python_start_s, preflight_s, data_s), the worker's timeline the
    rest; the finish adds the final adapter's copy (checkpoints.time_publish) and the first loss
    plot, each save a later plot (trainer.time_loss_plot). eval_s is measured when evaluation is
    configured (0 otherwise)."""
    w = cfg.dryrun_warmup_steps
    launcher = result["launcher"]
    parts = eta_.worker_parts(result, launcher["t_launch"], launcher["t_exit"])
    measured = {**startup, **{k: parts[k] for k in ("launch_s", "model_load_s", "setup_s")}}
    # train redraws its loss plot at every save and at the end (trainer.time_loss_plot): a later
    # draw per save, the first (matplotlib's import) in the finish.
    plot = result.get("plot_timing") or {}
    save_s = (parts["save_s"][0] if parts["save_s"] else 0.0) + plot.get("next_s", 0.0)
    steps = ledger.total_steps(stats, cfg)
    # The run's evaluations: how many it makes x one evaluation (seconds per eval record, measured
    # on a sample in the dry-run, x every eval record).
    timing = result.get("eval_timing")
    eval_s = ledger.evaluations(steps, cfg, stats["steps_per_epoch"]) * timing["s_per_record"] * timing["eval_records"] \
        if timing else 0.0
    return eta_.predict(measured, parts["durations"][:w], parts["durations"][w:], steps,
                        cfg.save_steps, save_s, parts["finish_s"] + (launcher.get("publish_s") or 0.0) + plot.get("first_s", 0.0),
                        eval_s=eval_s,
                        measured=[k for k in eta_.PARTS if k != "eval_s" or timing], compiled=ledger.compiled(result["model"]),
                        warm_compile_s=(result.get("warm_compile") or {}).get("compile_s"))



def entry(cfg: JobConfig, result: dict, stats: dict, world: int, startup: dict | None = None) -> dict:
    """One preset's ledger row from its worker result."""
    s = ledger.summarize_run(result, cfg.dryrun_warmup_steps)
    model = result["model"]
    save_s = result["save_s"][0] if result["save_s"] else 0.0
    e = predict(cfg, result, stats, startup or {})
    peak = result.get("peak_tflops")
    u = ledger.mfu(s["tokens_per_s"], model["matmul_params"], cfg.gradient_checkpointing, world, peak * 1e12 if peak else None)
    return {
        "preset": cfg.preset, "preset_overrides": preset_overrides(cfg, world), "micro_batch": cfg.per_device_train_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "gradient_checkpointing": cfg.gradient_checkpointing, "packing": cfg.packing,
        **s, "mfu": u, "peak_tflops_measured": peak,
        "save_s": save_s, "checkpoint_bytes": result["checkpoint_bytes"], "eta": e,
        # What only a train does, timed here for its ETA (predict): the final adapter's copy, the loss plot.
        "publish_s": (result.get("launcher") or {}).get("publish_s"), "plot_timing": result.get("plot_timing"),
        "train_loss": result["train_loss"], "model": model, "allreduce": result.get("allreduce") or {},
        "report_to": result.get("report_to"),  # what was written, not what was asked
        "alloc_retries": max((r.get("alloc_retries") or 0) for r in result["ranks"]),
        "config": cfg.model_dump(),
    }
