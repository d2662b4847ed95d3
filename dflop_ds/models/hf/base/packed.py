"""Packed microbatches through unmodified HF decoder layers: attention inside each sample only.

A packed microbatch (:mod:`dflop_ds.models.packing`) reaches an HF decoder layer as one row
``hidden [1, N, D]`` with ``N = seq_lens.sum()``. HF attention modules pick their attention
function by name from ``transformers.AttentionInterface`` (``config._attn_implementation``) and
pass it the keyword arguments the decoder layer received, so the layer runs unchanged:

* with a flash-attention implementation (GPUs with ``flash-attn`` installed) the layer gets
  ``cu_seq_lens_q/k`` and ``max_length_q/k``, and transformers' own variable-length path keeps
  attention inside each sample;
* otherwise (``sdpa``, ``eager``, ...) the text config names :data:`PACKED_ATTENTION` for the
  duration of the call (:func:`packed_attention`): :func:`segment_attention` runs one causal
  SDPA per sample (:func:`dflop_ds.models.packing.segment_causal_attention`), so attention costs
  the sum of the squared sample lengths, not ``N**2`` as HF's block-diagonal mask over SDPA would.

Measured (``benchmarks/bench_hf_packing.py``, one thread, load average about 8 on the 2-core CPU
machine, medians of interleaved rounds): forward+backward of the tiny HF LLaVA (Llama text) on 8
samples of 53-344 tokens, 2 with an image, padded 372.6 ms, packed 126.3 ms; Qwen2 text 354.3 and
119.5 ms; tiny Qwen2-VL 436.9 and 164.2 ms. Hence packing is the default for HF models.

transformers is imported only when a packed microbatch runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from dflop_ds.models.packing import segment_causal_attention

#: the name under which :func:`segment_attention` is registered in ``transformers.AttentionInterface``
PACKED_ATTENTION = "dflop_segments"


def segment_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """An ``AttentionInterface`` function: causal attention within each sample of a packed row.

    ``query [1, H, N, Dh]``, ``key``/``value [1, Hkv, N, Dh]``; the samples' bounds are
    ``cu_seq_lens_q`` (``[B + 1]``, from :func:`packed_kwargs`); ``sliding_window`` as the HF
    module passes it. Returns ``(output [1, N, H, Dh], None)`` as HF's own functions do.
    """
    if cu_seq_lens_q is None or attention_mask is not None:
        raise ValueError(
            f"{PACKED_ATTENTION} attention runs packed microbatches only (cu_seq_lens_q and no mask); "
            f"{type(module).__name__} got {'a mask' if attention_mask is not None else 'no cu_seq_lens_q'}"
        )
    lengths = torch.diff(cu_seq_lens_q).tolist()
    out = segment_causal_attention(query, key, value, lengths, scale=scaling, window=sliding_window, dropout=dropout)
    return out.transpose(1, 2).contiguous(), None


def packed_kwargs(seq_lens: torch.Tensor) -> dict[str, Any]:
    """Keyword arguments telling an HF decoder layer where the samples of a packed row start and end
    (the names transformers' flash-attention path reads)."""
    cu = torch.nn.functional.pad(torch.cumsum(seq_lens, 0), (1, 0)).to(torch.int32)
    longest = int(seq_lens.max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def register_segment_attention() -> None:
    """Register :func:`segment_attention` as :data:`PACKED_ATTENTION` in ``transformers.AttentionInterface``
    (once); HF then builds no mask for it (it has no mask function)."""
    from transformers import AttentionInterface

    if PACKED_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(PACKED_ATTENTION, segment_attention)


@contextmanager
def packed_attention(text_config: Any) -> Iterator[None]:
    """Within the block, HF attention modules of ``text_config`` attend within each packed sample:
    a flash-attention implementation is kept (it reads :func:`packed_kwargs`), any other is
    replaced by :data:`PACKED_ATTENTION` and restored on exit."""
    from transformers.utils.generic import is_flash_attention_requested

    if is_flash_attention_requested(text_config):
        yield
        return
    register_segment_attention()
    previous = text_config._attn_implementation_internal
    text_config._attn_implementation_internal = PACKED_ATTENTION
    try:
        yield
    finally:
        text_config._attn_implementation_internal = previous


__all__ = ["PACKED_ATTENTION", "packed_attention", "packed_kwargs", "register_segment_attention", "segment_attention"]
