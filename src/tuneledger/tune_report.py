"""What `tuneledger tune` says: its progress words, a failed candidate's error, a search stopped
by a signal, the budget lines, and the ledger's tune.md and tune.png. No measuring here (tune.py
measures; tune_space.py holds the space's rules).
"""

from __future__ import annotations

import signal
from pathlib import Path

from tuneledger import ledger
from tuneledger import tune_space as ts
from tuneledger.plots import picture, pyplot, save_figure


def fmt_s(seconds: float) -> str:
    """Seconds as '4 min 05 s'."""
    m, s = divmod(int(round(max(0.0, seconds))), 60)
    return f"{m} min {s:02d} s"


def fits_word(f: bool | None) -> str:
    return {True: "yes", False: "no"}.get(f, "n/a (CPU)")


def error_tail(log_text: str, limit: int = 240) -> str:
    """A failed candidate's error: the last line its dry-run printed (the log's first line is the
    command tune wrote), at most `limit` characters: its end, cut at a word boundary after '...'.
    'it printed nothing' when the dry-run wrote no line."""
    lines = [ln.strip() for ln in log_text.splitlines()[1:] if ln.strip()]
    if not lines:
        return "it printed nothing"
    last = lines[-1]
    if len(last) <= limit:
        return last
    tail = last[-limit:]
    cut = tail.find(" ")
    return "..." + (tail[cut + 1:] if 0 <= cut < len(tail) - 1 else tail)


def stop_name(signum: int) -> str:
    """'SIGTERM', 'SIGHUP'; a terminal's SIGINT as 'Ctrl-C (SIGINT)'."""
    name = signal.Signals(signum).name
    return "Ctrl-C (SIGINT)" if signum == signal.SIGINT else name


def mark_stopped(cands: list[ts.Candidate], signum: int) -> dict:
    """A search stopped by a signal: the candidate that was measuring and those not reached get the
    dry-run's word for presets not reached (docs/runs-and-output.md): `terminated (SIGTERM)`
    (SIGHUP alike), `interrupted` for Ctrl-C. Returns tune.json's `stopped`: the signal, the
    candidates measured, of how many, and how many were not measured because of the stop."""
    name = signal.Signals(signum).name
    status = "interrupted" if signum == signal.SIGINT else f"terminated ({name})"
    left = 0
    for c in cands:
        if c.status == "measuring":
            c.status, c.reason = status, f"its dry-run was stopped by {name} before it finished ({c.result.get('log', 'its log')})"
        elif c.status == "planned":
            c.status, c.reason = status, f"not reached: the search was stopped by {name}"
        else:
            continue
        left += 1
    return {"signal": name, "measured": sum(c.status == "measured" for c in cands), "candidates": len(cands),
            "not_measured": left}


def stop_text(stopped: dict | None) -> str:
    """'stopped by SIGTERM after 1 of 4 candidates: the fastest measured so far, not the search's answer';
    '' for a search that ran to its end."""
    if not stopped:
        return ""
    name = "Ctrl-C (SIGINT)" if stopped["signal"] == "SIGINT" else stopped["signal"]
    return (f"stopped by {name} after {stopped['measured']} of {stopped['candidates']} candidates: "
            + ("nothing was measured" if not stopped["measured"] else "the fastest measured so far, not the search's answer"))


def stopped_finding(finding: str, stopped: dict | None) -> str:
    """The finding, led by what a stop leaves it (stop_text) when the search was stopped."""
    if not stopped:
        return finding
    return stop_text(stopped) + ("; " + finding if stopped["measured"] else ", so there is nothing to pick.")


def no_pick_snippet(cands: list[ts.Candidate], stopped: dict | None) -> str:
    """The snippet when there is no pick: nothing measured, or nothing measured that fits."""
    lead = f"# tuneledger tune, {stop_text(stopped)}\n" if stopped else ""
    if not any(c.status == "measured" for c in cands):
        return lead + ("" if stopped else "# nothing was measured: no pick (tune.md's Not ranked says why)\n")
    return lead + "# no measured candidate fits the memory budget: no pick\n"


def memory_line(cpu: bool, budget_gib: float | None) -> str:
    """The memory budget as the first progress line says it."""
    if cpu:
        return "memory not checked (CPU)"
    return f"memory budget {budget_gib:g} GiB per GPU" if budget_gib else "memory budget none"


def cpu_budget_note(cpu: bool, asked_gib: float | None) -> str | None:
    """One line for an explicit --memory-gib on a CPU run, where no budget is checked (rather than
    silence); None otherwise."""
    if not cpu or asked_gib is None:
        return None
    return (f"tune: --memory-gib {asked_gib:g} is not checked on a CPU run: nothing is measured against a per-GPU "
            "budget there (fits: n/a)")


def why(ranking: dict, cands: list[ts.Candidate]) -> list[str]:
    """Why the pick won, in the diagnosis's own terms: its verdict beside the runner-up's and the best preset's."""
    by = {c.short: c for c in cands}
    if not ranking["pick"]:
        return []
    p = by[ranking["pick"]]
    lines = [f"{p.short} ({p.result['tokens_per_s']:,.0f} tokens/s): {p.result['verdict'] or 'no verdict'}"]
    others = [s for s in ranking["order"] if s != p.short][:1]
    b = ranking["best_preset"]
    if b and b["candidate"] != p.short and b["candidate"] not in others:
        others.append(b["candidate"])
    for s in others:
        o = by[s]
        lines.append(f"{o.short} ({o.result['tokens_per_s']:,.0f} tokens/s, {o.result['tokens_per_s'] / p.result['tokens_per_s']:.0%} "
                     f"of the pick): {o.result['verdict'] or 'no verdict'}")
    return lines


