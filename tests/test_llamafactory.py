"""LLaMA-Factory configs run unchanged: real example yamls (tests/fixtures/llamafactory, Apache-2.0, see
its NOTICE), every key classified, every problem reported at once, the generated keys table, and
datasets by name through dataset_info.json."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import procs
from tuneledger.config import ConfigError, resolve
from tuneledger.config_load import load_config, suggest
from tuneledger.data import DataError
from tuneledger.llamafactory import classify, lf_keys

ROOT = Path(__file__).resolve().parents[1]
LF = ROOT / "tests" / "fixtures" / "llamafactory"
LORA, QLORA, EVAL = LF / "qwen3_lora_sft.yaml", LF / "qwen3_lora_sft_otfq.yaml", LF / "llama3_lora_sft.yaml"


# ------------------------------------------------------------------------------------------ keys
def test_keys_doc_is_generated_from_the_code():
    from tuneledger.llamafactory_docs import markdown_table

    committed = (ROOT / "docs" / "llamafactory-keys.md").read_text()
    assert committed == markdown_table(), "docs/llamafactory-keys.md is stale: run python scripts/llamafactory_keys.py docs"
    for key in lf_keys():
        assert f"| `{key}` |" in committed


@pytest.mark.parametrize("path", [LORA, QLORA, EVAL])
def test_example_yamls_load_unchanged_and_list_ignored_keys_once(path, capsys):
    from tuneledger import config_load

    config_load._ANNOUNCED.clear()
    cfg = load_config(path)
    load_config(path)  # a verb that builds the config twice lists the ignored keys once
    err = capsys.readouterr().err
    assert err.count("accepted and ignored") == 1
    for key in ("stage: ", "do_train: ", "finetuning_type: ", "overwrite_output_dir: "):
        assert f"\n  {key}" in err
    # LLaMA-Factory's meanings: alpha 2 x rank when unset; global batch = micro x accumulation x world.
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_target) == (8, 16, "all")
    assert cfg.dataset == ["identity", "alpaca_en_demo"] and cfg.dataset_dir == "data"
    assert cfg.resume_from_checkpoint == "auto" and cfg.plot_loss
    r = resolve(cfg, 2)
    assert (r.global_batch_size, r.gradient_accumulation_steps) == (16, 8)
    assert cfg.quantization_bit == (4 if path == QLORA else None)


def test_eval_keys_of_the_example_are_read():
    cfg = load_config(EVAL)
    assert (cfg.val_size, cfg.per_device_eval_batch_size, cfg.eval_strategy, cfg.eval_steps) == (0.1, 1, "steps", 500)
    assert cfg.evaluates


def test_quantization_bit_unset_is_bf16_lora(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model_name_or_path: m\ndataset: a.json\n")
    cfg = load_config(f)
    assert cfg.quantization_bit is None and cfg.bf16
    assert load_config(ROOT / "configs" / "qwen2.5-7b-qlora.yaml").quantization_bit == 4


def test_every_problem_is_reported_at_once_naming_line_and_alternative(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("model_name_or_path: m\ndataset: a.json\nstage: dpo\ndeepspeed: ds_z3.json\nfinetuning_type: full\n"
                 "lora_rnak: 8\ncutoff_len: -1\nuse_galore: true\ndo_train: true\n")
    with pytest.raises(ConfigError) as e:
        load_config(f, ["per_device_eval_batchsize=2"])
    msg = str(e.value)
    assert msg.startswith(f"7 problems in {f}")
    assert f"{f}:3: stage: 'dpo' is not supported: tuneledger does supervised fine-tuning only" in msg
    assert f"{f}:4: deepspeed:" in msg and "runs DDP (presets A-D" in msg
    assert f"{f}:5: finetuning_type: 'full'" in msg and "set finetuning_type: lora" in msg
    assert f"{f}:6: unknown key 'lora_rnak'. Did you mean 'lora_rank'?" in msg
    assert "cutoff_len: must be > 0" in msg
    assert f"{f}:8: use_galore: True is not supported: another fine-tuning method" in msg
    assert "command-line overrides: unknown key 'per_device_eval_batchsize'. Did you mean 'per_device_eval_batch_size'?" in msg
    assert "do_train" not in msg


def test_suggestions_are_close_and_never_cross_the_eval_train_split():
    assert suggest("per_device_batch_size") == "per_device_train_batch_size"
    assert suggest("per_device_eval_batchsize") == "per_device_eval_batch_size"
    assert suggest("eval_step") == "eval_steps"
    assert suggest("per_device_eval_size") != "per_device_train_batch_size"
    assert suggest("train_eval_batch") in (None, "per_device_eval_batch_size")
    assert suggest("zzz_unrelated") is None
    for key in ("eval_batch_size", "eval_accumulation", "evaluation_batch"):
        assert suggest(key) is None or "eval" in suggest(key)


def test_lf_keys_classify_by_value():
    assert classify("stage", "sft").status == "ignored" and classify("stage", "ppo").status == "refused"
    assert classify("save_only_model", False).status == "ignored" and classify("save_only_model", True).status == "refused"
    assert classify("quantization_method", "hqq").status == "refused"
    assert classify("galore_rank", 16).status == "ignored"  # LLaMA-Factory's default: changes nothing
    assert classify("galore_rank", 32).status == "refused"
    assert classify("neat_packing", True).updates == {"packing": True}
    assert classify("not_a_key_anywhere", 1) is None
    cfg = load_config(None, ["model_name_or_path=m", "dataset=a.json", "flash_attn=disabled", "disable_gradient_checkpointing=true"])
    assert cfg.flash_attn == "eager" and cfg.gradient_checkpointing is False


def test_explicit_global_batch_still_wins_over_accumulation():
    cfg = load_config(None, ["model_name_or_path=m", "dataset=a.json", "global_batch_size=16", "gradient_accumulation_steps=4"])
    with pytest.raises(ConfigError, match="contradicts"):
        resolve(cfg, 1)
    assert resolve(cfg, 4).gradient_accumulation_steps == 4


# -------------------------------------------------------------------------------- datasets by name
def lf_data_dir(root: Path, n_alpaca: int = 20, n_identity: int = 6) -> Path:
    """A LLaMA-Factory `data/` folder: its real dataset_info.json, and small files of the two demo
    datasets' formats (identity.json with {{name}}/{{author}} as LLaMA-Factory ships it)."""
    data = root / "data"
    data.mkdir(parents=True)
    shutil.copy(LF / "dataset_info.json", data / "dataset_info.json")
    (data / "identity.json").write_text(json.dumps(
        [{"instruction": f"hi {i}", "input": "", "output": f"I am {{{{name}}}}, made by {{{{author}}}} ({i})."}
         for i in range(n_identity)]))
    (data / "alpaca_en_demo.json").write_text(json.dumps(
        [{"instruction": f"Add {i} and {i}.", "input": "" if i % 2 else "Be brief.", "output": f"{2 * i}."}
         for i in range(n_alpaca)]))
    return data


