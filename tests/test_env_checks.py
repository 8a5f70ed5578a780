"""Environment checks that used to pass and fail later (issue 13, item 13), and the seed (item 14)."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

import procs
from tuneledger.model import PreflightError, check_embedding_rows, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def test_tensorboard_too_old_for_torch_fails_preflight(tmp_path, tiny_model):
    # `import tensorboard` works, but torch.utils.tensorboard (what the run imports) refuses it.
    fake = tmp_path / "site" / "tensorboard"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "1.14.0"\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT / "src")])}
    p = procs.run([sys.executable, "-m", "tuneledger", "preflight", "--cpu", f"model_name_or_path={tiny_model}",
                   "dataset=x.json", "quantization_bit=null", f"output_dir={tmp_path / 'run'}"], env=env, cwd=ROOT)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "FAIL report_to=tensorboard but TensorBoard logging does not work here" in p.stdout
    assert "requires TensorBoard version 1.15 or above" in p.stdout


def copy_model(tmp_path, tiny_model, **tokenizer_config):
    d = tmp_path / "model"
    shutil.copytree(tiny_model, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_config)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_no_pad_token_takes_an_existing_one(tmp_path, tiny_model):
    d = copy_model(tmp_path, tiny_model, pad_token=None)
    tok = load_tokenizer(str(d))
    rows = json.loads((d / "config.json").read_text())["vocab_size"]
    assert tok.pad_token == "<|endoftext|>" and len(tok) == rows == 151_665  # nothing added
    assert "151,665 tokens within the model's 151,665 embedding rows" in check_embedding_rows(tok, {"vocab_size": rows}, "m")


def test_no_pad_and_no_candidate_falls_back_to_eos_not_a_new_id(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|im_start|>": 0, "<|im_end|>": 1, "user": 2, "assistant": 3, "hi": 4}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="hi"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>",
                                   chat_template="{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}")
    fast.save_pretrained(tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert tok.pad_token_id is not None and tok.pad_token_id < len(vocab) and len(tok) == len(vocab)


def test_pad_beyond_the_embedding_rows_is_refused_naming_both_numbers(qwen_tokenizer):
    import copy

    tok = copy.deepcopy(qwen_tokenizer)
    tok.add_special_tokens({"pad_token": "<|pad|>"})  # what load_tokenizer used to do: id 151665
    with pytest.raises(PreflightError, match="pad token '<\\|pad\\|>' has id 151,665, but the model has only 151,665 embedding rows"):
        check_embedding_rows(tok, {"vocab_size": 151_665}, "m")
    with pytest.raises(PreflightError, match="has 151,665 tokens, but the model has only 151,650 embedding rows"):
        check_embedding_rows(qwen_tokenizer, {"vocab_size": 151_650}, "m")


def test_stats_refuses_a_tokenizer_past_the_embedding_rows(tmp_path, tiny_model):
    d = copy_model(tmp_path, tiny_model)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "vocab_size": 151_650}))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"instruction": "q", "output": "a"}) + "\n")
    p = procs.run([sys.executable, "-m", "tuneledger", "stats", f"model_name_or_path={d}", f"dataset={data}",
                   f"cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'run'}"], cwd=ROOT)
    assert p.returncode == 1 and "151,665 tokens, but the model has only 151,650 embedding rows" in p.stderr


# ------------------------------------------------------------------------------------ seed
def lora_weights(model):
    return {k: v.detach().clone() for k, v in model.named_parameters() if "lora_" in k}


def test_seed_fixes_the_lora_init(tiny_model):
    import torch

    from tuneledger.config_load import load_config
    from tuneledger.model import load_model

    cfg = load_config(None, {"model_name_or_path": str(tiny_model), "dataset": ["x.json"], "quantization_bit": None,
                             "bf16": False, "lora_rank": 4, "seed": 42})
    torch.manual_seed(1)
    a = lora_weights(load_model(cfg, "cpu")[0])
    torch.manual_seed(2)  # whatever drew random numbers before must not matter
    b = lora_weights(load_model(cfg, "cpu")[0])
    c = lora_weights(load_model(cfg.model_copy(update={"seed": 7}), "cpu")[0])
    assert a.keys() == b.keys() and any("lora_A" in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a if "lora_A" in k)


@pytest.mark.e2e
@pytest.mark.slow  # two 2-rank trainings: minutes on 2 cores
def test_same_seed_same_first_losses_two_gloo_ranks(tmp_path, tiny_model):
    def train(name, *extra):
        args = [str(ROOT / "configs" / "tiny.yaml"), f"model_name_or_path={tiny_model}", f"output_dir={tmp_path / name}",
                f"cache_dir={tmp_path / 'cache'}", "max_samples=16", "cutoff_len=128", "global_batch_size=4",
                "max_steps=2", "logging_steps=1", "save_steps=100", "lora_rank=8", *extra]
        p = procs.run([sys.executable, "-m", "tuneledger", "train", *args, "--cpu", "--nproc", "2"], cwd=ROOT)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        result = json.loads((tmp_path / name / "train.json").read_text())
        state = json.loads((Path(result["checkpoint"]) / "trainer_state.json").read_text())
        return result, [(h["step"], h["loss"], h["grad_norm"]) for h in state["log_history"] if "loss" in h]

    first, a = train("a", "report_to=tensorboard")
    second, b = train("b", "report_to=none")  # logging does not touch the numbers
    assert [s for s, _, _ in a] == [1, 2] and a == b
    # The ledger names TensorBoard only when event files were written.
    assert first["report_to"] == "tensorboard" and list(Path(first["tensorboard_dir"]).glob("events.out.tfevents.*"))
    assert second["report_to"] == "none" and second["tensorboard_dir"] is None
