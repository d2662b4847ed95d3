"""LLaVA's ``group_by_modality_length`` sampler, re-implemented from its description, as a splitter.

Written from LLaVA's published training code's behaviour; not tuned beyond what it does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dflop_ds.schedule.splitters.base import SplitRequest, SplitResult, register_splitter

Buckets = list[list[int]]


def _even_chunks(indices: Sequence[int], lengths: np.ndarray, n_chunks: int) -> Buckets:
    """LLaVA's chunking of one length-sorted megabatch: each index goes to the chunk with the
    smallest summed length that is not yet full; a megabatch that does not divide evenly is
    dealt round-robin instead."""
    if len(indices) % n_chunks:
        return [list(indices[i::n_chunks]) for i in range(n_chunks)]
    per_chunk = len(indices) // n_chunks
    chunks: Buckets = [[] for _ in range(n_chunks)]
    sums = [0.0] * n_chunks
    for index in indices:
        target = sums.index(min(sums))
        chunks[target].append(int(index))
        sums[target] += float(lengths[index])
        if len(chunks[target]) == per_chunk:
            sums[target] = float("inf")
    return chunks


def _length_grouped(
    indices: np.ndarray, lengths: np.ndarray, megabatch: int, n_chunks: int, rng: np.random.Generator
) -> list[int]:
    """Shuffle, cut into megabatches, sort each by decreasing length, chunk evenly, flatten."""
    shuffled = indices[rng.permutation(indices.size)]
    flat: list[int] = []
    for start in range(0, shuffled.size, megabatch):
        group = sorted(shuffled[start : start + megabatch].tolist(), key=lambda i: -lengths[i])
        for chunk in _even_chunks(group, lengths, n_chunks):
            flat.extend(chunk)
    return flat


def llava_modality_grouped(
    lengths: np.ndarray, is_multimodal: np.ndarray, n_buckets: int, world_size: int = 8, seed: int = 0
) -> Buckets:
    """LLaVA's ``group_by_modality_length`` sampler applied to one global batch.

    Image/video samples and text-only samples are grouped separately: each modality is
    shuffled and cut into megabatches of ``world_size * per_bucket`` samples, each megabatch is
    sorted by length and dealt greedily to the ``world_size`` chunk with the smallest summed
    length. Full megabatches of both modalities are shuffled together; the two incomplete
    leftovers are concatenated, in index order, at the end. The resulting sample order is then
    cut into consecutive buckets of ``n / n_buckets`` samples, as the trainer's data loader does.
    ``lengths`` are what LLaVA measures: the text length (it does not count image tokens).
    """
    lengths = np.asarray(lengths, dtype=float)
    n = lengths.size
    per_bucket = max(n // n_buckets, 1)
    chunks = min(world_size, n_buckets)
    megabatch = chunks * per_bucket
    rng = np.random.default_rng(seed)
    mm = np.flatnonzero(np.asarray(is_multimodal, dtype=bool))
    text = np.flatnonzero(~np.asarray(is_multimodal, dtype=bool))
    full: list[list[int]] = []
    leftover: list[int] = []
    for group in (mm, text):
        order = _length_grouped(group, lengths, megabatch, chunks, rng)
        cut = len(order) - len(order) % megabatch
        full.extend(order[i : i + megabatch] for i in range(0, cut, megabatch))
        leftover.extend(order[cut:])
    flat = [i for k in rng.permutation(len(full)) for i in full[k]] + sorted(leftover)
    return [chunk.tolist() for chunk in np.array_split(np.array(flat, dtype=np.int64), n_buckets)]


@register_splitter("llava")
class LlavaSplitter:
    """LLaVA's modality-grouped length sampler over the batch, lengths as LLaVA measures them
    (text tokens); bucket ``b`` goes to rank ``b // n_mb`` (consecutive buckets per rank, as a
    sequential loader deals them)."""

    name = "llava"

    def split(self, request: SplitRequest) -> SplitResult:
        """See :func:`llava_modality_grouped`; the request's seed seeds its shuffles."""
        shapes = request.row_shapes(self.name)
        lengths = np.array([s.text_tokens for s in shapes], dtype=float)
        multimodal = np.array([s.encoder_tiles > 0 for s in shapes])
        n_mb, dp = request.n_mb, request.dp
        buckets = llava_modality_grouped(lengths, multimodal, n_mb * dp, world_size=dp, seed=request.seed)
        return request.result([buckets[r * n_mb : (r + 1) * n_mb] for r in range(dp)], self.name)
