"""The dry-run ledger as a user reads it: dryrun.md (`markdown`, with the ETA's parts), the
terminal table (`table`, `print_table`) and the one-sentence finding (`finding`). The rows come
from dryrun.py, which measures them; nothing here measures or computes beyond formatting.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tuneledger import eta as eta_
from tuneledger import ledger
from tuneledger.ledger import fmt_h, plural
from tuneledger.speed import levers_line


def _pct(x: float | None) -> str:
    return f"{x:.1%}" if x else "-"


def _n(x: float | None, spec: str = ",.0f") -> str:
    return "-" if x is None else format(x, spec)


def _nodes_line(n: dict) -> str:
    nccl = n.get("nccl") or {}
    link = (f"NCCL {nccl.get('network') or '?'} ({', '.join(nccl.get('inter_node') or []) or 'no NET channel logged'})"
            if nccl else "NCCL transport not logged")
    bw = f", all-reduce bus bandwidth {n['allreduce_busbw_gbs']:.2f} GB/s" if n.get("allreduce_busbw_gbs") else ""
    return f"- nodes: {n['nnodes']} x {n['gpus_per_node']} ({', '.join(n['hosts'])}); between nodes: {link}{bw}"


def markdown(led: dict) -> str:
    rows = [r for r in led["presets"] if "s_per_step" in r]
    synth = " (SYNTHETIC weights: speed and memory are the real architecture's, outputs are noise)" if led["synthetic"] else ""
    lines = [
        f"# Dry-run ledger: {led['run_name']}", "",
        f"- date: {led['date']}; host: {led['host']}",
        f"- model: {led['model']}{synth}",
        f"- hardware: {led['world_size']} x {led['gpu']}; link: {led['topology']['link']}",
        *([_nodes_line(led["nodes"])] if led.get("nodes") else []),
        f"- data: {', '.join(led['dataset'])} ({led['stats']['records']['valid']:,} records, {led['stats']['tokens']['trained']:,} tokens, "
        f"{led['stats']['steps_per_epoch']:,} steps/epoch at global batch {led['global_batch_size']}); cache {led['data_hash']}",
        f"- versions: {', '.join(f'{k} {v}' for k, v in led['versions'].items() if v)}",
        f"- steps: {led['dryrun_steps']} per preset: the run's own first {led['warmup_steps']} (its warm-up: compilation, allocator "
        f"growth; timed for the ETA, left out of s/step), then real steps of the run drawn evenly across it; s/step is their median",
        "", "| preset | micro-batch x accum | GC | packing | s/step median | tokens/s | tokens/s/GPU | MFU | peak mem (MiB) | fits 24 GB | save (s) | ckpt (GB) | ETA |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in sorted(rows, key=lambda r: -r["tokens_per_s"]):
        mem = peak_mib(r)
        lines.append(
            f"| {label(r)} | {r['micro_batch']} x {r['gradient_accumulation_steps']} | {'on' if r['gradient_checkpointing'] else 'off'} "
            f"| {'on' if r['packing'] else 'off'} | {r['s_per_step']:.3f} (p10-p90 {r['step_spread']['p10']:.3f}-{r['step_spread']['p90']:.3f}) "
            f"| {r['tokens_per_s']:,.0f} | {r['tokens_per_s_per_gpu']:,.0f} | {_pct(r['mfu'])} | {mem} "
            f"| {r.get('fits_24gb_note', '-')} | {r['save_s']:.1f} | {r['checkpoint_bytes'] / 1e9:.2f} | {eta_.fmt_eta(r['eta'])} |")
    for r in led["presets"]:
        if "skipped" in r:
            lines.append(f"| {r['preset']} | skipped: {r['skipped']} |||||||||||| ")
    for key, how, whose in (("profiled_step", "Profiled with TUNELEDGER_PROFILE_STEP", "The profiler's"),
                            ("memory_step", "Allocator history recorded with TUNELEDGER_MEMORY_STEP",
                             "The allocator history's")):
        slowed = [f"{r['preset']} (step {r[key]})" for r in rows if r.get(key)]
        if slowed:
            lines += ["", f"{how} among the measured steps: {', '.join(slowed)}. {whose} bookkeeping slows "
                      f"{'that step' if len(slowed) == 1 else 'those steps'}: the median s/step hardly moves, "
                      "but the mean s/step rises and the tokens/s on the mean step falls."]
    # How every number was made: the attention backend, Liger, fused LoRA, compile (speed.py, fused_lora.py, compiled.py).
    lines += [f"\n{x}" for x in override_lines(rows)]
    lines += [""] + common_lines("- levers", {r["preset"]: r["model"].get("levers") or {} for r in rows})
    lines += eta_markdown(rows)
    fit = [r for r in rows if r.get("per_gpu_peak")]
    if fit:
        worlds = list(fit[0]["per_gpu_peak"]["f_gib"])
        lines += ["", "## Per-GPU peak: DDP (one whole copy per GPU) against F (sharded), GiB", "",
                  "| preset | DDP, any world size | " + " | ".join(f"F at {n} GPU{'s' if n > 1 else ''}" for n in worlds) + " |",
                  "| --- | --- | " + " | ".join("---" for _ in worlds) + " |"]
        for r in fit:
            f = r["per_gpu_peak"]
            lines.append(f"| {r['preset']} | {f['ddp_gib']:.1f} | " + " | ".join(f"{f['f_gib'][n]:.1f}" for n in worlds) + " |")
        lines += ["", f"{fit[0]['per_gpu_peak']['formula']} (sharding.predicted_peak_gib)."]
    lines += ["", "## Where the step time goes (seconds per optimizer step, steady state; adds up to the window's mean step)", ""]
    if rows:
        lines += ["| preset | forward+backward (per micro-batch x n) | all-reduce | sync wait | optimizer | other | data wait | all-reduce bus GB/s |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    else:  # every preset skipped or stopped: no steady window to split
        lines.append("No preset finished its measured steps: nothing to split (see the skipped rows above).")
    for r in rows:
        p = r["split"]
        bw = r["allreduce"].get("busbw_gbs")
        lines.append(f"| {r['preset']} | {p['forward_backward_s']:.3f} ({p['forward_backward_per_micro_s']:.3f} x {p['micro_batches_per_step']}) "
                     f"| {p['allreduce_s']:.4f} | {_n(p['sync_wait_s'], '.4f') if p['sync_wait_s'] is not None else 'n/a (accum 1)'} "
                     f"| {p['optimizer_s']:.4f} | {p['other_s']:.4f} | {p['data_wait_s']:.4f} "
                     f"| {bw if bw is None else round(bw, 1)} |")
    for method in dict.fromkeys(r["split"]["method"] for r in rows):
        lines += ["", f"Split method ({', '.join(r['preset'] for r in rows if r['split']['method'] == method)}): {method}."]
    if rows:
        lines += ["", "The all-reduce is timed on the training process group with the "
                  "gradient's size; 'sync wait' is what the synchronising micro-batch costs beyond forward+backward and the all-reduce "
                  "(mostly waiting for the slower rank)."]
    probes = [f"{r['preset']} {r['host_probe_us']:.2f}" for r in rows if r.get("host_probe_us")]
    if probes:
        lines += ["", f"Host probe, µs per torch op call (probes.host_probe_us: the host's "
                  f"speed at those moments, a pointer for a host-bound preset; `train` prints its own beside it): {', '.join(probes)}."]
    gpu_rows = [(r["preset"], g) for r in rows for g in ((r.get("gpu_window") or {}).get("gpus") or [])]
    if gpu_rows:
        lines += ["", "## GPUs over the steady window (NVML, sampled every 0.5 s)", "",
                  "| preset | GPU | samples | util mean (min-max) % | memory used max / total MiB | power mean W |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for p, g in gpu_rows:
            lines.append(f"| {p} | {g['gpu']} {g['name']} | {g['samples']} | {_n(g['util_mean_pct'])} ({_n(g['util_min_pct'])}-{_n(g['util_max_pct'])}) "
                         f"| {_n(g['mem_used_max_mib'])} / {_n(g['mem_total_mib'])} | {_n(g['power_mean_w'])} |")
        imb = [r["preset"] for r in rows if (r.get("gpu_window") or {}).get("imbalance")]
        if imb:
            lines.append(f"\nImbalance between GPUs (utilisation spread above the threshold) in: {', '.join(imb)}.")
    if led.get("comparison_plot"):
        lines += ["", f"![tokens/s (p10-p90) and peak memory against a 24 GB card]({Path(led['comparison_plot']).name})"]
    if led.get("plot"):
        lines += ["", f"![GPU utilisation, memory, power and temperature]({Path(led['plot']).name})"]
    if led.get("verdicts"):
        lines += ["", "## Verdict", ""] + [f"- **{p}**: {v}" for p, v in led["verdicts"].items()]
    if led.get("finding"):
        lines += ["", f"**Finding:** {led['finding']}"]
    lines += ["", "## Config (before presets; each preset's resolved config is in dryrun.json)", "", "```json",
              json.dumps(led["config"], indent=1), "```", "",
              "## Topology", "", "```", led["topology"]["matrix"].strip() or "n/a", "```", ""]
    return "\n".join(lines)


def eta_markdown(rows: list[dict]) -> list[str]:
    """The ETA section: the whole `train` command per preset, part by part, in seconds."""
    if not rows:
        return []
    names = [k.removesuffix("_s").replace("_", " ") for k in eta_.PARTS]
    lines = ["", "## ETA of the whole `train` command (seconds; docs/eta.md)", "",
             "| preset | " + " | ".join(names) + " | total (range) |", "| --- " * (len(names) + 2) + "|"]
    for r in rows:
        p = r["eta"]["parts"]
        lines.append(f"| {r['preset']} | " + " | ".join(f"{p[k]:.1f}" for k in eta_.PARTS) + f" | {eta_.fmt_eta(r['eta'])} |")
    e = rows[0]["eta"]
    no_eval = "" if "eval_s" in e["measured"] else "; eval s is 0 (no evaluation configured)"
    lines += ["", f"Measured by this dry-run: {', '.join(e['measured'])}{no_eval}. "
              f"Steps: all {e['total_steps']:,} at the median s/step (the run's first {e['warmup_steps']} too: timed "
              f"here they took {e.get('warmup_measured_s', 0):.1f} s, with a fresh machine's first-use costs); "
              f"{ledger.plural(e['checkpoints'], 'save')} (every save_steps and the final one) at the save time measured here. "
              "The range is the median's 5-95% bootstrap interval over the measured steps."]
    return lines


def finding(rows: list[dict]) -> str | None:
    """The one sentence the user must not miss: which preset wins, and by how much over A."""
    done = [r for r in rows if "tokens_per_s" in r]
    if len(done) < 2:
        return None
    ranked = sorted(done, key=lambda r: -r["tokens_per_s"])
    best = ranked[0]
    base = next((r for r in done if r["preset"] == "A"), None)
    tied = [r for r in ranked[1:] if ledger.overlap(best, r)]
    if tied:
        # The measured spread cannot order them: saying "fastest" would be noise read as a result.
        names = " and ".join(", ".join(r["preset"] for r in [best, *tied]).rsplit(", ", 1))
        speeds = " / ".join(format(r["tokens_per_s"], ",.0f") for r in [best, *tied])
        text = (f"presets {names} tie at {speeds} tokens/s: "
                f"their p10-p90 ranges overlap over {best['steps_measured']} measured steps; "
                + ledger.separation(best, tied[0], best["preset"], tied[0]["preset"]))
        text += "; choose among them by memory or ETA"
    else:
        text = f"preset {best['preset']} is fastest at {best['tokens_per_s']:,.0f} tokens/s"
    if base and base is not best and base not in tied:
        text += f", {best['tokens_per_s'] / base['tokens_per_s']:.2f}x preset A's {base['tokens_per_s']:,.0f}"
        text += f"; its ETA is {eta_.fmt_eta(best['eta'])} against A's {eta_.fmt_eta(base['eta'])}"
    low = [r for r in done if r.get("mfu") is not None and r["mfu"] < 0.15]
    if low:
        text += (". MFU under 15% for " + ", ".join(r["preset"] for r in low) +
                 ": those micro-batches leave this GPU mostly idle; measure, don't carry presets over from 24 GB cards")
    return text + "."


def _fits(row: dict) -> str:
    """The 24 GB column in one word; the note with its reason is in dryrun.md."""
    return {True: "yes", False: "no"}.get(row.get("fits_24gb"), "n/a" if "CPU" in str(row.get("fits_24gb_note")) else "?")


def peak_mib(r: dict) -> str:
    """The preset's peak memory per rank for the tables (MiB): the GPU's peak allocation, or on a CPU
    run the process's peak resident set, marked RSS; "-" when neither was measured."""
    gpu = max((m["peak_allocated"] or 0) for m in r["memory_mib"])
    rss = max((m.get("peak_rss") or 0) for m in r["memory_mib"])
    return f"{gpu:,}" if gpu else f"{rss:,} RSS" if rss else "-"