def test_names_resolve_through_dataset_info(tmp_path):
    from tuneledger.dataset_info import resolve_sources

    data = lf_data_dir(tmp_path)
    sources = resolve_sources(["identity", "alpaca_en_demo", str(data / "identity.json")], data, str(tmp_path / "c"))
    assert [s.files for s in sources] == [[data / "identity.json"], [data / "alpaca_en_demo.json"], [data / "identity.json"]]
    assert sources[0].formatting == "alpaca" and sources[2].formatting is None  # a path is read as it is
    with pytest.raises(DataError, match="dataset 'alpaca_en_dem' is neither a file nor a name in .*dataset_info.json; "
                                        "close names there: alpaca_en_demo"):
        resolve_sources(["alpaca_en_dem"], data, str(tmp_path / "c"))
    with pytest.raises(DataError, match="mllm_demo': columns \\['images'\\] .* not supported"):
        resolve_sources(["mllm_demo"], data, str(tmp_path / "c"))
    with pytest.raises(DataError, match="dpo_en_demo': ranking is not supported"):
        resolve_sources(["dpo_en_demo"], data, str(tmp_path / "c"))
    with pytest.raises(DataError, match="nowhere/dataset_info.json not found"):
        resolve_sources(["identity"], tmp_path / "nowhere", str(tmp_path / "c"))


