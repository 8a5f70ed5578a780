import json

from conftest import QWEN_TOKENIZER, shared
from tuneledger.synth import ARCHS, write_qwen25_tokenizer


def test_rebuilt_tokenizer_is_qwen25(tmp_path):
    """The offline rebuild from qwen-tokenizer's BPE ranks equals the reference files byte for byte."""
    from transformers import AutoTokenizer

    write_qwen25_tokenizer(tmp_path)
    ref = shared(QWEN_TOKENIZER)
    for name in ("vocab.json", "merges.txt"):
        assert (tmp_path / name).read_bytes() == (ref / name).read_bytes(), name
    ours, theirs = AutoTokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(ref)
    text = "你好，世界 hello world<|im_end|>"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"] == [108386, 3837, 99489, 23811, 1879, 151645]
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert ours.apply_chat_template(msgs, tokenize=False) == theirs.apply_chat_template(msgs, tokenize=False)
    assert (ours.eos_token, ours.pad_token, len(ours)) == ("<|im_end|>", "<|endoftext|>", 151665)


def test_synthetic_model_is_labelled_and_has_the_7b_shape(tiny_model):
    cfg = json.loads((tiny_model / "config.json").read_text())
    assert cfg["tuneledger_synthetic"]["arch"] == "tiny"
    assert "SYNTHETIC" in (tiny_model / "README.md").read_text()
    big = ARCHS["qwen2.5-7b"]
    assert (big["hidden_size"], big["intermediate_size"], big["num_hidden_layers"], big["num_attention_heads"],
            big["num_key_value_heads"], big["vocab_size"], big["rope_theta"], big["tie_word_embeddings"]) == \
        (3584, 18944, 28, 28, 4, 152064, 1e6, False)


def test_7b_lora_r64_has_the_field_reports_161m_trainable_parameters():
    """Count on the meta device: r=64 on every linear projection of Qwen2.5-7B is 161.5M (2.08%)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**ARCHS["qwen2.5-7b"]))
    model = get_peft_model(model, LoraConfig(r=64, lora_alpha=128, target_modules="all-linear", task_type="CAUSAL_LM"))
    trainable, total = model.get_nb_trainable_parameters()
    assert trainable == 161_480_704
    assert round(100 * trainable / total, 2) == 2.08