def label(r: dict) -> str:
    """A row's preset, starred when key=value overrides changed the preset's own settings."""
    return r["preset"] + ("*" if r.get("preset_overrides") else "")


def override_lines(rows: list[dict]) -> list[str]:
    """`* A: per_device_train_batch_size=2, packing=True overridden`: what a starred preset ran."""
    return [f"* {r['preset']}: {', '.join(f'{k}={v}' for k, v in r['preset_overrides'].items())} (the preset's own "
            "settings overridden)" for r in rows if r.get("preset_overrides")]


def table(led: dict) -> Any:
    """The terminal ledger: a rich Table that fits 100 columns. dryrun.md has every column;
    this one leaves out tokens/s per GPU, save time and the spreads, and shortens the 24 GB note."""
    from rich import box
    from rich.table import Table

    t = Table(title=f"dry-run ledger: {led['world_size']} x {led['gpu']}{'  [SYNTHETIC model]' if led['synthetic'] else ''}",
              title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1), collapse_padding=True)
    # "order": the ranking by tokens/s ("rank" would read as a DDP rank).
    for col in ("order", "preset", "mb x acc", "GC", "pack", "s/step", "tokens/s", "MFU", "peak MiB", "24 GB", "ETA"):
        t.add_column(col, justify="right", no_wrap=True)
    rows = sorted([r for r in led["presets"] if "s_per_step" in r], key=lambda r: -r["tokens_per_s"])
    for i, r in enumerate(rows, 1):
        mem = peak_mib(r)
        t.add_row(str(i), label(r), f"{r['micro_batch']} x {r['gradient_accumulation_steps']}",
                  "on" if r["gradient_checkpointing"] else "off", "on" if r["packing"] else "off",
                  f"{r['s_per_step']:.3f}", f"{r['tokens_per_s']:,.0f}", f"{r['mfu']:.1%}" if r["mfu"] else "-",
                  mem, _fits(r), fmt_h(r["eta"]["total_s"]))
    for r in led["presets"]:
        if "skipped" in r:
            t.add_row("-", r["preset"], "skipped", *[""] * 8)  # the reason follows the table
    return t


