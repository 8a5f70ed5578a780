"""drop_padding_mask (trainer.padding_mask_lever): a right-padded micro-batch trained without its
attention mask gives every real token the same logits, so the same loss, for each attention
backend present; the real-token count still comes from the mask; left padding keeps it."""

from __future__ import annotations

import types

import pytest
import torch

from tuneledger.config_load import load_config
from tuneledger.trainer import make_collator, padding_mask_lever


def _cfg(**over):
    return load_config(None, {"model_name_or_path": "m", "dataset": ["x.json"], **over})


def _batch(tokenizer, lengths=(9, 23, 4)):
    g = torch.Generator().manual_seed(4)
    feats = []
    for n in lengths:
        ids = torch.randint(10, 1000, (n,), generator=g).tolist()
        feats.append({"input_ids": ids, "labels": [-100] * 2 + ids[2:]})
    return make_collator(_cfg(), tokenizer)(feats)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_real_tokens_see_the_same_without_the_padding_mask(tiny_model, qwen_tokenizer, attn):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation=attn).eval()
    b = _batch(qwen_tokenizer)
    mask = b["attention_mask"].bool()
    assert not mask.all() and (mask[:, :-1] >= mask[:, 1:]).all()  # padded, on the right
    with torch.no_grad():
        masked = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"])
        bare = m(input_ids=b["input_ids"], labels=b["labels"])
    assert torch.allclose(masked.logits[mask], bare.logits[mask], atol=1e-5, rtol=1e-4)
    assert abs(masked.loss.item() - bare.loss.item()) < 1e-5
    # The control: a real token's logits do change when the pads sit on the left without a mask.
    left = torch.cat([b["input_ids"][0, mask[0]].new_full(((~mask[0]).sum(),), 5), b["input_ids"][0, mask[0]]])[None]
    with torch.no_grad():
        shifted = m(input_ids=left).logits[0, -1]
    assert not torch.allclose(shifted, masked.logits[0, mask[0]][-1], atol=1e-3)


def test_the_lever_says_when_it_runs(qwen_tokenizer):
    assert padding_mask_lever(_cfg(drop_padding_mask=False), qwen_tokenizer) == (False, "off")
    assert padding_mask_lever(_cfg(), qwen_tokenizer) == (True, "on (right padding: the causal mask alone, no padding mask, no packed-sample probe)")
    assert padding_mask_lever(_cfg(use_unsloth=True), qwen_tokenizer)[1].startswith("off (use_unsloth")
    assert padding_mask_lever(_cfg(use_unsloth=True, drop_padding_mask=True), qwen_tokenizer)[0] is True
    assert padding_mask_lever(_cfg(drop_padding_mask=True, packing=True), qwen_tokenizer)[1].startswith("off (packed")
    on, line = padding_mask_lever(_cfg(drop_padding_mask=True), qwen_tokenizer)
    assert on and line.startswith("on (right padding")
    left = types.SimpleNamespace(padding_side="left")
    assert padding_mask_lever(_cfg(drop_padding_mask=True), left) == (False, "off (padding on the left: the mask is needed)")


def test_training_step_counts_real_tokens_and_drops_the_mask(tiny_model, qwen_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, TrainingArguments

    from tuneledger.trainer import LedgerTrainer

    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    seen = []
    real_forward = m.forward

    def forward(*a, **kw):
        seen.append("attention_mask" in kw)
        return real_forward(*a, **kw)

    m.forward = forward
    b = _batch(qwen_tokenizer)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=3)
    for drop in (False, True):
        t = LedgerTrainer(model=m, args=args, n_params=1, drop_padding_mask=drop)
        t.current_gradient_accumulation_steps = 1  # what train()'s loop sets before its first step
        t.training_step(m, dict(b))
        assert t.tokens.item() == b["attention_mask"].sum().item()  # real tokens, not the padded row length
    assert seen == [True, False]


def test_without_the_mask_the_packed_sample_probe_answers_without_looking(tiny_model, qwen_tokenizer, monkeypatch):
    """trainer.unpacked_rows: padded rows without their mask make transformers probe position_ids
    for packed samples (a host sync per micro-batch on a GPU). Inside the block the probe answers
    None without computing, the logits are those of the masked batch, and outside it (a packed
    row elsewhere in the process) the probe runs as before."""
    import transformers.masking_utils as mu
    from transformers import AutoModelForCausalLM

    from tuneledger.trainer import unpacked_rows

    calls = []
    real = mu.find_packed_sequence_indices
    monkeypatch.setattr(mu, "find_packed_sequence_indices", lambda p: calls.append(p) or real(p))
    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa").eval()
    m.config.use_cache = False  # as in training: with a cache transformers does not probe
    b = _batch(qwen_tokenizer)
    mask = b["attention_mask"].bool()
    with torch.no_grad():
        masked = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        m(input_ids=b["input_ids"])
        assert len(calls) == 1  # without a mask, transformers probes: once per forward
        with unpacked_rows():
            bare = m(input_ids=b["input_ids"]).logits
        assert len(calls) == 1  # not probed inside the block
        packed = torch.tensor([[0, 1, 2, 0, 1]])
        assert mu.find_packed_sequence_indices(packed) is not None and len(calls) == 2  # outside: probed again
    assert torch.allclose(masked[mask], bare[mask], atol=1e-5, rtol=1e-4)
