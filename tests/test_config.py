from pathlib import Path

import pytest

from tuneledger.config import PRESETS, ConfigError, resolve
from tuneledger.config_load import from_cli, load_config, parse_overrides

ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / "configs" / "qwen2.5-7b-qlora.yaml"


def test_reference_config_is_the_field_report_job():
    cfg = load_config(REF)
    assert cfg.model_name_or_path == "Qwen/Qwen2.5-7B-Instruct"
    assert (cfg.quantization_bit, cfg.quantization_type, cfg.double_quantization, cfg.bf16) == (4, "nf4", True, True)
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target) == (64, 128, 0.05, "all")
    assert (cfg.global_batch_size, cfg.learning_rate, cfg.lr_scheduler_type, cfg.save_steps) == (16, 1e-4, "cosine", 200)


@pytest.mark.parametrize("preset,world,micro,accum,gc,packing", [
    ("A", 8, 1, 2, True, False),   # the field report's run: bs1 x accum2 x 8 GPUs = 16
    ("A", 1, 1, 16, True, False),  # its earlier single-GPU run: bs1 x accum16
    ("B", 8, 2, 1, True, False),
    ("C", 8, 2, 1, False, False),
    ("C", 2, 2, 4, False, False),
    ("D", 1, 8, 2, False, True),
    ("D", 2, 8, 1, False, True),
    ("D", 4, 4, 1, False, True),   # D's micro-batch is capped so the global batch stays 16
    ("D", 8, 2, 1, False, True),
])
def test_presets_keep_the_global_batch(preset, world, micro, accum, gc, packing):
    cfg = resolve(load_config(REF, [f"preset={preset}"]), world)
    assert cfg.per_device_train_batch_size == micro
    assert cfg.gradient_accumulation_steps == accum
    assert micro * accum * world == cfg.global_batch_size == 16
    assert (cfg.gradient_checkpointing, cfg.packing) == (gc, packing)


def test_indivisible_accumulation_names_all_three_numbers():
    cfg = load_config(REF, ["preset=C", "global_batch_size=12"])
    with pytest.raises(ConfigError) as e:
        resolve(cfg, 8)
    msg = str(e.value)
    assert "global batch 12" in msg and "micro-batch 2" in msg and "world size 8" in msg


def test_explicit_accumulation_must_agree():
    with pytest.raises(ConfigError, match="contradicts"):
        resolve(load_config(REF, ["preset=A", "gradient_accumulation_steps=4"]), 8)
    assert resolve(load_config(REF, ["preset=A", "gradient_accumulation_steps=2"]), 8).gradient_accumulation_steps == 2


