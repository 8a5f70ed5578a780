"""Bad input (issue 21, items 7 and 15): one exit code for it, said early, named well."""

import json

import pytest

from tuneledger import cli, records
from tuneledger.data import read_records


def job(tmp_path, model, data):
    return [f"model_name_or_path={model}", f"dataset={data}", f"output_dir={tmp_path / 'run'}",
            f"cache_dir={tmp_path / 'cache'}", "quantization_bit=null", "cutoff_len=64", "global_batch_size=2"]


def test_bad_data_exits_2_as_a_bad_key_does(tmp_path, tiny_model, capsys):
    """A refused key and a refused dataset are both bad input: exit 2 (cli.BAD_INPUT), one line each."""
    assert cli.main(["stats", *job(tmp_path, tiny_model, tmp_path / "d.jsonl"), "lora_rnak=8"]) == cli.BAD_INPUT == 2
    assert "config error" in capsys.readouterr().err
    assert cli.main(["stats", *job(tmp_path, tiny_model, tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("tuneledger stats: dataset file ") and "missing.jsonl not found" in err
    (tmp_path / "broken.json").write_text('[{"instruction": "a", "output": "b"},,]')
    assert cli.main(["stats", *job(tmp_path, tiny_model, tmp_path / "broken.json")]) == 2
    assert "broken.json:1:38: not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("verb", ["dryrun", "train"])
def test_a_missing_dataset_is_said_before_the_preflight_checks(verb, tmp_path, tiny_model, capsys, monkeypatch):
    """Issue 21 (15): it came after 12.7 s of preflight; now before torch or any check loads."""
    import tuneledger.preflight_checks as preflight_checks

    def too_late(*a, **kw):
        raise AssertionError("the preflight checks ran before the missing dataset was said")

    monkeypatch.setattr(preflight_checks, "run_checks", too_late)
    (tmp_path / "d.jsonl").write_text(json.dumps({"instruction": "q", "output": "a"}) + "\n")
    rc = cli.main([verb, *job(tmp_path, tiny_model, tmp_path / "nope.jsonl"), "--cpu", "--nproc", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "dataset file " in err and "nope.jsonl not found" in err
    rc = cli.main([verb, *job(tmp_path, tiny_model, tmp_path / "d.jsonl"), f"eval_dataset={tmp_path / 'ev.json'}",
                   "--cpu", "--nproc", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "eval_dataset: dataset file " in err and "ev.json not found" in err
    assert not (tmp_path / "run").exists()


def test_the_missing_model_hint_makes_up_no_hub_id(tmp_path, monkeypatch):
    from tuneledger.model import PreflightError, locate_model

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(PreflightError) as e:
        locate_model("models/nope")
    text = str(e.value)
    assert "Qwen/nope" not in text and "make fetch MODEL=<organisation>/nope` makes models/nope" in text


@pytest.mark.parametrize("chunk", [1, 5, 1 << 20])
def test_json_list_records_are_named_by_line_and_number_from_1(tmp_path, monkeypatch, chunk):
    """Issue 21 (15): they were `#10` (0-based, no line). Now `file:line (record N)`, like JSONL's
    file:line, with N for a list written on one line. Buffers cut every few characters too."""
    monkeypatch.setattr(records, "CHUNK", chunk)
    multi = tmp_path / "multi.json"
    multi.write_text('[\n  {"instruction": "a",\n   "output": "b"},\n\n  {"instruction": "c"},\n  7\n]\n')
    got = [(where, getattr(obj, "where", None)) for where, obj in read_records(multi)]
    assert [w for w, _ in got] == [f"{multi}:2 (record 1)", f"{multi}:5 (record 2)", f"{multi}:6 (record 3)"]
    one = tmp_path / "one.json"
    one.write_text(json.dumps([{"instruction": "a", "output": "b"}] * 3))
    assert [w for w, _ in read_records(one)] == [f"{one}:1 (record {n})" for n in (1, 2, 3)]


def test_an_option_given_twice_uses_the_last_and_says_so(capsys, monkeypatch):
    """argparse kept the last of `--gpus A --gpus B` silently; every verb's value option now says so
    (as a key=value given twice does), and the same value twice says nothing."""
    from tuneledger import cli

    cli.main(["whatif", "missing.json", "--gpus", "8x4090-pcie", "--gpus", "8xH100-sxm"])
    err = capsys.readouterr().err
    assert "note: --gpus is given twice on the command line ('8x4090-pcie', then '8xH100-sxm'): the last one is used" in err
    cli.main(["whatif", "missing.json", "--gpus", "8xH100-sxm", "--gpus", "8xH100-sxm"])
    assert "given twice" not in capsys.readouterr().err
    from tuneledger import whatif

    seen = []
    monkeypatch.setattr(whatif, "run", lambda a: seen.append(dict(vars(a))) or 0)
    assert cli.main(["whatif", "x.json", "--gpus", "8x4090-pcie", "--gpus", "8xH100-sxm"]) == 0
    assert seen[0]["gpus"] == "8xH100-sxm" and "_given" not in seen[0]  # the verb sees the last value, no bookkeeping


def _parsers() -> dict:
    from tuneledger.cli import build_parser

    return next(a for a in build_parser()._actions if a.choices and isinstance(a.choices, dict)).choices


def _count_options():
    """(verb, option, its least value) for every option of every verb whose value is a count, and
    the options left as plain integers."""
    out, plain = [], []
    for verb, p in _parsers().items():
        for a in p._actions:
            if a.option_strings and a.type is int and not a.dest.endswith("seed"):
                plain.append(f"{verb} {a.option_strings[0]}")
            elif a.option_strings and hasattr(a.type, "least"):
                out.append((verb, a.option_strings[0], a.type.least))
    return out, plain


def test_every_count_option_refuses_a_count_below_its_least_in_one_line(capsys):
    """A rank, record, token or step count below what it can mean (preflight --nproc -1 was taken as
    one rank, 0 as one per GPU) is argparse's one-line usage error, exit 2, naming the option; no
    verb has a plain integer option left but a seed."""
    from tuneledger.cli import build_parser

    counts, plain = _count_options()
    assert not plain, plain
    assert ("preflight", "--nproc", 1) in counts and ("dryrun", "--nproc", 1) in counts and len(counts) >= 20, counts
    for verb, opt, low in counts:
        for bad in (str(low - 1), "x"):
            with pytest.raises(SystemExit) as e:
                build_parser().parse_args([verb, opt, bad])
            assert e.value.code == 2
            err = capsys.readouterr().err
            want = f"must be at least {low}, got {low - 1}" if bad != "x" else "'x' is not a whole number"
            assert f"argument {opt}" in err and want in err, (verb, opt, err)
    for verb, p in _parsers().items():  # the least itself is taken
        for a in p._actions:
            if hasattr(a.type, "least"):
                assert a.type(str(a.type.least)) == a.type.least and a.type(" 8 ") == 8


def test_a_missing_required_key_names_it_and_how_to_give_it_not_the_defaults():
    """pydantic's input for a missing field is the whole merged config: printed, it showed defaults the
    user never gave ("(got {'lora_alpha': 16})")."""
    from tuneledger.config import ConfigError
    from tuneledger.config_load import from_cli

    with pytest.raises(ConfigError) as e:
        from_cli([])
    msg = str(e.value)
    assert "model_name_or_path: missing: give a config file (e.g. configs/tiny.yaml) or model_name_or_path=..." in msg
    assert "dataset: missing" in msg and "lora_alpha" not in msg and "got" not in msg


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_an_empty_jsonl_file_is_refused_as_an_empty_json_file_is(tmp_path, text):
    """A table of zeros and written stats files used to come first, then the refusal."""
    from tuneledger.data import DataError

    f = tmp_path / "d.jsonl"
    f.write_text(text)
    with pytest.raises(DataError, match=r"d.jsonl: holds no record \(the file is empty or only blank lines\)"):
        list(read_records(f))
    (tmp_path / "d.json").write_text(text)
    with pytest.raises(DataError, match=r"d.json:\d+:1: not valid JSON: Expecting value"):
        list(read_records(tmp_path / "d.json"))
