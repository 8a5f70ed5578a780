"""`tuneledger tune`: the space, its rules and the ranking (test_tune_run.py: the search running)."""

import pytest

from tuneledger import tune_space as ts
from tuneledger.config import ConfigError


def measured(c: ts.Candidate, tps: float, p10: float, p90: float, peak: float | None = None, fits=None) -> ts.Candidate:
    """c with a measured result: tokens/s at a median step of 1 s, step spread p10-p90 (s)."""
    c.status = "measured"
    c.result = {"tokens_per_s": tps, "tokens_per_step": tps, "s_per_step": 1.0, "steps_measured": 4, "warmup_steps_excluded": 2,
                "step_spread": {"median": 1.0, "p10": p10, "p90": p90, "sd": (p90 - p10) / 2.56},
                "peak_gib": peak, "fits": fits, "verdict": "compute-bound: ..."}
    return c


@pytest.mark.parametrize("text,seconds", [("10m", 600), ("90s", 90), ("1.5h", 5400), ("45", 45), (" 2M ", 120)])
def test_budget_takes_s_m_h_suffixes(text, seconds):
    assert ts.parse_budget(text) == seconds
    assert ts.parse_budget(None) is None


@pytest.mark.parametrize("text", ["abc", "10x", "-5m", "0", "m"])
def test_a_bad_budget_is_a_config_error(text):
    with pytest.raises(ConfigError, match="--budget"):
        ts.parse_budget(text)


def test_micro_batches_default_to_powers_of_two_dividing_the_per_rank_batch():
    assert ts.parse_micro_batches(None, 16, 1) == [1, 2, 4, 8, 16]
    assert ts.parse_micro_batches(None, 16, 2) == [1, 2, 4, 8]
    assert ts.parse_micro_batches(None, 24, 2) == [1, 2, 4]  # 8 does not divide 12
    assert ts.parse_micro_batches("4,1,2,2", 16, 2) == [1, 2, 4]


@pytest.mark.parametrize("text", ["3", "1,5", "a", "0", "2,-1"])
def test_micro_batches_that_do_not_divide_the_global_batch_are_refused(text):
    with pytest.raises(ConfigError, match="--micro-batches"):
        ts.parse_micro_batches(text, 16, 2)


def test_switches():
    assert ts.parse_switch("both", "gc") == [True, False] and ts.parse_switch("ON", "gc") == [True]
    with pytest.raises(ConfigError, match="--packing"):
        ts.parse_switch("maybe", "packing")


def test_presets_resolve_at_the_world_size_as_config_does():
    pts = ts.preset_points(16, 2)
    assert pts == {"A": (1, True, False), "B": (2, True, False), "C": (2, False, False), "D": (8, False, True)}
    assert ts.preset_points(16, 8)["D"] == (2, False, True)  # capped at global / world
    assert ts.preset_points(24, 2)["D"] == (6, False, True)  # the largest that divides 12
    assert isinstance(ts.preset_points(4, 4)["B"], str)  # micro-batch 2 > 1 per rank: cannot run


def test_the_space_holds_the_presets_first_then_the_rest_by_memory_estimate():
    space = ts.build_space(16, 2, 1024, [1, 2], [True], [True, False])
    keys = [c.key for c in space]
    # The asked space (micro-batch 1-2, GC on) plus C and D, which it left out.
    assert set(keys) == {(1, True, True), (1, True, False), (2, True, True), (2, True, False), (2, False, False), (8, False, True)}
    assert [c.presets for c in space[:4]] == [["A"], ["B"], ["C"], ["D"]]  # presets first, smallest estimate first
    assert all(not c.presets for c in space[4:])
    assert [c.units for c in space[4:]] == sorted(c.units for c in space[4:])
    for c in space:
        assert c.micro_batch * c.accumulation * 2 == 16  # the global batch is fixed
    assert ts.memory_units(2, False, 1024) == 2 * 1024 * ts.GC_OFF_FACTOR > ts.memory_units(2, True, 1024)
    assert space[0].overrides() == ["per_device_train_batch_size=1", "gradient_checkpointing=true", "packing=false"]


def test_nothing_is_pruned_without_a_memory_budget():
    space = ts.build_space(16, 1, 1024, [1, 2, 4, 8, 16], [True, False], [True, False])
    measured(space[0], 100, 0.9, 1.1, peak=200.0, fits=False)
    assert ts.prune(space, [space[0]], None) == []


def test_a_candidate_needing_more_than_one_that_did_not_fit_is_pruned():
    space = ts.build_space(16, 1, 1024, [1, 2, 4, 8, 16], [True, False], [True, False])
    by = {c.key: c for c in space}
    big = measured(by[(4, False, True)], 100, 0.9, 1.1, peak=30.0, fits=False)
    pruned = ts.prune(space, [big], 24)
    keys = {c.key for c in pruned}
    assert (8, False, True) in keys and (16, False, True) in keys and "did not fit 24 GiB" in by[(8, False, True)].reason
    assert (8, True, True) not in keys and (2, False, True) not in keys  # GC on, or a smaller micro-batch: may fit
    assert (8, False, False) not in keys  # padded holds at most what packed holds
    assert by[(8, False, True)].presets == ["D"]  # a preset too, when it certainly cannot fit


