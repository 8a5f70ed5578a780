import json

import pytest

from conftest import shared_data
from tuneledger.config_load import load_config
from tuneledger.data import IGNORE_INDEX, DataError, Invalid, encode, read_records, to_messages
from tuneledger.prepare import prepare


def cfg_for(tmp_path, model, dataset, **kw):
    over = {"model_name_or_path": str(model), "dataset": [str(d) for d in dataset], "cache_dir": str(tmp_path / "cache"),
            "output_dir": str(tmp_path / "run"), "quantization_bit": None, "preprocessing_num_workers": 2, **kw}
    return load_config(None, over)


# ------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("record,field,kind", [
    ([1, 2], "<record>", "wrong type"),
    ({"instruction": "hi"}, "output", "missing field"),
    ({"instruction": "hi", "output": 3}, "output", "wrong type"),
    ({"instruction": "hi", "output": "   "}, "output", "empty assistant reply"),
    ({"instruction": "", "input": "", "output": "x"}, "instruction", "empty prompt"),
    ({"instruction": "q", "output": "a", "history": [["only one"]]}, "history[0]", "wrong type"),
    ({"prompt": "q", "completion": "a"}, "<record>", "unknown format"),
    ({"messages": [{"role": "user", "content": "q"}]}, "messages[0].role", "turns out of order"),
    ({"messages": [{"role": "assistant", "content": "a"}]}, "messages[0].role", "turns out of order"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": " "}]}, "conversations[1].value",
     "empty assistant reply"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "output": "b"}, "<record>",
     "ambiguous format"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "a"}]}, "messages[1].role", "unsupported role"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]}, "messages[1].content", "missing field"),
    ({"conversations": []}, "conversations", "wrong type"),
    ({"instruction": "Who are you?", "output": "I am {{name}}."}, "output", "unfilled placeholder"),
])
def test_malformed_records_name_location_field_and_reason(record, field, kind):
    got = to_messages(record, "data.jsonl:7")
    assert isinstance(got, Invalid)
    assert (got.where, got.field, got.kind) == ("data.jsonl:7", field, kind)
    named = f"the {field.strip('<>')}" if field in ("<record>", "<line>") else f"field '{field}'"
    assert str(got).startswith(f"data.jsonl:7: {named}: ")


def test_formats_normalise_to_the_same_conversation():
    alpaca = {"instruction": "Add", "input": "2+2", "output": "4", "system": "Be brief.", "history": [["hi", "hello"]]}
    sharegpt = {"system": "Be brief.", "conversations": [
        {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
        {"from": "human", "value": "Add\n2+2"}, {"from": "gpt", "value": "4"}]}
    messages = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "hello"}, {"role": "user", "content": "Add\n2+2"},
                             {"role": "assistant", "content": "4"}]}
    a, s, m = (to_messages(r, "x") for r in (alpaca, sharegpt, messages))
    assert a == s == m


def test_placeholders_are_filled():
    got = to_messages({"instruction": "Who are you?", "output": "I am {{name}}, made by {{ author }}."}, "x",
                      {"name": "Ledger", "author": "tuneledger"})
    assert got[-1]["content"] == "I am Ledger, made by tuneledger."


def test_jsonl_bad_line_and_json_list_syntax_are_record_errors(tmp_path, capsys):
    good = json.dumps({"instruction": "q", "output": "a"})
    p = tmp_path / "d.jsonl"
    p.write_text(f"{good}\n{{not json\n\n{good}\n")
    rows = list(read_records(p))
    assert [w for w, _ in rows] == [f"{p}:1", f"{p}:2", f"{p}:4"]
    assert isinstance(rows[1][1], Invalid) and rows[1][1].kind == "not valid JSON"
    # A JSON list that breaks costs the record that breaks it, not the file (issue 22).
    bad = tmp_path / "d.json"
    bad.write_text('[{"instruction": "q",\n "output": },\n' + good + "]")
    rows = list(read_records(bad))
    assert [w for w, _ in rows] == [f"{bad}:1 (record 1)", f"{bad}:3 (record 2)"] and rows[1][1] == json.loads(good)
    assert isinstance(rows[0][1], Invalid) and rows[0][1].kind == "not valid JSON" and rows[0][1].field == "<record>"
    assert rows[0][1].reason == "not valid JSON: Expecting value at line 2 column 12"
    assert f"{bad}:2:12: not valid JSON: Expecting value; record 1 left out, the records after it read" in capsys.readouterr().err
    (tmp_path / "obj.json").write_text('{"instruction": "q", "output": "a"}')  # not a list at all: the file is refused
    with pytest.raises(DataError, match="must be a list of records, got dict"):
        list(read_records(tmp_path / "obj.json"))
    with pytest.raises(DataError, match="not found"):
        list(read_records(tmp_path / "missing.json"))


