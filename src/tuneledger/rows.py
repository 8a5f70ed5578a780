"""The micro-batch's rows as the trainer builds them, and what it therefore knows about them: the
collator (padded, or packed without cross-sample attention), the padding-mask lever, and
`known_rows`, which answers transformers' packed-sample probe without its host sync.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from tuneledger.config import JobConfig

_ROWS = [None]  # inside known_rows(): "padded" or "packed", what the probe would find


@contextlib.contextmanager
def known_rows(kind: str):
    """Rows whose layout the trainer knows, `kind` "padded" (drop_padding_mask: padded rows
    without their mask) or "packed" (the packing collator: samples concatenated, position_ids
    restarting at 0 per sample, no mask). Without a mask transformers probes position_ids for
    packed samples (masking_utils.find_packed_sequence_indices) with `if (...).all()`, a host sync
    per micro-batch (aten::is_nonzero, 8 a preset C step on an H100:
    bench/results/h100-2026-12-06d-call1). Within this block the probe answers without that
    sync: None for padded rows (never packed), and for packed rows the sample index of each token,
    which it computes without the check (a row of one sample gets all zeros, which transformers
    documents as the same as None). A transformers without the probe: nothing changes.
    Raises ValueError for another `kind`."""
    import transformers.masking_utils as mu

    if kind not in ("padded", "packed"):
        raise ValueError(f"known_rows: kind {kind!r} is not 'padded' or 'packed'")
    probe = getattr(mu, "find_packed_sequence_indices", None)
    if probe is not None and not getattr(probe, "_tuneledger", False):
        def known_layout(position_ids, *a, **kw):
            if _ROWS[0] == "padded":
                return None
            if _ROWS[0] == "packed":  # transformers' own computation, less its `.all()` check
                first = position_ids[:, :1] - 1
                return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
            return probe(position_ids, *a, **kw)

        known_layout._tuneledger = True
        mu.find_packed_sequence_indices = known_layout
    outer, _ROWS[0] = _ROWS[0], kind
    try:
        yield
    finally:
        _ROWS[0] = outer  # a nested block gives the outer one its kind back


def padding_mask_lever(cfg: JobConfig, tokenizer: Any) -> tuple[bool, str]:
    """drop_padding_mask: whether training steps drop the padded micro-batch's attention mask, and
    the ledger's line. Exact with right padding: a real token attends only to earlier positions,
    all of them real, so the causal mask alone gives every supervised token (and the loss) the
    same attention. Without a padding mask transformers skips its all-ones check (a host sync), its
    packed-sample probe is answered without a sync (known_rows), and SDPA runs is_causal, its
    flash kernel, instead of the masked memory-efficient one. Pad
    positions then attend to the tokens before them; their outputs are never supervised (label -100)."""
    if cfg.drop_padding_mask is False:
        return False, "off"
    if cfg.drop_padding_mask is None and cfg.use_unsloth:
        # Unsloth's backend as Unsloth runs it (make bench compares it so); true drops the mask there too.
        return False, "off (use_unsloth: the micro-batch goes to Unsloth with its mask, as Unsloth pads it)"
    if cfg.packing:
        return False, "off (packed rows carry no padding mask)"
    if getattr(tokenizer, "padding_side", "right") != "right":
        return False, f"off (padding on the {tokenizer.padding_side}: the mask is needed)"
    return True, "on (right padding: the causal mask alone, no padding mask, no packed-sample probe)"


def make_collator(cfg: JobConfig, tokenizer: Any, attention: str = "sdpa") -> Any:
    """Padded micro-batches (DataCollatorForSeq2Seq), or padding-free packing of whole samples.

    Packing (DataCollatorWithFlattening) concatenates the micro-batch into one row with
    `position_ids` restarting at 0 per sample and no attention mask, so no sample attends to
    another: varlen kernels (`attention` flash_attention_2 or speed.VARLEN) take the sample bounds
    from the collator (`cu_seq_lens_q`, `max_length_q`: no device sync to find them); SDPA and
    flex derive them from position_ids.
    """
    if cfg.packing:
        from transformers import DataCollatorWithFlattening

        from tuneledger.speed import VARLEN

        return DataCollatorWithFlattening(return_position_ids=True, separator_id=-100,
                                          return_flash_attn_kwargs=attention in ("flash_attention_2", VARLEN))
    from transformers import DataCollatorForSeq2Seq

    from tuneledger.compiled import pad_multiple

    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100, pad_to_multiple_of=pad_multiple())