def test_estimates_scaled_from_measured_peaks_prune_what_cannot_fit():
    space = ts.build_space(16, 1, 1024, [1, 2, 4, 8, 16], [True], [False])
    by = {c.key: c for c in space}
    # 10 GiB of weights + 2 GiB per micro-batch sequence.
    a, b = measured(by[(1, True, False)], 100, 0.9, 1.1, 12.0, True), measured(by[(2, True, False)], 100, 0.9, 1.1, 14.0, True)
    assert ts.estimate_gib(by[(8, True, False)], [a, b]) == pytest.approx(26.0)
    assert ts.estimate_gib(by[(8, True, False)], [a]) is None  # one point: no line
    pruned = ts.prune(space, [a, b], 24)
    assert {c.key for c in pruned} == {(8, True, False), (16, True, False)}  # by estimate: never a preset
    assert ts.estimate_gib(by[(2, False, False)], [a, b]) > 24 and by[(2, False, False)].presets == ["C"]
    assert "estimated 26.0 GiB" in by[(8, True, False)].reason and by[(4, True, False)].status == "planned"


def test_the_pick_is_the_fastest_that_fits_and_overlapping_spreads_are_ties():
    space = ts.build_space(16, 1, 1024, [1, 2, 4], [True, False], [False])
    by = {c.key: c for c in space}
    a = measured(by[(1, True, False)], 100, 0.95, 1.05, 10, True)  # preset A
    c = measured(by[(2, False, False)], 180, 0.95, 1.05, 14, True)  # preset C
    fast = measured(by[(4, False, False)], 300, 0.95, 1.05, 30, False)  # fastest, but over budget
    near = measured(by[(4, True, False)], 175, 0.9, 1.1, 16, True)  # 175 (159-194) overlaps C's 171-189
    r = ts.rank(space)
    assert r["order"][0] == fast.short and r["pick"] == c.short
    assert [t["with"] for t in r["ties"]] == [near.short] and r["ties"][0]["steps_to_separate"] > 2
    assert r["best_preset"]["candidate"] == c.short
    text = ts.finding(r, space)
    assert text.startswith(f"{c.short} is fastest at 180 tokens/s, but it ties with {near.short}") and "steady steps" in text
    # Three points of the space (B, D, mb1 without GC) were never measured: the pick beat the measured ones only.
    assert "it is preset C: no measured point beat it (3 candidates of the space not measured)" in text
    for rest in (x for x in space if x.status == "planned"):
        rest.status = "pruned"  # each certain not to fit: the whole space is settled
    assert "it is preset C: no point of the space beat it" in ts.finding(r, space)
    assert a.short not in [t["with"] for t in r["ties"]]  # 100 is slower beyond the spread
    snip = ts.snippet(by[(2, False, False)], 16, 1, 24)
    assert "per_device_train_batch_size: 2" in snip and "gradient_checkpointing: false" in snip and "packing: false" in snip


def test_a_tie_with_a_wide_fastest_is_not_a_tie_with_what_lies_between():
    """Ties are not transitive: a fastest with a wide spread overlaps A, but B lies between them
    and is faster than A beyond both spreads. A is not tied (the CPU trial picked A, less memory,
    beside a finding that called it 0.78x the best preset B)."""
    space = ts.build_space(16, 1, 1024, [1, 2, 4], [True, False], [False])
    by = {c.key: c for c in space}
    wide = measured(by[(4, False, False)], 200, 0.6, 1.6, 30)  # 125-333 tokens/s
    b = measured(by[(2, True, False)], 190, 0.98, 1.02, 20)  # preset B, 186-194
    a = measured(by[(1, True, False)], 150, 0.98, 1.02, 10)  # preset A, 147-153: within wide's, not B's
    r = ts.rank(space)
    assert [t["with"] for t in r["ties"]] == [b.short] and a.short not in [t["with"] for t in r["ties"]]
    assert r["pick"] == b.short and r["best_preset"]["candidate"] == b.short and wide.short == r["fastest"]


def test_a_tie_is_picked_for_memory_only_when_it_needs_clearly_less():
    """Among tied candidates the pick needs least memory only by a margin (tune_space.MEMORY_MARGIN):
    a CPU trial picked a tie for 1,971 against 1,978 MiB of RSS, which is noise, not a reason."""
    space = ts.build_space(16, 1, 1024, [1, 2, 4], [True, False], [False])
    by = {c.key: c for c in space}
    fast = measured(by[(2, False, False)], 180, 0.95, 1.05, 20)
    near = measured(by[(4, True, False)], 178, 0.95, 1.05, 20 * 0.997)  # 0.3% less: noise
    r = ts.rank(space)
    assert [t["with"] for t in r["ties"]] == [near.short] and r["pick"] == fast.short and "pick_rule" not in r
    near.result["peak_gib"] = 20 * 0.9  # 10% less: the pick, and the rule is said
    r = ts.rank(space)
    assert r["pick"] == near.short and r["pick_rule"].startswith("the least memory of those tied")


def test_a_pick_that_beats_the_presets_says_by_how_much():
    space = ts.build_space(16, 1, 1024, [1, 4], [True], [True])
    by = {c.key: c for c in space}
    for k, v in {(1, True, False): 100, (2, True, False): 110, (2, False, False): 120, (8, False, True): 150, (4, True, True): 300}.items():
        measured(by[k], v, 0.98, 1.02)
    r = ts.rank(space)
    assert r["pick"] == by[(4, True, True)].short and not r["ties"]
    assert r["best_preset"]["presets"] == ["D"] and r["best_preset"]["speedup"] == pytest.approx(2.0)
    assert "2.00x the best preset, D" in ts.finding(r, space)


def test_the_user_keys_of_the_space_are_replaced_and_the_short_dry_run_added():
    from tuneledger.tune_space import base_items

    items = ["cfg.yaml", "per_device_train_batch_size=4", "packing=true", "lora_rank=8", "preset=D"]
    assert base_items(items, False) == ["cfg.yaml", "lora_rank=8", "dryrun_steps=6", "dryrun_warmup_steps=2"]
    assert base_items(items + ["dryrun_steps=10"], True) == ["cfg.yaml", "lora_rank=8", "dryrun_steps=10"]