# ---------------------------------------------------------------------------------- labels
def test_labels_token_by_token(qwen_tokenizer):
    tok = qwen_tokenizer
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there"},
            {"role": "user", "content": "bye"}, {"role": "assistant", "content": "Bye!"}]
    enc = encode(msgs, tok, cutoff_len=4096)
    ids, labels = enc["input_ids"], enc["labels"]
    pieces = tok.convert_ids_to_tokens(ids)
    supervised = [p for p, l in zip(pieces, labels) if l != IGNORE_INDEX]
    # Exactly the two replies, each closed by its <|im_end|>; nothing of system/user/headers.
    assert tok.convert_tokens_to_string(supervised) == "Hello there<|im_end|>Bye!<|im_end|>"
    assert all(l in (IGNORE_INDEX, i) for i, l in zip(ids, labels))
    im_end, im_start = tok.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"])
    ends = [j for j, i in enumerate(ids) if i == im_end]
    assert [labels[j] != IGNORE_INDEX for j in ends] == [False, False, True, False, True]  # system, user, asst, user, asst
    assert all(labels[j] == IGNORE_INDEX for j, i in enumerate(ids) if i == im_start)
    # The newline after each <|im_end|> belongs to the next header.
    assert all(labels[j + 1] == IGNORE_INDEX for j in ends if j + 1 < len(ids))
    assert tok.pad_token_id != tok.eos_token_id and tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    assert enc["n_tokens"] == len(ids) and enc["n_supervised"] == len(supervised) and not enc["truncated"]


def test_cutoff_truncates_and_counts(qwen_tokenizer):
    msgs = [{"role": "user", "content": "word " * 50}, {"role": "assistant", "content": "ok"}]
    enc = encode(msgs, qwen_tokenizer, cutoff_len=20)
    assert len(enc["input_ids"]) == len(enc["labels"]) == 20 and enc["truncated"] and enc["n_tokens"] > 20
    assert enc["n_supervised"] == 0 and enc["reason"].startswith("0 supervised tokens left after cutoff_len: ")


# ----------------------------------------------------------------------------------- stats
@pytest.mark.parametrize("name,records,tokens,maximum,mean,median,p95", [
    ("alpaca_zh_demo.json", 1000, 154_874, 565, 154.9, 140, 293),
    ("alpaca_en_demo.json", 999, 194_198, 682, 194.4, 157, 433),
])
def test_stats_match_independent_counts(tmp_path, tiny_model, name, records, tokens, maximum, mean, median, p95):
    from tuneledger.model import load_tokenizer

    cfg = cfg_for(tmp_path, tiny_model, [shared_data(name)], cutoff_len=4096)
    prep = prepare(cfg, load_tokenizer(cfg.model_name_or_path), progress=False)
    r = prep.report
    assert r["records"] == {"total": records, "valid": records, "invalid": 0, "invalid_by_reason": {}}
    assert r["tokens"]["total"] == tokens and r["tokens"]["trained"] == tokens
    assert r["length"] == {"mean": mean, "median": median, "p95": p95, "max": maximum}
    assert r["steps_per_epoch"] == -(-records // 16) and r["over_cutoff"] == 0
    assert 0 < r["tokens"]["supervised"] < tokens
    again = prepare(cfg, load_tokenizer(cfg.model_name_or_path), progress=False)
    assert again.from_cache and again.path == prep.path and again.report == r
    # The batch is not part of the data: a cache hit at another global batch counts its own steps.
    other = prepare(cfg.model_copy(update={"global_batch_size": 8}), load_tokenizer(cfg.model_name_or_path), progress=False)
    assert other.from_cache and other.report["steps_per_epoch"] == -(-records // 8) and other.report["global_batch_size"] == 8


def test_stats_count_invalid_and_cutoff(tmp_path, tiny_model):
    from tuneledger.model import load_tokenizer

    cfg = cfg_for(tmp_path, tiny_model, [shared_data("identity.json")], cutoff_len=64)
    r = prepare(cfg, load_tokenizer(cfg.model_name_or_path), progress=False).report
    assert r["records"]["total"] == 91
    assert r["records"]["invalid_by_reason"].get("unfilled placeholder") == r["records"]["invalid"] > 0
    filled = cfg_for(tmp_path, tiny_model, [shared_data("identity.json")], cutoff_len=64,
                     placeholders={"name": "Ledger", "author": "tuneledger"})
    r = prepare(filled, load_tokenizer(cfg.model_name_or_path), progress=False).report
    assert r["records"]["valid"] == 91 and r["over_cutoff"] > 0
    assert r["tokens"]["trained"] < r["tokens"]["total"]
