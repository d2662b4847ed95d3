"""The packers most users run, as registered splitters: LLaMA-Factory's greedy knapsack and
ms-swift's ``to_constant_volume``, checked on fixed inputs against packs worked by hand from
their published code, and the Trainer's dealing of packs to ranks."""

from __future__ import annotations

import numpy as np
import pytest

from dflop_ds.config import DFLOPConfig
from dflop_ds.schedule.splitters import SplitRequest, make_splitter
from dflop_ds.schedule.splitters.llamafactory import greedy_knapsack, knapsack_packs
from dflop_ds.schedule.splitters.packs import deal_packs, default_capacity, halve_fullest
from dflop_ds.schedule.splitters.swift import decreasing_fit, emptiest, fullest
from dflop_ds.shapes import SampleShape
from tests.test_splitters import rank0_sampler

PACKERS = ("llamafactory_packing", "swift_packing")


def shapes_of(llm_tokens: list[int], text: int = 5) -> list[SampleShape]:
    """Samples whose LLM sequence is ``llm_tokens`` (``text`` of them text, the rest visual)."""
    return [
        SampleShape(f"s{i}", image_sizes=((336, 336),), text_tokens=text, visual_tokens=t - text, llm_tokens=t)
        for i, t in enumerate(llm_tokens)
    ]


def test_greedy_knapsack_takes_the_largest_length_that_fits() -> None:
    # ascending [1, 2, 3, 4, 5, 7, 9] at 10: 9 then 1; 7 then 3; 5 then 4; 2 alone
    assert greedy_knapsack([7, 2, 5, 3, 9, 1, 4], 10) == [[9, 1], [7, 3], [5, 4], [2]]
    assert knapsack_packs([7, 2, 5, 3, 9, 1, 4], 10) == [[4, 5], [0, 3], [2, 6], [1]]


def test_knapsack_equal_lengths_fill_latest_read_first() -> None:
    # [3, 3, 3, 5] at 6: 5 alone, then 3 + 3, then 3; LLaMA-Factory pops the last index of a length
    assert knapsack_packs([3, 3, 3, 5], 6) == [[3], [2, 1], [0]]


def test_least_loaded_and_best_fit_differ_as_the_two_binpacking_releases() -> None:
    # [6, 5, 4, 1] at 10: 6 opens row 0, 5 row 1; 4 goes to the emptiest row that fits (row 1,
    # binpacking 2.0) or to the fullest (row 0, 1.x); then 1 likewise
    assert decreasing_fit([6, 5, 4, 1], 10, emptiest) == [[0, 3], [1, 2]]
    assert decreasing_fit([6, 5, 4, 1], 10, fullest) == [[0, 2], [1, 3]]
    # equal loads: the first row; equal lengths: position order
    assert decreasing_fit([3, 3, 3, 3], 6, emptiest) == [[0, 1], [2, 3]]
    assert decreasing_fit([2, 4, 4, 2], 6, fullest) == [[1, 0], [2, 3]]


def test_the_fullest_packs_are_halved_until_every_microbatch_has_one() -> None:
    assert halve_fullest([[0, 1, 2, 3, 4], [5, 6], [7]], 5) == [[0, 1], [2], [3, 4], [5, 6], [7]]
    with pytest.raises(ValueError, match="3 samples cannot fill 4 microbatches"):
        halve_fullest([[0, 1], [2]], 4)


def test_packs_are_dealt_round_robin_in_a_seeded_order() -> None:
    packs = [[i] for i in range(7)]
    dealt = deal_packs(packs, dp=2, n_mb=2, seed=5)
    assert [[len(mb) for mb in rank] for rank in dealt] == [[2, 2], [2, 1]]  # groups 0..3 of 2, 2, 2, 1 packs
    assert sorted(p for rank in dealt for mb in rank for pack in mb for p in pack) == list(range(7))
    assert dealt == deal_packs(packs, dp=2, n_mb=2, seed=5)
    assert any(deal_packs(packs, dp=2, n_mb=2, seed=s) != dealt for s in range(6, 10))