def test_columns_and_sharegpt_tags_rename_into_conversations(tmp_path):
    from tuneledger.data import Invalid, to_messages
    from tuneledger.dataset_info import resolve_sources

    (tmp_path / "qa.jsonl").write_text('{"question": "2+2?", "answer": "4", "sys": "Be terse."}\n{"question": "x"}\n')
    (tmp_path / "chat.json").write_text(json.dumps([
        {"msgs": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]},
        {"msgs": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "{}"}]}]))
    (tmp_path / "dataset_info.json").write_text(json.dumps({
        "qa": {"file_name": "qa.jsonl", "columns": {"prompt": "question", "response": "answer", "system": "sys"}},
        "chat": {"file_name": "chat.json", "formatting": "sharegpt", "columns": {"messages": "msgs"},
                 "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "bot",
                          "observation_tag": "tool"}}}))
    qa, chat = resolve_sources(["qa", "chat"], tmp_path, str(tmp_path / "c"))
    assert to_messages(qa.convert({"question": "2+2?", "answer": "4", "sys": "Be terse."}, "w"), "w") == [
        {"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    bad = qa.convert({"question": "x"}, "qa.jsonl:2")
    assert isinstance(bad, Invalid) and bad.field == "answer" and bad.kind == "missing field"
    assert to_messages(chat.convert({"msgs": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]}, "w"),
                       "w") == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    tool = chat.convert({"msgs": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "{}"}]}, "chat.json#1")
    assert isinstance(tool, Invalid) and tool.field == "msgs[1].role" and "tool-call data is not supported" in tool.reason
    # A canonical field's error names the user's column.
    empty = to_messages(qa.convert({"question": "q", "answer": " "}, "w"), "w")
    assert qa.field_name(empty.field) == "answer"


def test_prepare_reads_names_and_caps_each_dataset(tmp_path, qwen_tokenizer):
    from tuneledger.prepare import prepare

    data = lf_data_dir(tmp_path)
    cfg = load_config(None, ["model_name_or_path=m", "dataset=identity,alpaca_en_demo", f"dataset_dir={data}",
                             f"cache_dir={tmp_path / 'cache'}", "max_samples=5", "placeholders.name=Ledgerly",
                             "placeholders.author=us"])
    prep = prepare(cfg, qwen_tokenizer, progress=False)
    # max_samples caps each dataset, as in LLaMA-Factory: 5 + 5.
    assert prep.report["records"] == {"total": 10, "valid": 10, "invalid": 0, "invalid_by_reason": {}}
    # Another column mapping is another cache entry.
    info = json.loads((data / "dataset_info.json").read_text())
    info["alpaca_en_demo"]["columns"] = {"query": "nothing"}
    (data / "dataset_info.json").write_text(json.dumps(info))
    assert prepare(cfg, qwen_tokenizer, progress=False).path != prep.path


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}])
def test_hub_dataset_offline_fails_at_once(tmp_path, monkeypatch, env):
    from tuneledger.dataset_info import resolve_sources

    data = lf_data_dir(tmp_path)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    t0 = time.monotonic()
    with pytest.raises(DataError, match="'alpaca_en': hub dataset llamafactory/alpaca_en cannot be .*give the entry a file_name"):
        resolve_sources(["alpaca_en"], data, str(tmp_path / "c"))
    assert time.monotonic() - t0 < 60  # no retry loop: a refused connection answers at once


