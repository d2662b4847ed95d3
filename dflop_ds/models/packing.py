"""Packed microbatches: every sample of a microbatch in one row, attention kept inside each sample.

A packed token tensor is ``[1, N, ...]`` with ``N = seq_lens.sum()``: sample ``i`` occupies
``seq_lens[i]`` consecutive positions, its positions restart at 0, and its tokens attend only
its own earlier tokens. The layout is told apart from the padded one by its shape alone
(``rows != samples``; a one-sample microbatch is the same in both layouts), so no flag travels
with the tensors and the pipeline's float-first, int-after contract is unchanged.

Attention runs one ``scaled_dot_product_attention`` per sample (causal), so it costs the sum of
the squared lengths. Measured on this 2-core CPU (torch 2.13, 4 heads of 32, forward+backward,
medians, load average 2.6; ``benchmarks/bench_packed_attention.py``): for 8 samples of 40-330
tokens, padded SDPA with a mask 13.4 ms, a dense block mask over the packed row 15.4 ms (it
computes ``N^2``), one SDPA per sample 4.6 ms; for 6 samples of 30-640 tokens 26.0, 24.5 and
8.3 ms. Nested (jagged) tensors refuse causal SDPA and ``flex_attention`` has no backward on CPU.
The whole tiny model, forward+backward on those microbatches: padded 135 and 232 ms, packed 56
and 83 ms.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def is_packed(rows: int, seq_lens: torch.Tensor) -> bool:
    """True when ``rows`` token rows hold ``seq_lens.numel()`` samples packed (fewer rows than samples)."""
    return rows != seq_lens.numel()


def check_packed(rows: int, length: int, seq_lens: torch.Tensor, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` unless ``[rows, length]`` is one row holding every sample."""
    total = int(seq_lens.sum().item())
    if rows != 1 or length != total:
        raise ValueError(
            f"{where}: a packed microbatch is one row of sum(seq_lens)={total} tokens, "
            f"got {rows} row(s) of {length} for {seq_lens.numel()} samples"
        )


def segment_positions(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For runs of ``lengths[i]`` consecutive items: each item's run and its offset within the run."""
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    return segment, torch.arange(segment.numel(), device=lengths.device) - starts[segment]


def segment_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: list[int],
    *,
    scale: float | None = None,
    window: int | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention inside each segment of a packed ``[1, H, N, Dh]`` query and ``[1, Hkv, N, Dh]``
    key/value (grouped-query attention when ``Hkv < H``), one SDPA per segment.

    ``scale`` is SDPA's (default ``Dh**-0.5``); with ``window`` a query sees only the keys less than
    ``window`` positions back (a sliding window, as HF's masks count it); ``dropout`` is SDPA's.
    """
    gqa = k.shape[1] != q.shape[1]
    outputs = []
    for qs, ks, vs in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2)):
        length, mask = qs.shape[2], None
        if window is not None and length > window:
            distance = torch.arange(length, device=q.device)[:, None] - torch.arange(length, device=q.device)
            mask = (distance >= 0) & (distance < window)
        out = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=mask is None, dropout_p=dropout, scale=scale, enable_gqa=gqa
        )
        outputs.append(out)
    return torch.cat(outputs, dim=2)


def join_rows(rows: Sequence[torch.Tensor], fill: int, packed: bool) -> torch.Tensor:
    """The 1-D ``rows`` of a microbatch as one tensor: one packed row ``[1, sum(lengths)]``, or
    ``[len(rows), longest]`` right-padded with ``fill`` (same dtype as the rows)."""
    if packed:
        return torch.cat(list(rows))[None, :]
    out = torch.full((len(rows), max(row.numel() for row in rows)), fill, dtype=rows[0].dtype)
    for b, row in enumerate(rows):
        out[b, : row.numel()] = row
    return out


def token_positions(seq_lens: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    """``[rows, length]`` position ids of a microbatch's tokens: ``0..len-1`` of every sample, on
    right-padded rows (padding continues counting) or restarting at each sample of a packed row."""
    if is_packed(rows, seq_lens):
        check_packed(rows, length, seq_lens, "token_positions")
        return segment_positions(seq_lens)[1][None, :]
    return torch.arange(length, device=seq_lens.device)[None, :].expand(rows, length)
