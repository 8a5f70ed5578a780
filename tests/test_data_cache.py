"""Issue 20, item 5 (cache half): a damaged tokenized cache is named and built again, never used."""

import json

import numpy as np
import pytest

from test_data import cfg_for
from tuneledger import cache
from tuneledger.prepare import prepare

GOOD = [{"instruction": f"What is {i} + {i}?", "output": f"{2 * i}, since {i} + {i} = {2 * i}."} for i in range(40)]


@pytest.fixture
def built(tmp_path, tiny_model, qwen_tokenizer):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in GOOD))
    cfg = cfg_for(tmp_path, tiny_model, [data], cutoff_len=256)
    prep = prepare(cfg, qwen_tokenizer, progress=False)
    assert not prep.from_cache and prepare(cfg, qwen_tokenizer, progress=False).from_cache
    import datasets

    rows = datasets.load_from_disk(str(prep.path))[:]
    return cfg, prep, rows


def arrow(prep):
    (f,) = sorted(prep.path.glob("data-*.arrow"))
    return f


def flip(path, pattern, byte, bit):
    raw = bytearray(path.read_bytes())
    at = raw.find(pattern)
    assert at >= 0 and raw.find(pattern, at + 1) < 0, "the pattern must be unique"
    raw[at + byte] ^= 1 << bit
    path.write_bytes(bytes(raw))


def as_bytes(values, prep, column="input_ids"):
    import datasets

    dtype = datasets.load_from_disk(str(prep.path)).features[column].feature.dtype  # as saved
    return np.asarray(values, dtype=dtype).tobytes()


def test_flipped_token_id_is_named_and_the_cache_rebuilt(built, qwen_tokenizer, capsys):
    cfg, prep, rows = built
    ids = rows["input_ids"][7]
    size = len(as_bytes([0], prep))
    flip(arrow(prep), as_bytes(ids[-12:], prep), size * 5, 3)  # a token of record 7's reply: another valid id
    again = prepare(cfg, qwen_tokenizer, progress=False)
    out = capsys.readouterr().out
    assert not again.from_cache and again.path == prep.path
    assert f"cache damaged: {arrow(prep)}: content hash differs from the seal" in out and "rebuilding" in out
    assert "content hash differs" in again.rebuilt and again.report == prep.report
    import datasets

    assert datasets.load_from_disk(str(again.path))[:]["input_ids"] == rows["input_ids"]
    assert list(prep.path.parent.glob(f"{prep.path.name}.damaged-*"))  # kept for a look
    assert prepare(cfg, qwen_tokenizer, progress=False).from_cache  # the rebuilt cache is whole


def test_flipped_label_is_named_not_an_index_error(built, qwen_tokenizer, capsys):
    cfg, prep, rows = built
    labels = rows["labels"][3]
    j = next(k for k, v in enumerate(labels) if v != -100)
    flip(arrow(prep), as_bytes(labels[j - 6:j + 4], prep, "labels"), len(as_bytes([0], prep, "labels")) * 5, 0)  # last -100 before the reply: -99
    again = prepare(cfg, qwen_tokenizer, progress=False)
    assert not again.from_cache and f"cache damaged: {arrow(prep)}" in capsys.readouterr().out
    import datasets

    assert datasets.load_from_disk(str(again.path))[:]["labels"] == rows["labels"]


def test_damaged_report_is_named(built, qwen_tokenizer, capsys):
    cfg, prep, _ = built
    meta = prep.path / "tuneledger.json"
    meta.write_text(meta.read_text().replace('"valid": 40', '"valid": 41'))
    again = prepare(cfg, qwen_tokenizer, progress=False)
    assert not again.from_cache and again.report["records"]["valid"] == 40
    assert "the report's hash differs from its seal" in capsys.readouterr().out


def test_ids_outside_the_vocabulary_name_the_cache_even_with_a_good_seal(built):
    cfg, prep, rows = built
    # A cache whose seal holds (written so) but whose ids do not fit this tokenizer: stale, or
    # damaged before it was sealed. The cheap check after the hash names it.
    saved, why = cache.check(prep.path, vocab_size=151_665)
    assert saved is not None and why == ""
    small = max(max(r) for r in rows["input_ids"])  # the largest id: a vocabulary one short of it
    saved, why = cache.check(prep.path, vocab_size=small)
    assert saved is None and why == f"{prep.path}: input_ids hold {small}, outside 0..{small - 1}"


def test_the_same_bytes_at_another_path_get_their_own_cache_and_names(tmp_path, tiny_model, qwen_tokenizer):
    """A copy of a data file is tokenized for itself: the report and the invalid records name the
    file that was read, so a resume compares the right file (issue 20, a fresh tester's find)."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in GOOD) + '{"instruction": "x"}\n'
    a.write_text(text)
    b.write_text(text)
    pa = prepare(cfg_for(tmp_path, tiny_model, [a], cutoff_len=256), qwen_tokenizer, progress=False)
    pb = prepare(cfg_for(tmp_path, tiny_model, [b], cutoff_len=256), qwen_tokenizer, progress=False)
    assert pa.path != pb.path and not pb.from_cache
    assert list(pb.report["data_files"]) == [str(b)] and all(str(b) in i.where for i in pb.invalid) and pb.invalid


def test_a_big_cache_is_copied_by_save_workers_and_reads_the_same(tmp_path, tiny_model, qwen_tokenizer, monkeypatch):
    """Over prepare.COPY_IN_WORKERS of Arrow, datasets' spawned save workers write the cache in
    shards (here every cache, in 1 KB shards): the same rows, sealed, a hit the next time."""
    import datasets

    from tuneledger import prepare as prep_module

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in GOOD) + '{"instruction": "x"}\n')
    small = prepare(cfg_for(tmp_path / "a", tiny_model, [data], cutoff_len=256), qwen_tokenizer, progress=False)
    monkeypatch.setattr(prep_module, "COPY_IN_WORKERS", 0)
    monkeypatch.setattr(prep_module, "SHARD", "1KB")
    cfg = cfg_for(tmp_path / "b", tiny_model, [data], cutoff_len=256)
    big = prepare(cfg, qwen_tokenizer, progress=False)
    assert len(list(big.path.glob("data-*.arrow"))) > 1 and len(list(small.path.glob("data-*.arrow"))) == 1
    assert datasets.load_from_disk(str(big.path))[:] == datasets.load_from_disk(str(small.path))[:]
    assert big.report["tokens"] == small.report["tokens"] and [i.as_dict() for i in big.invalid] == [i.as_dict() for i in small.invalid]
    assert cache.check(big.path, len(qwen_tokenizer))[1] == "" and prepare(cfg, qwen_tokenizer, progress=False).from_cache
