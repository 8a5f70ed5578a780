"""The search space of `tuneledger tune` and its rules, with no measuring: the candidates
(micro-batch x gradient checkpointing x packing at the fixed global batch, presets A-D among them),
their memory estimate and order, the pruning against a per-GPU memory budget, the time budget's
parsing, and the ranking of measured candidates (ties by ledger.overlap, as the dry-run's finding).

Units: memory in GiB per GPU (rank), time in seconds, speed in tokens/s (all ranks together).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from tuneledger import ledger
from tuneledger.config import DDP_PRESETS, PRESETS, ConfigError

# Activation memory without gradient checkpointing, per token, against with it: a checkpointed
# layer keeps its input only; an unchecked one keeps every intermediate (attention and MLP). A
# rough factor, used to order candidates and, before two of a kind are measured, to scale.
GC_OFF_FACTOR = 6.0
# The keys a candidate sets; the user's own values of them are replaced by the candidate's.
SPACE_KEYS = ("per_device_train_batch_size", "gradient_checkpointing", "packing", "gradient_accumulation_steps", "preset")
# The speed levers `--levers` may try on the pick, one variant each (docs/speed.md has what each does).
LEVER_KEYS = ("flash_attn", "enable_liger_kernel", "fused_lora", "grouped_lora", "absmax_once", "drop_padding_mask",
              "swiglu_recompute", "nf4_kernel", "torch_compile", "compile_cpp_wrapper")


# A candidate's short dry-run, unless the user gives dryrun_steps.
DEFAULT_STEPS, DEFAULT_WARMUP = 6, 2


def base_items(items: list[str], steps_given: bool) -> list[str]:
    """The user's items without the keys a candidate sets (SPACE_KEYS), with the short
    dry-run's steps unless the user gave dryrun_steps (then theirs, and their warm-up)."""
    keep = [i for i in items if "=" not in i or i.partition("=")[0].strip() not in SPACE_KEYS]
    if not steps_given:
        keep += [f"dryrun_steps={DEFAULT_STEPS}", f"dryrun_warmup_steps={DEFAULT_WARMUP}"]
    return keep


@dataclass
class Candidate:
    """One point of the space: micro-batch (sequences per rank per forward), gradient
    checkpointing, packing; `accumulation` is derived (global batch / (micro-batch x world size)).
    `presets` names the presets A-D whose resolved settings are this point; `levers` the speed
    levers a variant of the pick sets (--levers: {key: value}), empty for the space's own points."""

    micro_batch: int
    gradient_checkpointing: bool
    packing: bool
    accumulation: int
    presets: list[str] = field(default_factory=list)
    units: float = 0.0  # memory estimate in relative units: micro-batch x cutoff_len x (GC off factor)
    # planned, measuring (its dry-run running), measured, pruned, not measured, failed, out of memory;
    # a search stopped by a signal: terminated (SIGTERM) / (SIGHUP), or interrupted (Ctrl-C), as the dry-run says
    status: str = "planned"
    reason: str = ""
    result: dict = field(default_factory=dict)  # the measured numbers (tune.measure_row)
    levers: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> tuple:
        return (self.micro_batch, self.gradient_checkpointing, self.packing, *sorted(self.levers.items()))

    @property
    def label(self) -> str:
        return (f"mb {self.micro_batch} x acc {self.accumulation}, GC {'on' if self.gradient_checkpointing else 'off'}, "
                f"{'packed' if self.packing else 'padded'}" + "".join(f", {k}={v}" for k, v in self.levers.items()))

    @property
    def short(self) -> str:
        """A name for tables and the plot: 'mb2-gc-pack', with the presets it is ('=B')."""
        name = f"mb{self.micro_batch}-{'gc' if self.gradient_checkpointing else 'nogc'}-{'pack' if self.packing else 'pad'}"
        name += "".join(f"+{k}={v}" for k, v in self.levers.items())
        return name + (f" (={'/'.join(self.presets)})" if self.presets else "")

    def overrides(self) -> list[str]:
        """The key=value items that make a dry-run of this candidate."""
        return [f"per_device_train_batch_size={self.micro_batch}",
                f"gradient_checkpointing={str(self.gradient_checkpointing).lower()}", f"packing={str(self.packing).lower()}",
                *(f"{k}={v}" for k, v in self.levers.items())]

    def as_dict(self) -> dict:
        return {**asdict(self), "label": self.label, "short": self.short}


