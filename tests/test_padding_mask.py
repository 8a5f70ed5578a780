"""drop_padding_mask (trainer.padding_mask_lever): a right-padded micro-batch trained without its
attention mask gives every real token the same logits, so the same loss, for each attention
backend present; the real-token count still comes from the mask; left padding keeps it."""

from __future__ import annotations

import types

import pytest
import torch

from tuneledger.config_load import load_config
from tuneledger.rows import make_collator, padding_mask_lever


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


def test_training_step_answers_the_probe_for_the_packing_collator_s_rows(tiny_model, qwen_tokenizer, tmp_path, monkeypatch):
    """A packed micro-batch (make_collator with packing: one row, position_ids, no mask) trains
    inside known_rows("packed"): transformers' probe is never called, every token is counted."""
    import transformers.masking_utils as mu
    from transformers import AutoModelForCausalLM, TrainingArguments

    from tuneledger.trainer import LedgerTrainer

    calls = []
    real = mu.find_packed_sequence_indices
    monkeypatch.setattr(mu, "find_packed_sequence_indices", lambda p: calls.append(p) or real(p))
    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa")
    m.config.use_cache = False
    feats = [{"input_ids": qwen_tokenizer(t)["input_ids"]} for t in ("one two three", "four five", "six")]
    feats = [{**f, "labels": f["input_ids"]} for f in feats]
    b = make_collator(_cfg(packing=True), qwen_tokenizer)(feats)
    assert "attention_mask" not in b and "position_ids" in b
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=3)
    t = LedgerTrainer(model=m, args=args, n_params=1, drop_padding_mask=False)
    t.current_gradient_accumulation_steps = 1
    loss = t.training_step(m, dict(b))
    assert torch.isfinite(loss) and calls == [] and t.tokens.item() == b["input_ids"].numel()
    m(input_ids=b["input_ids"], position_ids=b["position_ids"])
    assert len(calls) == 1  # outside a training step the probe runs as before


def test_without_the_mask_the_packed_sample_probe_answers_without_looking(tiny_model, qwen_tokenizer, monkeypatch):
    """trainer.known_rows("padded"): padded rows without their mask make transformers probe position_ids
    for packed samples (a host sync per micro-batch on a GPU). Inside the block the probe answers
    None without computing, the logits are those of the masked batch, and outside it (a packed
    row elsewhere in the process) the probe runs as before."""
    import transformers.masking_utils as mu
    from transformers import AutoModelForCausalLM

    from tuneledger.rows import known_rows

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
        with known_rows("padded"):
            bare = m(input_ids=b["input_ids"]).logits
        assert len(calls) == 1  # not probed inside the block
        packed = torch.tensor([[0, 1, 2, 0, 1]])
        assert mu.find_packed_sequence_indices(packed) is not None and len(calls) == 2  # outside: probed again
    assert torch.allclose(masked[mask], bare[mask], atol=1e-5, rtol=1e-4)


def test_packed_rows_get_the_probe_s_answer_without_its_check(tiny_model, monkeypatch):
    """trainer.known_rows("packed"): the packing collator's rows (no mask, position_ids restarting
    per sample) get transformers' own sample indices without its `.all()` check (a host sync per
    micro-batch on a GPU), and the logits equal the probed forward's, for SDPA and eager; a row of
    one sample gets zeros, which transformers treats as None (same logits). A kind that is neither
    is a ValueError."""
    import transformers.masking_utils as mu
    from transformers import AutoModelForCausalLM

    from tuneledger.rows import known_rows

    calls = []
    real = mu.find_packed_sequence_indices
    monkeypatch.setattr(mu, "find_packed_sequence_indices", lambda p: calls.append(p) or real(p))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13]])
    rows = {"packed": torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2]]), "one sample": torch.arange(9)[None]}
    for attn in ("sdpa", "eager"):
        m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation=attn).eval()
        m.config.use_cache = False
        for name, pos in rows.items():
            with torch.no_grad():
                probed = m(input_ids=ids, position_ids=pos).logits
                n = len(calls)
                with known_rows("packed"):
                    assert mu.find_packed_sequence_indices(pos).tolist() == (
                        [[0, 0, 0, 0, 1, 1, 2, 2, 2]] if name == "packed" else [[0] * 9])
                    known = m(input_ids=ids, position_ids=pos).logits
                assert len(calls) == n, "probed inside the block"
            assert torch.allclose(probed, known, atol=1e-5, rtol=1e-4), (attn, name)
    # The packed row's samples really are apart: the second sample's logits equal its own forward's.
    with torch.no_grad(), known_rows("packed"):
        alone = m(input_ids=ids[:, 4:6], position_ids=torch.tensor([[0, 1]])).logits
        assert torch.allclose(m(input_ids=ids, position_ids=rows["packed"]).logits[:, 4:6], alone, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="'padding'"):
        with known_rows("padding"):
            pass
    with known_rows("padded"):  # nested: the outer kind holds again after the inner block
        with known_rows("packed"):
            assert mu.find_packed_sequence_indices(rows["packed"]) is not None
        assert mu.find_packed_sequence_indices(rows["packed"]) is None
    n = len(calls)
    mu.find_packed_sequence_indices(rows["packed"])
    assert len(calls) == n + 1  # outside every block: transformers' own probe again