def print_table(led: dict) -> None:
    from tuneledger import tables

    t = table(led)
    rows = sorted([r for r in led["presets"] if "s_per_step" in r], key=lambda r: -r["tokens_per_s"])
    # A pipe or a log file gets 100 columns rather than rich's 80-column default.
    tables.print_table(t, width=100)
    for r in led["presets"]:
        if "skipped" in r:
            print(f"preset {r['preset']} skipped: {r['skipped']}")
    for line in override_lines(rows):
        print(line)
    if rows:
        r = rows[0]
        print(f"total steps {r['eta']['total_steps']:,} ({plural(r['eta']['checkpoints'], 'checkpoint')} of {r['checkpoint_bytes'] / 1e9:.2f} GB); "
              f"steady state after {plural(led['warmup_steps'], 'warm-up step')}; trainable {r['model']['trainable_params'] / 1e6:.1f}M "
              f"({r['model']['trainable_pct']}%)")
        for line in common_lines("levers", {row["preset"]: row["model"].get("levers") or {} for row in rows}):
            print(line)
    for line in verdict_lines(led.get("verdicts") or {}):
        print(line)
    if led.get("finding"):
        print(f"FINDING: {led['finding']}")


def common_lines(head: str, per_preset: dict[str, dict]) -> list[str]:
    """`head A, B: k v; ...` once for what every preset shares, then `head D: k v` for each preset's
    own values: four ~400-character lines that differ in one word read as noise. One preset: one line."""
    if len(per_preset) < 2:
        return [f"{head} {p}: {levers_line(v)}" for p, v in per_preset.items()]
    first = next(iter(per_preset.values()))
    shared = {k: v for k, v in first.items() if all(d.get(k, object()) == v for d in per_preset.values())}
    out = [f"{head} {', '.join(per_preset)}: {levers_line(shared)}"] if shared else []
    own: dict[str, list[str]] = {}  # the rest, with the presets that share it
    for p, d in per_preset.items():
        rest = levers_line({k: v for k, v in d.items() if k not in shared})
        if rest:
            own.setdefault(rest, []).append(p)
    return out + [f"{head} {', '.join(ps)}: {rest}" for rest, ps in own.items()]


def verdict_lines(verdicts: dict[str, str]) -> list[str]:
    """`VERDICT A, B: <verdict> Lever: <lever>` once for presets that share a verdict and a lever
    (a CPU run: "unknown" for all), then each one's own measured `[details]` where they differ."""
    groups: dict[tuple[str, str | None], list[tuple[str, str]]] = {}
    for preset, line in verdicts.items():
        head, sep, rest = line.partition(" [")
        details, sep2, lever = rest.partition("] ")
        key = (head, lever) if sep and sep2 else (line, None)
        groups.setdefault(key, []).append((preset, details if sep and sep2 else ""))
    out = []
    for (head, lever), members in groups.items():
        names = ", ".join(p for p, _ in members)
        if len(members) == 1 or len({d for _, d in members}) == 1:
            out.append(f"VERDICT {names}: {verdicts[members[0][0]]}")
        else:
            out.append(f"VERDICT {names}: {head}. {lever}")  # the [details] that separated them follow
            out += [f"  {p}: [{d}]" for p, d in members]
    return out
