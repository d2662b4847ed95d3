"""Summed rows of groups of a cost matrix (a rank's buckets, a microbatch's samples), rounded
exactly as numpy rounds each group's own sum, in one gather per group size.

Floating-point sums depend on their order, and the splitters compare such sums (a rank's total
against the dealt ranks', a microbatch's cost in a split's result): summing each group on its own
(``matrix[group].sum(axis=0)``) fixes the order but costs a numpy call per group, the bulk of the
work at thousands of groups. Groups of equal size gathered into one ``(count, size, k)`` array and
summed along the middle axis make the same additions in the same order for every group
(tests/test_group_sums.py compares the bytes).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def group_sums(matrix: np.ndarray, groups: Sequence[Sequence[int]] | np.ndarray) -> np.ndarray:
    """``(len(groups), k)``: the summed rows of ``matrix`` (``(n, k)``) of each group (row
    indices), each as ``matrix[group].sum(axis=0)`` rounds it."""
    if isinstance(groups, np.ndarray) and groups.ndim == 2:  # equal sizes already
        return matrix[groups].sum(axis=1)
    sizes = np.fromiter((len(group) for group in groups), dtype=np.int64, count=len(groups))
    sums = np.zeros((len(groups), matrix.shape[1]))
    for size in np.unique(sizes).tolist():
        which = np.flatnonzero(sizes == size)
        rows = np.array([groups[i] for i in which.tolist()], dtype=np.int64).reshape(which.size, size)
        sums[which] = matrix[rows].sum(axis=1)
    return sums