def test_unknown_key_suggests_the_right_one(tmp_path):
    with pytest.raises(ConfigError, match="command-line overrides: unknown key 'lora_rnak'. Did you mean 'lora_rank'"):
        load_config(REF, ["lora_rnak=8"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_name_or_path: x\ndataset: a.json\nper_device_batch_size: 2\n")
    with pytest.raises(ConfigError, match=f"{bad}:3: unknown key 'per_device_batch_size'. Did you mean 'per_device_train_batch_size'"):
        load_config(bad)


def test_overrides_win_over_preset_and_file():
    cfg = load_config(REF, ["preset=C", "per_device_train_batch_size=4", "learning_rate=2e-4", "max_steps=100"])
    assert (cfg.preset, cfg.per_device_train_batch_size, cfg.gradient_checkpointing) == ("C", 4, False)
    assert cfg.learning_rate == 2e-4 and cfg.max_steps == 100


def test_parse_overrides_reads_yaml_scalars():
    assert parse_overrides(["a=1e-4", "b=true", "c=null", "d=x,y", "e=[1, 2]"]) == {"a": 1e-4, "b": True, "c": None, "d": "x,y", "e": [1, 2]}
    with pytest.raises(ConfigError, match="not key=value"):
        parse_overrides(["novalue"])


def test_a_key_given_twice_on_the_command_line_uses_the_last_and_says_so_once(capsys):
    assert parse_overrides(["max_steps=5", "learning_rate=1e-4", "max_steps=10"])["max_steps"] == 10
    assert parse_overrides(["max_steps=5", "max_steps=10"])["max_steps"] == 10  # the same pair again: said once
    assert parse_overrides(["max_steps=10", "max_steps=10"])["max_steps"] == 10  # the same value twice: nothing to say
    assert capsys.readouterr().err == ("note: max_steps is given twice on the command line ('5', then '10'): the last "
                                       "one is used\n")
    assert parse_overrides(["max_steps=1", "max_steps=2", "max_steps=3"])["max_steps"] == 3  # one note, every value
    assert capsys.readouterr().err == ("note: max_steps is given 3 times on the command line ('1', then '2', then '3'): "
                                       "the last one is used\n")


def test_bad_values_name_the_key():
    with pytest.raises(ConfigError, match="per_device_train_batch_size: .*> 0"):
        load_config(REF, ["per_device_train_batch_size=0"])
    with pytest.raises(ConfigError, match="unknown preset 'E'"):
        load_config(REF, ["preset=E"])
    for bad in ("absmax_once=maybe", "drop_padding_mask=2"):  # a switch's error says what it takes
        with pytest.raises(ConfigError, match=f"{bad.split('=')[0]}: .*use true or false.*got '?{bad.split('=')[1]}'?"):
            load_config(REF, [bad])


def test_levers_that_contradict_each_other_are_bad_input():
    """Refused as the config loads (exit 2, whatever the machine), naming both keys and the fix."""
    for items, says in ((["grouped_lora=true", "lora_dropout=0.05"], "grouped_lora: true needs lora_dropout 0"),
                        (["grouped_lora=true", "lora_dropout=0", "fused_lora=false"], "grouped_lora: true needs the fused"),
                        (["compile_cpp_wrapper=true", "torch_compile=false"], "compile_cpp_wrapper: true needs the compiled"),
                        (["torch_compile=true", "fused_lora=false"], "torch_compile: true on a 4-bit model needs the fused")):
        with pytest.raises(ConfigError, match=says):
            load_config(REF, items)
    assert load_config(REF, ["grouped_lora=true", "lora_dropout=0"]).grouped_lora is True
    assert load_config(REF, ["torch_compile=true", "fused_lora=false", "quantization_bit=null"]).torch_compile is True


def test_from_cli_takes_file_and_overrides():
    cfg = from_cli([str(REF), "preset=B", "dataset=a.json,b.jsonl"])
    assert cfg.preset == "B" and cfg.dataset == ["a.json", "b.jsonl"]
    assert set(PRESETS) == {"A", "B", "C", "D", "F"}


def test_cli_takes_file_and_overrides_before_and_after_options(monkeypatch):
    import tuneledger.dryrun
    from tuneledger import cli

    seen = []
    monkeypatch.setattr(tuneledger.dryrun, "run", lambda args: seen.append((sorted(args.items), args.preset)) or 0)
    assert cli.main(["dryrun", str(REF), "lora_rank=8", "--preset", "all", "cutoff_len=512"]) == 0
    assert cli.main(["dryrun", "lora_rank=8", "--preset", "b", str(REF), "cutoff_len=512"]) == 0
    want = sorted([str(REF), "lora_rank=8", "cutoff_len=512"])
    assert seen == [(want, "ALL"), (sorted(want + ["preset=B"]), "B")]  # one preset reaches the config too
    for bad in (["dryrun", str(REF), "--bogus"], ["dryrun", str(REF), "--preset", "E"]):
        with pytest.raises(SystemExit):
            cli.main(bad)


def test_ledger_counts_only_the_gpus_the_ranks_used(monkeypatch):
    from tuneledger.launch import used_gpus

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert used_gpus(1) == ["0"] and used_gpus(2) == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6")
    assert used_gpus(2) == ["3", "5"]


def test_override_types_follow_the_fields():
    got = parse_overrides(["run_name=2024-01-01", "default_system=You are: helpful", "output_dir=null",
                           "placeholders={name: A, author: B C}", "lora_rank=8"])
    assert got == {"run_name": "2024-01-01", "default_system": "You are: helpful", "output_dir": None,
                   "placeholders": {"name": "A", "author": "B C"}, "lora_rank": 8}
    cfg = load_config(REF, ["placeholders.name=Ledgerly", "placeholders.author=the team", "run_name=on"])
    assert cfg.placeholders == {"name": "Ledgerly", "author": "the team"} and cfg.run_name == "on"


def test_an_unknown_preset_is_named_with_the_choices_a_user_types(capsys):
    import argparse

    from tuneledger.config_load import add_preset_option

    for allow_all, tail in ((True, "choose one of A, B, C, D, F or all"), (False, "choose one of A, B, C, D, F")):
        p = argparse.ArgumentParser()
        add_preset_option(p, allow_all=allow_all)
        with pytest.raises(SystemExit):
            p.parse_args(["--preset", "E"])
        err = capsys.readouterr().err
        assert f"unknown preset 'E'; {tail}" in err and "'ALL'" not in err
        assert p.parse_args(["--preset", "d"]).preset == "D"


def test_a_key_given_twice_in_a_yaml_is_refused_with_both_lines(tmp_path):
    """YAML keeps the last of two equal keys silently: `cutoff_len` written twice trained with
    whichever came last. Refused, naming the file and both lines, at the top level and nested; a
    merge key (`<<: *base`) overridden on purpose still loads."""
    from tuneledger.config_load import read_yaml_mapping

    twice = tmp_path / "twice.yaml"
    twice.write_text("model_name_or_path: m\ndataset: [x.json]\ncutoff_len: 512\nlora_rank: 8\ncutoff_len: 1024\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: line 5: key 'cutoff_len' is given twice \(first at line 3"):
        load_config(twice)
    nested = tmp_path / "nested.yaml"
    nested.write_text("fsdp_config:\n  version: 2\n  version: 1\n")
    with pytest.raises(ConfigError, match="line 3: key 'version' is given twice"):
        read_yaml_mapping(nested, "config")
    merged = tmp_path / "merged.yaml"
    merged.write_text("base: &b\n  x: 1\n  y: 2\nother:\n  <<: *b\n  x: 3\n")
    assert read_yaml_mapping(merged, "config")["other"] == {"x": 3, "y": 2}


def test_two_presets_say_where_they_were_given():
    from tuneledger.config_load import preset_from_cli

    with pytest.raises(ConfigError, match=r"presets A and B both given \(preset= more than once\)"):
        preset_from_cli(["preset=A", "preset=B"], None)
    with pytest.raises(ConfigError, match=r"presets A and B both given \(--preset and preset=\)"):
        preset_from_cli(["preset=A"], "B")


def test_preset_option_given_twice_is_refused_as_preset_key_twice_is(capsys):
    from tuneledger import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["train", "c.yaml", "--preset", "A", "--preset", "B"])
    assert e.value.code == 2 and "presets A and B both given (--preset more than once)" in capsys.readouterr().err
