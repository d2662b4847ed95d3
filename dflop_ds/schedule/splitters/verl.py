"""verl's sequence-length balancing (``get_seqlen_balanced_partitions``) as a splitter."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dflop_ds.schedule.lpt import differencing_assign, labels_to_buckets
from dflop_ds.schedule.splitters.base import SplitRequest, SplitResult, register_splitter


def verl_workload(seqlens: np.ndarray) -> np.ndarray:
    """verl's per-sequence workload estimate: ``24576 * s + s**2`` (linear plus attention)."""
    s = np.asarray(seqlens, dtype=float)
    return 24576.0 * s + s * s


def verl_karmarkar_karp(seqlens: np.ndarray, n_buckets: int, equal_size: bool = True) -> list[list[int]]:
    """verl's ``get_seqlen_balanced_partitions``: Karmarkar-Karp largest differencing on the
    workload of each sequence, with verl's equal-size start (``n_buckets`` sorted items at a
    time, one per partition). On one scalar column our vector differencing is exactly that
    algorithm, so it is reused; only the input (verl's workload, LLM length only) differs."""
    workload = verl_workload(seqlens)[:, None]
    return labels_to_buckets(differencing_assign(workload, n_buckets, equal_size=equal_size), n_buckets)


def both_ends_order(workloads: Sequence[float]) -> list[int]:
    """verl's pipeline order: the smallest microbatches at both ends, the largest in the middle."""
    ascending = np.argsort(np.asarray(workloads, dtype=float), kind="stable").tolist()
    return ascending[0::2] + ascending[1::2][::-1]


@register_splitter("verl")
class VerlSplitter:
    """verl: Karmarkar-Karp over ranks on LLM sequence length, then per rank into microbatches,
    ordered with the small ones at both ends of the pipeline."""

    name = "verl"

    def split(self, request: SplitRequest) -> SplitResult:
        """See :func:`verl_karmarkar_karp` and :func:`both_ends_order`."""
        seqlens = np.array([s.llm_tokens for s in request.row_shapes(self.name)], dtype=float)
        local = []
        for rank_positions in verl_karmarkar_karp(seqlens, request.dp):
            rows = np.asarray(rank_positions)
            micro = verl_karmarkar_karp(seqlens[rows], request.n_mb)
            work = [verl_workload(seqlens[rows[m]]).sum() for m in micro]
            local.append([[int(rows[p]) for p in micro[j]] for j in both_ends_order(work)])
        return request.result(local, self.name)
