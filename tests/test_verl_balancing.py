"""The ``verl`` splitter cuts a batch as verl's trainer and workers do: ranks by equal-count
Karmarkar-Karp on the workload, then each rank's dynamic microbatches, on fixed inputs worked by
hand and splits recorded from verl's own ``seqlen_balancing.py`` (volcengine/verl b178a3c)."""

from __future__ import annotations

import numpy as np
import pytest

from dflop_ds.schedule.splitters import SplitRequest, make_splitter
from dflop_ds.schedule.splitters.verl import (
    dynamic_microbatches,
    rank_shares,
    verl_karmarkar_karp,
    verl_split,
    verl_workload,
)
from dflop_ds.shapes import SampleShape


def test_workload_is_linear_plus_attention_in_exact_integers() -> None:
    assert verl_workload([0, 1, 4096]) == [0, 24577, 24576 * 4096 + 4096**2]


def test_equal_size_karmarkar_karp_breaks_ties_as_verl() -> None:
    # ascending (3, 5) and (7, 9) start two states of spread 2; the one with the larger top set
    # (9) goes first: 9 + 3 and 7 + 5, both 12; equal sums and sizes compare by items, so
    # {(3, 7), (0, 5)} ranks above {(1, 9), (2, 3)}
    assert verl_karmarkar_karp([5, 9, 3, 7], 2) == [[0, 3], [1, 2]]


def test_dynamic_microbatches_put_the_small_ones_at_both_ends() -> None:
    # one value per microbatch: largest first [3, 2, 1, 0], then [::2][::-1] + [1::2]
    assert dynamic_microbatches([10, 20, 30, 40], 4) == [[1], [3], [2], [0]]


def test_a_rank_share_is_laid_out_small_large_small() -> None:
    shares = rank_shares([1, 2, 3, 4, 5, 6, 7, 8], 1)
    assert shares == [[0, 2, 4, 6, 7, 5, 3, 1]]


# (sequence lengths, dp, n_mb) -> ranks[r][j] from verl's get_seqlen_balanced_partitions, its
# _balance_batch rank order and its rearrange_micro_batches (use_dynamic_bsz_balance)
VERL_SPLITS = [
    (([5, 9, 3, 7, 1, 8, 2, 6], 2, 2), [[[7, 0], [6, 5]], [[4, 1], [3, 2]]]),
    (
        ([100, 300, 200, 400, 50, 250, 150, 350, 75, 125, 175, 225], 3, 2),
        [[[5, 10], [0, 1]], [[8, 7], [11, 6]], [[3], [4, 2, 9]]],
    ),
    (
        ([64, 64, 128, 128, 256, 256, 64, 1000, 64, 128, 256, 64], 2, 3),
        [[[4], [7], [0, 11, 3, 6]], [[10], [1, 5], [2, 9, 8]]],
    ),
]


@pytest.mark.parametrize(("case", "expected"), VERL_SPLITS)
def test_splits_match_verls_own(case: tuple[list[int], int, int], expected: list) -> None:
    assert verl_split(*case) == expected


def test_the_splitter_reads_the_expanded_llm_length_and_keeps_n_mb_on_every_rank() -> None:
    (seqlens, dp, n_mb), expected = VERL_SPLITS[1]
    shapes = [SampleShape(f"s{i}", text_tokens=7, visual_tokens=t - 7, llm_tokens=t) for i, t in enumerate(seqlens)]
    batch = list(range(50, 50 + len(seqlens)))
    result = make_splitter("verl").split(SplitRequest(batch, np.ones((len(batch), 2)), n_mb, dp, shapes=shapes))
    assert result.ranks == [[[50 + p for p in mb] for mb in rank] for rank in expected]


def test_a_batch_verl_would_refuse_is_filled_then_emptied() -> None:
    split = verl_split([30, 10, 20, 50, 40], dp=2, n_mb=2)
    assert [len(rank) for rank in split] == [2, 2] and all(mb for rank in split for mb in rank)
    assert sorted(p for rank in split for mb in rank for p in mb) == list(range(5))
    with pytest.raises(ValueError, match="5 sequences do not divide into 2 equal partitions"):
        verl_karmarkar_karp([1, 2, 3, 4, 5], 2)
