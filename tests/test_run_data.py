"""A run directory belongs to one data hash: stats of other data go beside it, never over it."""

import json

import pytest

from tuneledger import cli


def records(n, tag):
    return "".join(json.dumps({"instruction": f"{tag} question {i}", "output": f"{tag} answer {i}"}) + "\n" for i in range(n))


@pytest.fixture
def job(tmp_path, tiny_model):
    (tmp_path / "demo.jsonl").write_text(records(6, "demo"))
    (tmp_path / "other.json").write_text(json.dumps([json.loads(line) for line in records(4, "other").splitlines()]))
    return [f"model_name_or_path={tiny_model}", f"output_dir={tmp_path / 'runs' / 'tiny'}", f"cache_dir={tmp_path / 'cache'}",
            "quantization_bit=null", "cutoff_len=64", "global_batch_size=2"]


def test_stats_of_other_data_do_not_overwrite_the_runs_stats(tmp_path, job, tiny_model, capsys):
    run = tmp_path / "runs" / "tiny"
    assert cli.main(["stats", *job, f"dataset={tmp_path / 'demo.jsonl'}"]) == 0
    first = capsys.readouterr().out
    own = json.loads((run / "stats.json").read_text())
    assert own["records"]["valid"] == 6
    # The table names the model, the tokenizer and the data hash.
    assert str(tiny_model) in first and "Qwen2Tokenizer" in first and own["cache_key"] in first

    assert cli.main(["stats", *job, f"dataset={tmp_path / 'other.json'}"]) == 0
    out = capsys.readouterr().out
    assert json.loads((run / "stats.json").read_text()) == own  # untouched
    other = list(run.glob("stats-*.json"))
    assert len(other) == 1 and json.loads(other[0].read_text())["records"]["valid"] == 4
    assert (run / f"invalid-{other[0].stem.removeprefix('stats-')}.jsonl").is_file()
    assert f"belongs to data {own['cache_key']}" in out and "RUN=<name>" in out and f"wrote {other[0]}" in out

    # The same data again is the run's own: stats.json is rewritten, nothing new beside it.
    assert cli.main(["stats", *job, f"dataset={tmp_path / 'demo.jsonl'}"]) == 0
    assert len(list(run.glob("stats-*.json"))) == 1


def test_stats_that_failed_the_gate_claim_no_run(tmp_path, job, capsys):
    """Counting broken data (here: every record invalid) must not make the fixed data a stranger."""
    run = tmp_path / "runs" / "tiny"
    (tmp_path / "broken.jsonl").write_text('{"instruction": "hi"}\n' * 4)  # no output: all invalid
    assert cli.main(["stats", *job, f"dataset={tmp_path / 'broken.jsonl'}"]) == 2
    assert json.loads((run / "stats.json").read_text())["gate_passed"] is False
    capsys.readouterr()
    assert cli.main(["stats", *job, f"dataset={tmp_path / 'demo.jsonl'}"]) == 0
    assert "belongs to data" not in capsys.readouterr().out and not list(run.glob("stats-*.json"))
    assert json.loads((run / "stats.json").read_text())["records"]["valid"] == 6


def test_a_training_run_decides_whose_data_the_run_is(tmp_path, job, capsys):
    run = tmp_path / "runs" / "tiny"
    run.mkdir(parents=True)
    (run / "job.json").write_text(json.dumps({"data_path": str(tmp_path / "cache" / "0123456789abcdef")}))
    assert cli.main(["stats", *job, f"dataset={tmp_path / 'demo.jsonl'}"]) == 0
    assert not (run / "stats.json").exists() and len(list(run.glob("stats-*.json"))) == 1
    assert "belongs to data 0123456789abcdef" in capsys.readouterr().out

    rc = cli.main(["dryrun", *job, f"dataset={tmp_path / 'demo.jsonl'}", "--cpu", "--nproc", "1", "--preset", "A"])
    err = capsys.readouterr().err
    assert rc == 2 and "is a training run on data 0123456789abcdef" in err and "another run_name" in err
    assert not (run / "dryrun.json").exists() and not (run / "dryrun").exists()