def test_default_packing_length_is_a_power_of_two_holding_the_longest() -> None:
    assert [default_capacity([n]) for n in (1, 1000, 1024, 1025)] == [1, 1024, 1024, 2048]


@pytest.mark.parametrize("name", PACKERS)
def test_a_packer_keeps_its_packs_whole_on_one_microbatch(name: str) -> None:
    lengths = [700, 300, 650, 350, 100, 900, 120, 80, 500, 500, 60, 40]
    shapes = shapes_of(lengths)
    packs = knapsack_packs(lengths, 1023) if name == "llamafactory_packing" else decreasing_fit(lengths, 1024, emptiest)
    request = SplitRequest(list(range(100, 112)), np.ones((12, 2)), 2, 2, shapes=shapes, seed=3)
    result = make_splitter(name).split(request)
    microbatches = [set(mb) for rank in result.ranks for mb in rank]
    for pack in packs:
        assert sum({100 + p for p in pack} <= mb for mb in microbatches) == 1, pack
    assert sorted(i for mb in microbatches for i in mb) == list(range(100, 112))


def test_llamafactory_pads_every_row_to_the_cutoff() -> None:
    lengths = [6, 5, 4, 3, 2, 1]
    costs = np.column_stack([np.arange(1.0, 7.0), np.full(6, 2.0)])
    request = SplitRequest(list(range(6)), costs, 1, 2, shapes=shapes_of(lengths, text=1), seed=0)
    result = make_splitter("llamafactory_packing", cutoff_len=8).split(request)
    # capacity 7: [6, 1], [5, 2], [4, 3], three packs over two microbatches (2 rows and 1 row)
    for rank, predicted in zip(result.ranks, result.predicted[:, 0]):
        mb = rank[0]
        rows = 2 if len(mb) == 4 else 1
        tokens = sum(lengths[i] for i in mb)
        assert predicted[0] == pytest.approx(costs[mb, 0].sum())
        assert predicted[1] == pytest.approx(2.0 * len(mb) * rows * 8 / tokens)


def test_swift_costs_its_rows_packed() -> None:
    costs = np.random.default_rng(0).random((9, 2))
    request = SplitRequest(list(range(9)), costs, 2, 2, shapes=shapes_of([90, 80, 70, 60, 50, 40, 30, 20, 10]))
    result = make_splitter("swift_packing", max_length=128).split(request)
    for rank, predicted in zip(result.ranks, result.predicted):
        for mb, cost in zip(rank, predicted):
            assert cost == pytest.approx(costs[mb].sum(axis=0))


@pytest.mark.parametrize(("name", "option"), [("llamafactory_packing", "cutoff_len"), ("swift_packing", "max_length")])
def test_a_sample_longer_than_the_packing_length_is_refused_by_name(name: str, option: str) -> None:
    request = SplitRequest([0, 1, 2], np.ones((3, 2)), 1, 1, shapes=shapes_of([50, 300, 20]))
    with pytest.raises(ValueError, match="sample 's1': 300 tokens do not fit"):
        make_splitter(name, **{option: 256}).split(request)


@pytest.mark.parametrize("name", PACKERS)
def test_a_packer_is_a_sampler_kind_and_trains_by_name(name: str) -> None:
    assert DFLOPConfig.from_dict({"sampler": {"kind": name}}).sampler.kind == name
    rng = np.random.default_rng(4)
    shapes = shapes_of([int(t) for t in rng.integers(20, 900, 40)])
    sampler = rank0_sampler(name, shapes)
    batch = sampler.batches_in_epoch(0)[0]
    split = sampler.schedule(0, 0, batch).split
    assert split.solver == name
    assert sorted(i for rank in split.ranks for mb in rank for i in mb) == sorted(batch.tolist())
