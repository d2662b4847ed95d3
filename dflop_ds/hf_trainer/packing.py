"""Padding-free microbatches through a user's HF model on any device: attention inside each sample.

A padding-free collator (``transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)``,
TRL's ``padding_free=True``) joins a microbatch into one row and names the samples' bounds
(``cu_seq_lens_q/k``). Flash attention reads them on GPUs that have it; elsewhere HF's ``sdpa``
masks a full ``N x N`` product (or, with a cache or no per-sample ``position_ids``, attends across
samples). :func:`use_segment_attention` makes the text model run one causal attention per sample
instead (:func:`dflop_ds.models.hf.packed.segment_attention`), so attention costs the sum of the
squared sample lengths and the loss is the padded batch's.
"""

from __future__ import annotations

from typing import Any

from dflop_ds.models.hf.packed import PACKED_ATTENTION, register_segment_attention


def use_segment_attention(model: Any) -> str:
    """Switch ``model``'s text attention to per-sample attention for padding-free training
    microbatches (every batch must then carry ``cu_seq_lens_q`` and no ``attention_mask``; a
    padded one is refused by name), and its cache off; a flash-attention implementation is kept
    (it reads the same bounds). Returns the text model's attention implementation now in use."""
    from transformers.utils.generic import is_flash_attention_requested

    text_config = model.config.get_text_config()
    text_config.use_cache = False  # a cache would make HF build a mask across the samples
    if not is_flash_attention_requested(text_config):
        register_segment_attention()
        text_config._attn_implementation_internal = PACKED_ATTENTION
    return str(text_config._attn_implementation)


__all__ = ["use_segment_attention"]
