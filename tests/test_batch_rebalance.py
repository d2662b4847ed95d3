"""The ``batch_rebalance`` splitter groups a global batch as transformers' own BatchRebalanceSampler does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.trainer_pt_utils import BatchRebalanceSampler

from dflop_ds.config import DFLOPConfig
from dflop_ds.schedule.sampler import SamplerSettings, make_sampler
from dflop_ds.schedule.splitters import SplitRequest, make_splitter
from dflop_ds.schedule.splitters.batch_rebalance import batch_rebalance, padded_group_cost
from dflop_ds.shapes import SampleShape


def transformers_split(lengths: list[int], batch_size: int, dp: int, gas: int, seed: int) -> list[list[list[int]]]:
    """``ranks[r][j]``: the dataset indices transformers' sampler yields rank ``r`` for the ``j``-th
    microbatch of the first global batch (one sampler per rank, as the Trainer builds them)."""
    ranks = []
    for rank in range(dp):
        sampler = BatchRebalanceSampler(lengths, batch_size, dp, gas, seed=seed, rank=rank)
        ranks.append([list(mb) for mb, _ in zip(sampler, range(gas))])
    return ranks


def processor_shape(i: int, length: int) -> SampleShape:
    """A sample whose ``input_ids`` from an HF processor hold ``length`` tokens, its image expanded."""
    text = max(length // 3, 1)
    return SampleShape(
        f"s{i}", image_sizes=((336, 336),), text_tokens=text, visual_tokens=length - text, llm_tokens=length
    )


def placeholder_shape(i: int, length: int) -> SampleShape:
    """A sample whose ``input_ids`` from LLaVA-1.5's code hold ``length`` tokens: its text, one
    ``<image>`` per image (two here) and one for its video, its visual tokens not among them."""
    return SampleShape(
        f"s{i}",
        image_sizes=((336, 336), (672, 336)),
        video_frames=8,
        text_tokens=length - 3,
        visual_tokens=2000,
        llm_tokens=length - 3 + 2000,
    )


def our_split(
    lengths: list[int], batch_size: int, dp: int, gas: int, seed: int, name: str = "batch_rebalance"
) -> list[list[list[int]]]:
    """The registered splitter on the same global batch: the rows transformers' shuffle draws first,
    as samples whose Trainer-read length is ``lengths[i]``."""
    generator = torch.Generator()
    generator.manual_seed(seed)  # epoch 0
    batch = torch.randperm(len(lengths), generator=generator).tolist()[:batch_size]
    make_shape = processor_shape if name == "batch_rebalance" else placeholder_shape
    shapes = [make_shape(i, lengths[i]) for i in batch]
    request = SplitRequest(batch, np.zeros((batch_size, 2)), gas, dp, shapes=shapes, seed=seed)
    return make_splitter(name).split(request).ranks


CASES = [
    # (dataset size, global batch, dp, GAS, length draw)
    (64, 32, 2, 2, "uniform"),
    (200, 96, 4, 3, "lognormal"),
    (300, 128, 8, 2, "lognormal"),
    (40, 10, 4, 2, "skewed"),  # two samples more than groups: the climb freezes one-sample slots
    (60, 24, 3, 4, "ties"),  # many equal lengths: ties broken by batch order and group index
    (500, 256, 16, 4, "lognormal"),
]


def draw_lengths(n: int, kind: str, seed: int) -> list[int]:
    """Token lengths of ``n`` samples of one kind of distribution."""
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        return rng.integers(5, 400, n).tolist()
    if kind == "lognormal":
        return np.clip(rng.lognormal(5.0, 1.0, n), 3, 8000).astype(int).tolist()
    if kind == "skewed":
        return [int(x) for x in np.where(rng.random(n) < 0.1, rng.integers(2000, 4000, n), rng.integers(5, 50, n))]
    return rng.choice([16, 64, 256], n).tolist()


@pytest.mark.parametrize("seed", [0, 7])
@pytest.mark.parametrize(("n", "batch_size", "dp", "gas", "kind"), CASES)
def test_grouping_matches_transformers(n: int, batch_size: int, dp: int, gas: int, kind: str, seed: int) -> None:
    lengths = draw_lengths(n, kind, seed)
    assert our_split(lengths, batch_size, dp, gas, seed) == transformers_split(lengths, batch_size, dp, gas, seed)


@pytest.mark.parametrize(("n", "batch_size", "dp", "gas", "kind"), CASES[:3])
def test_the_text_variant_matches_transformers_on_placeholder_lengths(
    n: int, batch_size: int, dp: int, gas: int, kind: str
) -> None:
    lengths = [length + 3 for length in draw_lengths(n, kind, 1)]  # room for the three placeholders
    expected = transformers_split(lengths, batch_size, dp, gas, 1)
    assert our_split(lengths, batch_size, dp, gas, 1, name="batch_rebalance_text") == expected


def test_slots_hold_the_costliest_groups_first() -> None:
    lengths = np.array([900, 30, 30, 30, 800, 30, 30, 25, 20, 10, 700, 15])
    ranks = batch_rebalance(lengths, dp=2, n_mb=3)
    costs = [[float(padded_group_cost(len(mb), lengths[mb].max())) for mb in rank] for rank in ranks]
    slot_min = [min(rank[j] for rank in costs) for j in range(3)]
    slot_max = [max(rank[j] for rank in costs) for j in range(3)]
    assert all(slot_min[j] >= slot_max[j + 1] for j in range(2)), costs
    assert sorted(i for rank in ranks for mb in rank for i in mb) == list(range(len(lengths)))


def test_too_few_samples_is_refused() -> None:
    with pytest.raises(ValueError, match="batch_rebalance: 3 samples cannot fill 4 microbatches"):
        batch_rebalance(np.array([5, 6, 7]), dp=2, n_mb=2)


def test_it_is_a_sampler_kind() -> None:
    assert DFLOPConfig.from_dict({"sampler": {"kind": "batch_rebalance"}}).sampler.kind == "batch_rebalance"


def test_the_sampler_trains_it_by_name() -> None:
    rng = np.random.default_rng(3)
    shapes = [processor_shape(i, int(t)) for i, t in enumerate(rng.integers(5, 900, 40))]
    sampler = make_sampler(
        SamplerSettings("batch_rebalance", prefetch=0),
        shapes,
        global_batch_size=16,
        gradient_accumulation_steps=2,
        dp_size=2,
        dp_rank=0,
    )
    batch = sampler.batches_in_epoch(0)[0]
    split = sampler.schedule(0, 0, batch).split
    lengths = np.array([shapes[i].llm_tokens for i in batch])
    expected = [[[int(batch[p]) for p in mb] for mb in rank] for rank in batch_rebalance(lengths, dp=2, n_mb=2)]
    assert split.solver == "batch_rebalance" and split.ranks == expected