def parse_budget(text: str | None) -> float | None:
    """'10m', '90s', '1.5h' or a bare number of seconds, in seconds; None for no budget.
    Raises ConfigError for anything else or a budget that is not above 0."""
    if text is None or str(text).strip().lower() in ("", "none"):
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text).lower())
    if not m:
        raise ConfigError(f"--budget {text!r}: give a time such as 90s, 10m or 1.5h (s, m, h suffixes; a bare number is seconds)")
    seconds = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]
    if seconds <= 0:
        raise ConfigError(f"--budget {text!r}: must be above 0")
    return seconds


def parse_levers(text: str | None) -> list[dict[str, str]]:
    """--levers 'grouped_lora=true,torch_compile=false': the lever settings to try on the pick, one
    variant per comma, in order; '+' joins settings into one variant ('grouped_lora=true+absmax_once=true':
    levers that pay together, as preset C's measured). [] without --levers. Raises ConfigError for
    an empty --levers (as for ','), an item that is not key=value, a key not in LEVER_KEYS, or a key
    twice in one variant (the values are checked by the config, before any run), or a variant asked
    for twice."""
    if text is None:
        return []
    if not str(text).strip():
        raise ConfigError(f"--levers {text!r}: empty; give one or more key=value settings (e.g. grouped_lora=true), "
                          "or leave --levers out for none")
    out = []
    for part in str(text).split(","):
        variant: dict[str, str] = {}
        for item in part.split("+"):
            key, sep, value = (x.strip() for x in item.partition("="))
            if not sep or not key or not value:
                raise ConfigError(f"--levers {text!r}: {item.strip()!r} is not key=value (e.g. grouped_lora=true)")
            if key not in LEVER_KEYS:
                raise ConfigError(f"--levers {text!r}: {key!r} is not a speed lever tune tries; use {', '.join(LEVER_KEYS)}")
            if key in variant:
                raise ConfigError(f"--levers {text!r}: {key!r} is set twice in {part.strip()!r}")
            variant[key] = value
        if variant in out:  # measured twice, the two would share one name in the table
            raise ConfigError(f"--levers {text!r}: {lever_text(variant)!r} is asked for twice")
        out.append(variant)
    return out


def lever_text(variant: dict[str, str]) -> str:
    """A variant as --levers spells it: 'grouped_lora=true+absmax_once=true'."""
    return "+".join(f"{k}={v}" for k, v in variant.items())


def lever_variants(pick: Candidate, levers: list[dict[str, str]]) -> list[Candidate]:
    """The pick with each variant's lever settings in turn (parse_levers): the same micro-batch,
    checkpointing and packing (so the same memory estimate), no preset name (a variant is not a
    preset's own settings)."""
    return [Candidate(pick.micro_batch, pick.gradient_checkpointing, pick.packing, pick.accumulation,
                      units=pick.units, levers=dict(v)) for v in levers]


# The levers whose config default is None (auto: on where it applies), each with its line in the
# dry-run ledger's model.levers ("on (...)" or "off (...)"): what the auto value came to.
AUTO_LEVER_LINES = {"enable_liger_kernel": "liger", "fused_lora": "fused_lora", "torch_compile": "compile",
                    "swiglu_recompute": "swiglu_recompute", "grouped_lora": "grouped_lora", "absmax_once": "absmax_once",
                    "drop_padding_mask": "drop_padding_mask", "nf4_kernel": "nf4_kernel"}


def already_runs(key: str, text: str, value: Any, own: Any, ran: dict | None) -> str | None:
    """Why a lever setting (`key`=`text`, resolved `value`) would change nothing on the pick whose own
    config value is `own` and whose dry-run's model.levers are `ran`; None when it would. The pick's
    own value, or for a lever left unset (auto) the state its dry-run reports ('on ...'/'off ...')."""
    if value == own:
        return f"the job already runs with {key}={text}"
    line = str((ran or {}).get(AUTO_LEVER_LINES.get(key, ""), ""))
    state = True if line.startswith("on") else False if line.startswith("off") else None
    if own is None and state is not None and value == state:
        return f"the job already runs with {key} {line.split(' ', 1)[0]} (unset: auto; the pick's dry-run: {line})"
    if own is None and value is True and line.startswith("off ("):
        # auto said why it could not apply (left padding, no q/k/v group, ...): true would be refused or do nothing
        return f"{key} cannot apply to this job (unset: auto; the pick's dry-run: {line})"
    return None