def markdown(led: dict) -> str:
    """tune.md: the pick as YAML, the finding, why, the ranking table, what was pruned or not measured."""
    stopped = led.get("stopped")
    memory = (f"{led['memory_budget_gib']:g} GiB per GPU" if led["memory_budget_gib"] else
              "not checked (CPU" + (f"; --memory-gib {led['memory_gib_asked']:g} not applied)" if led.get("memory_gib_asked") else ")"))
    lines = [f"# Tune ledger: {led['run_name']}", "",
             f"- date: {led['date']}; host: {led['host']}; {ledger.plural(led['world_size'], 'rank')}, {led['backend']}; model {led['model']}",
             f"- global batch {led['global_batch_size']}, cutoff_len {led['cutoff_len']}; each candidate a dry-run of "
             f"{led['dryrun_steps']} steps ({led['warmup_steps']} warm-up); memory budget {memory}; "
             f"time budget {fmt_s(led['budget_s']) if led['budget_s'] else 'none'}; searched in {fmt_s(led['elapsed_s'])}"
             + (f"; **{stop_text(stopped)}** ({stopped['not_measured']} not measured)" if stopped else ""),
             ("- speed levers at the config's values; then the pick with each of: " + ", ".join(led["levers_tried"])
              if led.get("levers_tried") else
              "- speed levers (attention, Liger, fused LoRA, compile) at the config's values (`--levers` tries others on the pick)"), "",
             "## The pick", "", "```yaml", led["snippet"].rstrip(), "```", "", f"**Finding:** {led['finding']}", ""]
    if led["why"]:
        lines += ["## Why (the dry-run's verdicts)", ""] + [f"- {w}" for w in led["why"]] + [""]
    lines += ["## Ranking (tokens/s at the median step, all ranks)", "",
              "| order | candidate | presets | tokens/s (p10-p90) | s/step | peak memory | fits | GPU busy | MFU | verdict |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    by = {c["short"]: c for c in led["candidates"]}
    for i, s in enumerate(led["ranking"]["order"], 1):
        c, r = by[s], by[s]["result"]
        mem = f"{r['peak_gib']:.1f} GiB" if r.get("peak_gib") else (f"{r['peak_rss_mib']:,} MiB RSS" if r.get("peak_rss_mib") else "-")
        busy = f"{r['gpu_busy_pct']:.0f}%" if r.get("gpu_busy_pct") is not None else "-"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "-"
        mark = " **pick**" if s == led["ranking"]["pick"] else ""
        lines.append(f"| {i} | {c['label']}{mark} | {', '.join(c['presets']) or '-'} | {r['tokens_per_s']:,.0f} "
                     f"({r['tokens_per_s_p10']:,.0f}-{r['tokens_per_s_p90']:,.0f}) | {r['s_per_step']:.3f} | {mem} "
                     f"| {fits_word(r['fits'])} | {busy} | {mfu} | {r.get('bottleneck') or '-'} |")
    rest = [c for c in led["candidates"] if c["status"] != "measured"]
    if rest:
        lines += ["", "## Not ranked", "", "| candidate | presets | status | why |", "| --- | --- | --- | --- |"]
        lines += [f"| {c['label']} | {', '.join(c['presets']) or '-'} | {c['status']} | {c['reason']} |" for c in rest]
    if led.get("plot"):
        lines += ["", f"![tokens/s (p10-p90) and peak memory per candidate]({Path(led['plot']).name})"]
    return "\n".join(lines) + "\n"


def plot(cands: list[ts.Candidate], png: Path, title: str, budget_gib: float | None) -> Path | None:
    """tune.png: per measured candidate (fastest on top), tokens/s with p10-p90 bars, and peak memory
    per GPU in GiB (a CPU run: peak RSS) against the budget. None with a warning when it cannot be
    drawn (matplotlib missing): a picture never costs the ledger (plots.picture)."""
    return picture(_draw, cands, png, title, budget_gib)


def _draw(cands: list[ts.Candidate], png: Path, title: str, budget_gib: float | None) -> Path | None:
    done = sorted([c for c in cands if c.status == "measured"], key=lambda c: c.result["tokens_per_s"])
    if not done:
        return None
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 1.2 + 0.45 * len(done)), sharey=True)
    try:
        names = [c.short for c in done]
        rate = [c.result["tokens_per_s"] for c in done]
        err = [[max(0.0, r - c.result["tokens_per_s_p10"]) for r, c in zip(rate, done)],
               [max(0.0, c.result["tokens_per_s_p90"] - r) for r, c in zip(rate, done)]]
        left.barh(names, rate, xerr=err, capsize=4, color=["tab:orange" if c.presets else "tab:blue" for c in done])
        left.set_xlabel("tokens/s, all ranks (bars p10-p90; orange: a preset)")
        cpu = not any(c.result.get("peak_gib") for c in done)
        mem = [(c.result.get("peak_rss_mib") or 0) / 1024 if cpu else c.result.get("peak_gib") or 0 for c in done]
        right.barh(names, mem, color=["tab:red" if c.result.get("fits") is False else "tab:green" for c in done])
        if budget_gib:
            right.axvline(budget_gib, color="black", linestyle="--", linewidth=1, label=f"budget {budget_gib:g} GiB")
            right.legend(loc="lower right")
        right.set_xlabel("peak RSS GiB per rank (CPU run: RAM, not GPU)" if cpu else "peak allocated GiB per GPU")
        fig.suptitle(title)
        fig.tight_layout()
        return save_figure(fig, png)
    finally:
        plt.close(fig)