# ------------------------------------------------------------------ the example yamls, run unchanged
def tl(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return procs.run([sys.executable, "-m", "tuneledger", *args], cwd=cwd, env=env)


def lf_run(tmp_path: Path, tiny_model: Path, yaml: Path, *extra: str, verb: str = "train") -> subprocess.CompletedProcess:
    """`tuneledger <verb> <yaml unchanged>` in a folder laid out as LLaMA-Factory's (data/ beside the
    run), pointed at the tiny model; identity.json's placeholders filled on the command line."""
    if not (tmp_path / "data").exists():
        lf_data_dir(tmp_path)
    return tl(tmp_path, verb, str(yaml), f"model_name_or_path={tiny_model}", f"cache_dir={tmp_path / 'cache'}",
              "placeholders.name=Ledgerly", "placeholders.author=us", "--cpu", *extra)


@pytest.mark.e2e
def test_lora_sft_example_trains_on_cpu(tmp_path, tiny_model):
    p = lf_run(tmp_path, tiny_model, LORA, "max_steps=2", "logging_steps=1", "--nproc", "1")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "LLaMA-Factory keys accepted and ignored" in p.stderr and "\n  overwrite_output_dir: " in p.stderr
    out = tmp_path / "saves" / "qwen3-4b" / "lora" / "sft"  # the yaml's output_dir
    result = json.loads((out / "train.json").read_text())
    assert result["global_step"] == 2
    assert result["config"]["global_batch_size"] == 8 and result["config"]["lora_alpha"] == 16  # 1 x 8 x 1 rank
    assert result["config"]["quantization_bit"] is None and result["report_to"] == "none"
    assert (out / "training_loss.png").stat().st_size > 0  # plot_loss: true


@pytest.mark.e2e
def test_stats_counts_the_steps_train_will_run(tmp_path, tiny_model):
    """The LoRA example gives micro-batch 1 x accumulation 8 and no global batch: on 2 ranks that is a
    global batch of 8 on 1 rank (not the default 16), as train computes it, and stats' steps per epoch
    must use the same."""
    p = lf_run(tmp_path, tiny_model, LORA, "--nproc", "1", verb="stats")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "global batch 8 = micro-batch 1 x gradient accumulation 8 x world size 1" in p.stdout
    report = json.loads((tmp_path / "saves" / "qwen3-4b" / "lora" / "sft" / "stats.json").read_text())
    assert report["global_batch_size"] == 8 and report["steps_per_epoch"] == -(-26 // 8)  # 6 identity + 20 alpaca


@pytest.mark.e2e
def test_qlora_example_on_cpu_is_refused_before_loading(tmp_path, tiny_model):
    """A QLoRA config needs bitsandbytes on CUDA: on a CPU it stops in preflight, saying how to run it."""
    p = lf_run(tmp_path, tiny_model, QLORA, "max_steps=1", "--nproc", "1")
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert "quantization_bit=4 needs a CUDA GPU" in p.stderr and "quantization_bit=null" in p.stderr
    assert not (tmp_path / "saves" / "qwen3-4b" / "lora" / "sft" / "train.json").exists()


@pytest.mark.e2e
@pytest.mark.slow  # a 2-process run of minutes on 2 cores: make test stays under 10 min
def test_eval_example_evaluates_on_every_rank_and_picks_the_best(tmp_path, tiny_model):
    from tuneledger.checkpoints import find_checkpoint

    p = lf_run(tmp_path, tiny_model, EVAL, "max_steps=2", "eval_steps=1", "save_steps=1", "--nproc", "2")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = tmp_path / "saves" / "llama3-8b" / "lora" / "sft"
    result = json.loads((out / "train.json").read_text())
    # val_size 0.1 of 26 records: ceil(2.6) = 3 held out, by seed.
    assert result["eval_records"] == 3 and "3 records held out for evaluation" in p.stdout
    assert [e["step"] for e in result["eval"]] == [1, 2]
    assert all(r["eval_batches"] > 0 for r in result["ranks"]) and len(result["ranks"]) == 2  # DDP: both ranks evaluate
    best = min(result["eval"], key=lambda e: e["eval_loss"])
    assert tmp_path / result["best_checkpoint"] == out / f"checkpoint-{best['step']}"  # relative to the run's cwd, as output_dir
    assert find_checkpoint(out / "checkpoint-best") == out / f"checkpoint-{best['step']}"  # make export CHECKPOINT=best
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for d in (out / "tensorboard").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(d.parent))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    assert "eval/loss" in tags  # (the train loss is logged every logging_steps: 10 here, past these 2 steps)
    assert (out / "training_loss.png").stat().st_size > 0


@pytest.mark.e2e
@pytest.mark.slow  # a 2-process run of minutes on 2 cores: make test stays under 10 min
def test_dryrun_eta_counts_evaluation_and_draws_the_comparison(tmp_path, tiny_model):
    p = lf_run(tmp_path, tiny_model, EVAL, "dryrun_steps=3", "dryrun_warmup_steps=1", "eval_steps=1", "output_dir=dr",
               "--preset", "A", "--nproc", "1", verb="dryrun")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    led = json.loads((tmp_path / "dr" / "dryrun.json").read_text())
    row = led["presets"][0]
    eta = row["eta"]
    # An evaluation every step: the ETA's eval part is measured and counted (eta.predict's parts).
    assert eta["parts"]["eval_s"] > 0 and "eval_s" in eta["measured"]
    assert abs(eta["total_s"] - sum(eta["parts"].values())) < 1e-6
    assert (tmp_path / "dr" / "dryrun.png").stat().st_size > 0 and led["comparison_plot"].endswith("dryrun.png")
    assert row["memory_mib"][0]["peak_rss"] > 0  # CPU runs draw their RAM against the 24 GB line


def test_val_size_holds_out_by_seed_and_shrinks_the_steps(tmp_path):
    import datasets

    from tuneledger.data import holdout_count, with_batch
    from tuneledger.worker import split_eval

    assert [holdout_count(26, v) for v in (0, 0.1, 0.5, 5, 40)] == [0, 3, 13, 5, 26]
    cfg = load_config(None, ["model_name_or_path=m", "dataset=a.json", "val_size=0.1", "global_batch_size=4"])
    report = {"records": {"valid": 26}, "tokens": {"trained": 2600}}
    b = with_batch(report, cfg)
    assert (b["eval_records"], b["train_records"], b["steps_per_epoch"]) == (3, 23, 6)
    ds = datasets.Dataset.from_dict({"input_ids": [[i] for i in range(26)], "labels": [[i] for i in range(26)]})
    train, ev = split_eval(ds, cfg)
    train2, ev2 = split_eval(ds, cfg)
    assert len(ev) == 3 and len(train) == 23 and ev["input_ids"] == ev2["input_ids"]  # the same on every rank
    assert not set(map(tuple, ev["input_ids"])) & set(map(tuple, train["input_ids"]))
    # On the sealed cache as the ranks load it: the split writes nothing beside it (it did: the
    # next run called the cache damaged and tokenized again).
    ds.save_to_disk(str(tmp_path / "sealed"))
    before = sorted(p.name for p in (tmp_path / "sealed").iterdir())
    train3, ev3 = split_eval(datasets.load_from_disk(str(tmp_path / "sealed")), cfg)
    assert ev3["input_ids"] == ev["input_ids"] and len(train3) == 23
    stock = ds.train_test_split(test_size=3, seed=cfg.seed, shuffle=True)  # the split runs had before
    assert stock["test"]["input_ids"] == ev["input_ids"] and stock["train"]["input_ids"] == train["input_ids"]
    assert sorted(p.name for p in (tmp_path / "sealed").iterdir()) == before
    with pytest.raises(ConfigError, match="val_size .* and eval_dataset .* both set"):
        load_config(None, ["model_name_or_path=m", "dataset=a.json", "val_size=0.1", "eval_dataset=b.json"])
    with pytest.raises(ConfigError, match="val_size: a count"):
        load_config(None, ["model_name_or_path=m", "dataset=a.json", "val_size=2.5"])


# ------------------------------------------------------------------- export, chat and eval configs
def test_adapter_key_means_the_adapter_in_export_chat_eval_and_is_refused_in_training():
    from tuneledger.config import FIELDS
    from tuneledger.llamafactory_use import classify_use

    assert classify("adapter_name_or_path", "saves/x").status == "refused"
    assert "resumes from its last checkpoint" in classify("adapter_name_or_path", "saves/x").text
    for verb in ("export", "chat", "eval"):
        v = classify_use(verb, "adapter_name_or_path", "saves/x", FIELDS)
        assert v.status == "implemented" and "adapter_config.json" in v.text and "resum" not in v.text
    assert classify_use("export", "export_size", 5, FIELDS).status == "implemented"
    assert classify_use("chat", "export_size", 5, FIELDS).status == "ignored"  # not chat's business, not an error
    assert classify_use("export", "lora_rank", 64, FIELDS).status == "ignored"
    assert classify_use("eval", "cutoff_len", 64, FIELDS).status == "implemented"
    assert classify_use("eval", "do_sample", True, FIELDS).status == "refused"


def test_benchmark_eval_config_is_one_sentence(tmp_path):
    f = tmp_path / "mmlu.yaml"
    f.write_text("model_name_or_path: m\ntask: mmlu_test\ntemplate: fewshot\nlang: en\nn_shot: 5\nsave_dir: s\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert "\n" not in str(e.value) and "task: mmlu_test" in str(e.value) and "lm_eval" in str(e.value)


def test_template_line_says_what_renders(tiny_model):
    from tuneledger.templateinfo import local_chat_template, template_line

    own = local_chat_template(str(tiny_model))
    assert "<|im_start|>" in own
    assert template_line("qwen", own, "M") == ("template: qwen = ChatML, the tokenizer's own chat template of M (ChatML): "
                                                 "it renders every record, as LLaMA-Factory's qwen would")
    assert template_line("llama3", own, "M").startswith("template: WARNING llama3 asks for Llama 3")
    assert "as asked" in template_line("tokenizer", own, "M")
    assert "NOTE 'alpaca' is not a format" in template_line("alpaca", own, "M")
    assert "data preparation refuses" in template_line("qwen", "{{ '[INST]' }}", "M")
    p = subprocess.run([sys.executable, "-m", "tuneledger", "stats", str(EVAL), f"model_name_or_path={tiny_model}",
                        "dataset=x.json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "template: WARNING llama3 asks for Llama 3" in p.stderr  # at the start, before the data is read


def test_a_refusal_says_not_supported_once():
    """Every refusal reads '<key>: <value> is not supported: <reason or what instead>', with the
    rule's own opening 'X is not supported' dropped (a fresh-user trial found it said twice)."""
    from tuneledger.config_load import refusal_text
    from tuneledger.llamafactory import ONLY, REFUSED

    texts = {k: r.instead for k, r in ONLY.items()} | dict(REFUSED)
    for key, text in texts.items():
        line = f"{key}: True is not supported: {refusal_text(key, text)}"
        assert line.count("not supported") == 1, line
        assert refusal_text(key, text).strip(), key