def per_rank_batch(global_batch: int, world: int) -> int:
    """Sequences per rank per optimizer step (global batch / world size); ConfigError if not whole."""
    if global_batch % world:
        raise ConfigError(f"global batch {global_batch} is not divisible by world size {world}")
    return global_batch // world


def parse_micro_batches(text: str | None, global_batch: int, world: int) -> list[int]:
    """The micro-batches to search: `text` ('1,2,4,8'), or by default 1, 2, 4, ... up to global
    batch / world size, each dividing it. Raises ConfigError for a value that is not a positive
    whole number or does not divide global batch / world size (accumulation must stay whole)."""
    per_rank = per_rank_batch(global_batch, world)
    if text is None:
        out, m = [], 1
        while m <= per_rank:
            if per_rank % m == 0:
                out.append(m)
            m *= 2
        return out
    values = []
    for part in str(text).split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ConfigError(f"--micro-batches {text!r}: {part!r} is not a whole number above 0")
        values.append(int(part))
    bad = [m for m in values if per_rank % m]
    if bad:
        raise ConfigError(f"--micro-batches {text!r}: {', '.join(map(str, bad))} {'does' if len(bad) == 1 else 'do'} not divide global batch {global_batch} / "
                          f"world size {world} = {per_rank}: gradient accumulation would not be whole")
    return sorted(set(values))


def parse_switch(text: str, name: str) -> list[bool]:
    """'on', 'off' or 'both' (the default) for --gc and --packing: the values searched."""
    v = str(text).strip().lower()
    if v not in ("on", "off", "both"):
        raise ConfigError(f"--{name} {text!r}: give on, off or both")
    return {"on": [True], "off": [False], "both": [True, False]}[v]


def memory_units(micro_batch: int, gradient_checkpointing: bool, cutoff_len: int) -> float:
    """The activation-memory estimate in relative units (tokens held per rank, GC off weighted by
    GC_OFF_FACTOR). A padded batch holds at most micro-batch x cutoff_len tokens, a packed one fills
    it: both get the same bound."""
    return float(micro_batch * cutoff_len * (1.0 if gradient_checkpointing else GC_OFF_FACTOR))


def preset_points(global_batch: int, world: int) -> dict[str, tuple[int, bool, bool] | str]:
    """Presets A-D resolved at this world size as (micro-batch, GC, packing), or the reason one cannot
    run (a micro-batch that does not divide global batch / world size). D's micro-batch is capped
    as config.resolve caps it."""
    per_rank = per_rank_batch(global_batch, world)
    out: dict[str, tuple[int, bool, bool] | str] = {}
    for name in DDP_PRESETS:
        p = PRESETS[name]
        mb = p["per_device_train_batch_size"]
        if name == "D":
            mb = next((m for m in range(min(mb, per_rank), 0, -1) if per_rank % m == 0), 1)
        if per_rank % mb:
            out[name] = f"micro-batch {mb} does not divide global batch {global_batch} / world size {world}"
        else:
            out[name] = (mb, p["gradient_checkpointing"], p["packing"])
    return out


