"""Preset D packs whole samples padding-free; it must train on exactly what the padded path does."""

import torch
import torch.nn.functional as F

from tuneledger.config_load import load_config
from tuneledger.data import encode
from tuneledger.rows import make_collator


def per_sample_losses(logits, labels, spans):
    out = []
    for s, e in spans:
        out.append(F.cross_entropy(logits[s:e - 1].float(), labels[s + 1:e], ignore_index=-100).item())
    return out


def test_packed_equals_padded_per_sample(tiny_model, qwen_tokenizer):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa").eval()
    # As in training (model.load_model sets it): with a KV cache transformers skips packed-sequence detection.
    model.config.use_cache = False
    convs = [
        [{"role": "user", "content": "short"}, {"role": "assistant", "content": "yes"}],
        [{"role": "user", "content": "a longer question " * 12}, {"role": "assistant", "content": "a longer answer " * 9}],
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "again"},
         {"role": "assistant", "content": "twice as long"}],
    ]
    feats = [{k: v for k, v in encode(c, qwen_tokenizer, 4096).items() if k in ("input_ids", "labels")} for c in convs]
    lengths = [len(f["input_ids"]) for f in feats]
    assert len(set(lengths)) == 3  # really different lengths, so padding is exercised

    base = {"model_name_or_path": str(tiny_model), "dataset": ["x.json"]}
    padded = make_collator(load_config(None, {**base, "packing": False}), qwen_tokenizer)([dict(f) for f in feats])
    packed = make_collator(load_config(None, {**base, "packing": True}), qwen_tokenizer)([dict(f) for f in feats])
    assert "attention_mask" not in packed and packed["input_ids"].shape == (1, sum(lengths))
    starts = (packed["position_ids"][0] == 0).nonzero().flatten().tolist()
    assert starts == [0, lengths[0], lengths[0] + lengths[1]]

    with torch.no_grad():
        lp = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits
        lk = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits[0]
    pad_losses = [per_sample_losses(lp[i], padded["labels"][i], [(0, n)])[0] for i, n in enumerate(lengths)]
    spans = [(s, s + n) for s, n in zip(starts, lengths)]
    pack_losses = per_sample_losses(lk, packed["labels"][0], spans)
    assert torch.allclose(torch.tensor(pack_losses), torch.tensor(pad_losses), atol=1e-5, rtol=0), (pack_losses, pad_losses)
    # And the loss the Trainer sees: same supervised tokens, same mean.
    assert (packed["labels"] != -100).sum() == (padded["labels"] != -100).sum()
    mean_pad = model(**padded).loss
    mean_pack = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], labels=packed["labels"]).loss
    assert torch.allclose(mean_pad, mean_pack, atol=1e-5)
