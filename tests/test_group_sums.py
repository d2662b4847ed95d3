"""group_sums: every group's sum rounds as numpy's sum of that group's rows alone."""

from __future__ import annotations

import numpy as np
import pytest

from dflop_ds.schedule.group_sums import group_sums


def _own_sums(matrix: np.ndarray, groups) -> np.ndarray:
    return np.array([matrix[list(group)].sum(axis=0) for group in groups]).reshape(len(groups), matrix.shape[1])


@pytest.mark.parametrize("k", [1, 2, 3])
def test_sums_have_the_bytes_of_each_groups_own_sum(k: int) -> None:
    # sizes past 8 and 128 rows, where numpy's pairwise summation changes the order of additions
    rng = np.random.default_rng(k)
    matrix = rng.exponential(1.0, size=(3000, k)) * rng.choice([1e-3, 1.0, 1e3], size=(3000, 1))
    for sizes in ([1] * 5, [4] * 6, [8, 9, 9, 8], [24] * 7, [1, 7, 8, 9, 31, 64, 129, 200, 300], [0, 3, 0]):
        order = rng.permutation(matrix.shape[0])
        groups = [order[start - size : start].tolist() for start, size in zip(np.cumsum(sizes), sizes)]
        assert group_sums(matrix, groups).tobytes() == _own_sums(matrix, groups).tobytes()
        if len(set(sizes)) == 1:
            assert group_sums(matrix, np.array(groups)).tobytes() == _own_sums(matrix, groups).tobytes()


def test_a_sum_in_another_order_would_differ() -> None:
    # the property above is not vacuous: adding one row after another rounds otherwise here
    rng = np.random.default_rng(0)
    matrix = rng.exponential(1.0, size=(4000, 1))
    groups = [list(range(start, start + 40)) for start in range(0, 4000, 40)]
    one_by_one = np.zeros((len(groups), 1))
    for g, group in enumerate(groups):
        for row in group:
            one_by_one[g] += matrix[row]
    assert one_by_one.tobytes() != _own_sums(matrix, groups).tobytes()
    assert group_sums(matrix, groups).tobytes() == _own_sums(matrix, groups).tobytes()


def test_no_groups() -> None:
    assert group_sums(np.ones((3, 2)), []).shape == (0, 2)
