"""Valid lower bounds on the makespan of splitting items into buckets.

The makespan of a split is the largest summed cost over every bucket and every cost column.
Every bound here holds for *any* split into ``n_buckets`` buckets, so ``makespan / bound`` is a
certified upper bound on how far a split is from the optimum.
"""

from __future__ import annotations

import numpy as np


def as_cost_matrix(costs: np.ndarray) -> np.ndarray:
    """``costs`` as a float ``(n, k)`` matrix (a 1-D array is one column); rejects bad values."""
    matrix = np.asarray(costs, dtype=float)
    if matrix.ndim == 1:
        matrix = matrix[:, None]
    if matrix.ndim != 2 or matrix.shape[1] < 1:
        raise ValueError(f"costs must be a 1-D array or an (n, k) matrix, got shape {matrix.shape}")
    bad = np.flatnonzero(~np.isfinite(matrix).all(axis=1) | (matrix < 0).any(axis=1))
    if bad.size:
        raise ValueError(f"item {int(bad[0])} has a negative or non-finite cost {matrix[bad[0]].tolist()}")
    return matrix


def pigeonhole_bound(values: np.ndarray, n_buckets: int) -> float:
    """Best bound on one scalar column from the pigeonhole principle.

    Among the ``t * n_buckets + 1`` largest items some bucket holds ``t + 1`` of them, so the
    optimum is at least the sum of the ``t + 1`` smallest of those, for every ``t >= 0``
    (``t = 0`` is the largest item).
    """
    ordered = np.sort(np.asarray(values, dtype=float))[::-1]
    n = ordered.size
    if n == 0:
        return 0.0
    prefix = np.concatenate([[0.0], np.cumsum(ordered)])
    t = np.arange(0, (n - 1) // n_buckets + 1)
    stop = t * n_buckets + 1  # exclusive end: items 0 .. t*m are the t*m+1 largest
    start = stop - (t + 1)
    return float((prefix[stop] - prefix[start]).max())


def lower_bound(costs: np.ndarray, n_buckets: int) -> float:
    """A valid lower bound on the makespan of any split of ``costs`` into ``n_buckets`` buckets.

    The maximum of: each column's sum over ``n_buckets`` (averaging), the pigeonhole bound of
    each column, and the pigeonhole bound of the per-item mean over columns (a bucket's maximum
    over columns is at least its mean over columns).
    """
    if n_buckets < 1:
        raise ValueError(f"n_buckets must be >= 1, got {n_buckets}")
    matrix = as_cost_matrix(costs)
    if matrix.shape[0] == 0:
        return 0.0
    bound = float(matrix.sum(axis=0).max() / n_buckets)
    columns = [matrix[:, c] for c in range(matrix.shape[1])]
    if matrix.shape[1] > 1:
        columns.append(matrix.mean(axis=1))
    for column in columns:
        bound = max(bound, pigeonhole_bound(column, n_buckets))
    return bound