def build_space(global_batch: int, world: int, cutoff_len: int, micro_batches: list[int],
                gc: list[bool], packing: list[bool]) -> list[Candidate]:
    """Every candidate, presets A-D included (added when the asked space leaves them out), ordered
    for measuring: the presets first (the pick must be compared with them in the same call), then
    the rest; each group by memory estimate, smallest first, so the first measurements calibrate
    the estimate before the large candidates."""
    per_rank = per_rank_batch(global_batch, world)
    points = {(m, g, p): [] for m in micro_batches for g in gc for p in packing}
    for name, pt in preset_points(global_batch, world).items():
        if isinstance(pt, tuple):
            points.setdefault(pt, []).append(name)
    out = [Candidate(m, g, p, per_rank // m, names, memory_units(m, g, cutoff_len)) for (m, g, p), names in points.items()]
    return sorted(out, key=lambda c: (not c.presets, c.units, c.packing, c.micro_batch))


def _fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(intercept GiB, GiB per unit) of peak memory against units by least squares, both >= 0;
    None with fewer than two distinct units."""
    xs = {u for u, _ in points}
    if len(xs) < 2:
        return None
    n = len(points)
    mx, my = sum(u for u, _ in points) / n, sum(p for _, p in points) / n
    sxx = sum((u - mx) ** 2 for u, _ in points)
    slope = max(0.0, sum((u - mx) * (p - my) for u, p in points) / sxx)
    return max(0.0, my - slope * mx), slope


def estimate_gib(c: Candidate, measured: list[Candidate]) -> float | None:
    """Candidate c's peak memory per GPU (GiB), scaled from the measured peaks: a straight line of
    peak against memory units through the measured candidates of c's checkpointing setting when two
    of them differ in micro-batch, else through all of them (GC_OFF_FACTOR carrying it across);
    None before two measured candidates differ in units."""
    pts = [(m.units, m.result["peak_gib"]) for m in measured if m.result.get("peak_gib")]
    same = [(m.units, m.result["peak_gib"]) for m in measured
            if m.result.get("peak_gib") and m.gradient_checkpointing == c.gradient_checkpointing]
    line = _fit(same) or _fit(pts)
    return None if line is None else line[0] + line[1] * c.units


def needs_at_least(c: Candidate, other: Candidate) -> bool:
    """True when c holds at least as much memory as `other`: micro-batch as large, checkpointing
    off or as other's, packing as other's or on (a packed batch is full)."""
    return (c.micro_batch >= other.micro_batch and (not c.gradient_checkpointing or other.gradient_checkpointing)
            and (c.packing or not other.packing))


def prune(todo: list[Candidate], done: list[Candidate], budget_gib: float | None) -> list[Candidate]:
    """Mark (status "pruned", with its reason) and return the candidates of `todo` that cannot fit
    `budget_gib` per GPU: (1) one that needs at least the memory of a measured candidate that did not
    fit (certain); (2) one whose estimate scaled from the measured peaks (estimate_gib) exceeds the
    budget (an estimate). Nothing is pruned without a budget (a CPU run). A preset is pruned by (1)
    only: the pick is compared with the presets, so an estimate never rules one out."""
    if budget_gib is None:
        return []
    out = []
    failed = [d for d in done if d.result.get("fits") is False]
    fitted = [d for d in done if d.status == "measured"]
    for c in todo:
        if c.status != "planned":
            continue
        worse = next((d for d in failed if needs_at_least(c, d)), None)
        est = estimate_gib(c, fitted)
        if worse is not None:
            peak = worse.result.get("peak_gib")
            c.reason = (f"needs at least the memory of {worse.short}, which did not fit {budget_gib:g} GiB"
                        + (f" ({peak:.1f} GiB peak)" if peak else " (out of memory)"))
        elif est is not None and est > budget_gib and not c.presets:
            c.reason = (f"estimated {est:.1f} GiB per GPU (scaled from {len(fitted)} measured peaks) > the "
                        f"{budget_gib:g} GiB budget")
        else:
            continue
        c.status = "pruned"
        out.append(c)
    return out


def rank(cands: list[Candidate]) -> dict[str, Any]:
    """The ranking of measured candidates by tokens/s (fastest first), the pick (the fastest that
    fits; a CPU run's fit is unknown and counts), the candidates tied with it (their p10-p90 tokens/s
    range overlaps that of every faster candidate: ledger.overlap) with the steady steps each that would separate them
    (ledger.steps_to_separate), and the best preset with the pick's speed-up over it."""
    done = sorted([c for c in cands if c.status == "measured"], key=lambda c: -c.result["tokens_per_s"])
    fit = [c for c in done if c.result.get("fits") is not False]
    out: dict[str, Any] = {"order": [c.short for c in done], "pick": None, "ties": [], "best_preset": None}
    if not fit:
        return out
    fastest = fit[0]
    # Tied: within the spread of every faster candidate, not only the fastest's (ties are not
    # transitive: a wide fastest can overlap a slow one that a third is faster than beyond spread).
    tied = [c for i, c in enumerate(fit[1:], 1) if all(ledger.overlap(d.result, c.result) for d in fit[:i])]
    out["ties"] = [{"with": c.short, "steps_to_separate": ledger.steps_to_separate(fastest.result, c.result)} for c in tied]
    # Within the spread they are equally fast: the pick is the one of them that needs least memory,
    # where it needs clearly less (MEMORY_MARGIN): 1,971 against 1,978 MiB is noise, not a reason.
    lighter = [c for c in tied if memory_gib(c) < memory_gib(fastest) * (1 - MEMORY_MARGIN)]
    pick = min(lighter, key=memory_gib) if lighter else fastest
    out["fastest"], out["pick"] = fastest.short, pick.short
    if pick is not fastest:
        out["pick_rule"] = f"the least memory of those tied with the fastest, {fastest.short}"
    presets = [c for c in fit if c.presets]
    if presets:
        best = presets[0]
        out["best_preset"] = {"candidate": best.short, "presets": best.presets, "tokens_per_s": best.result["tokens_per_s"],
                              "speedup": pick.result["tokens_per_s"] / best.result["tokens_per_s"],
                              "tied": best is pick or ledger.overlap(pick.result, best.result)}
    return out


MEMORY_MARGIN = 0.02  # a tied candidate is picked over the fastest for memory only when it needs 2% less


def memory_gib(c: Candidate) -> float:
    """A measured candidate's peak memory per GPU (GiB; a CPU run's peak RSS), inf when unknown."""
    r = c.result
    return r.get("peak_gib") or (r.get("peak_rss_mib") or 0) / 1024 or float("inf")


def finding(ranking: dict, cands: list[Candidate]) -> str:
    """One sentence: the pick, its speed, its ties (with steps to separate them), and against the best preset."""
    by = {c.short: c for c in cands}
    if not ranking["pick"]:
        if not any(c.status in ("measured", "out of memory") for c in cands):
            failed = [c for c in cands if c.status == "failed"]
            return ("no candidate was measured" + (f": {len(failed)} failed (the first: {failed[0].reason})" if failed else "")
                    + "; nothing to pick")
        return "no measured candidate fits the memory budget: nothing to pick"
    p = by[ranking.get("fastest") or ranking["pick"]]
    text = f"{p.short} is fastest at {p.result['tokens_per_s']:,.0f} tokens/s"
    if ranking["ties"]:
        parts = []
        for t in ranking["ties"]:
            sep = ledger.separation(p.result, by[t["with"]].result, p.short, t["with"])
            parts.append(f"{t['with']} ({by[t['with']].result['tokens_per_s']:,.0f}; {sep})")
        text += (f", but it ties with {', '.join(parts)}: their p10-p90 ranges overlap over "
                 f"{p.result['steps_measured']} measured steps")
        pick = by[ranking["pick"]]
        text += (f"; the pick is {pick.short}, the least memory of them ({memory_gib(pick):.1f} GiB)" if pick is not p
                 else "; it also needs the least memory of them")
        p = pick
    b = ranking["best_preset"]
    if b and b["candidate"] != p.short:
        text += (f"; {b['speedup']:.2f}x the best preset, {'/'.join(b['presets'])} ({b['tokens_per_s']:,.0f} tokens/s)"
                 + (", within the spread (a tie)" if b["tied"] else ""))
    elif b:
        # Only a space measured to its end (each point measured, or certain not to fit) has no point that beat it.
        unmeasured = [c for c in cands if not c.levers and c.status not in ("measured", "pruned", "out of memory")]
        text += f"; it is preset {'/'.join(b['presets'])}: " + (
            f"no measured point beat it ({ledger.plural(len(unmeasured), 'candidate')} of the space not measured)"
            if unmeasured else "no point of the space beat it")
    return text + "."


def snippet(c: Candidate, global_batch: int, world: int, budget_gib: float | None, stopped: str = "") -> str:
    """The winning settings as YAML to paste into a training config; `stopped` (tune_report.stop_text)
    heads it when the search was stopped short, so a pasted snippet does not pass for the answer."""
    fits = f"fits {budget_gib:g} GiB per GPU" if budget_gib else "memory not checked (CPU)"
    return "\n".join([
        *([f"# tuneledger tune, {stopped}"] if stopped else []),
        # The pick is the least memory among those tied with the fastest (rank): the header says so.
        f"# tuneledger tune: the pick, {c.result['tokens_per_s']:,.0f} tokens/s on {ledger.plural(world, 'rank')}; {fits} "
        "(the fastest that fits, or the least memory of those tied with it: tune.md's Finding)",
        f"global_batch_size: {global_batch}",
        f"per_device_train_batch_size: {c.micro_batch}   # gradient accumulation {c.accumulation} is derived",
        f"gradient_checkpointing: {str(c.gradient_checkpointing).lower()}",
        f"packing: {str(c.packing).lower()}",
        *(f"{k}: {v}" for k, v in c.levers.items()),
    ]) + "\n"
