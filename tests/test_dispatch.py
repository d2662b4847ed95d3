"""Encoder dispatch plans (pure) and the colocated model's forward on one process."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflop_ds.schedule.dispatch import plan_dispatch

ROOT = Path(__file__).resolve().parent.parent


def covered_tiles(plan) -> collections.Counter:
    return collections.Counter((p.sample, t) for work in plan.work for p in work for t in range(p.start, p.stop))


@st.composite
def microsteps(draw):
    ranks = draw(st.integers(1, 4))
    n = draw(st.integers(ranks, 14))
    tiles = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    cost = draw(st.lists(st.floats(0.0, 3.0), min_size=n, max_size=n))
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=ranks - 1, max_size=ranks - 1)))
    order = draw(st.permutations(range(n)))
    bounds = [0, *cuts, n]
    return [list(order[bounds[r] : bounds[r + 1]]) for r in range(ranks)], np.array(tiles), np.array(cost)


@settings(max_examples=200, deadline=None)
@given(microsteps())
def test_dispatch_encodes_every_tile_exactly_once_within_one_tile_of_the_mean(case):
    microbatches, tiles, cost = case
    plan = plan_dispatch(microbatches, tiles, cost)
    expected = {(i, t) for mb in microbatches for i in mb for t in range(tiles[i])}
    counts = covered_tiles(plan)
    assert set(counts) == expected and set(counts.values()) <= {1}
    loads = np.array([sum(p.tiles * cost[p.sample] for p in work) for work in plan.work])
    assert np.allclose(loads, plan.loads)
    largest_tile = max([cost[i] for mb in microbatches for i in mb if tiles[i]], default=0.0)
    assert loads.max() <= loads.sum() / len(microbatches) + largest_tile + 1e-9
    for rank in range(len(microbatches)):  # routing is consistent with the plan
        own_tiles = sum(int(tiles[i]) for i in microbatches[rank])
        assert sum(plan.recv_counts(rank)) == own_tiles
        assert sorted(plan.recv_index(rank, tiles)) == list(range(own_tiles))
        owners = [p.owner for p in plan.work[rank]]
        assert owners == sorted(owners)  # grouped by destination, as the all-to-all sends


def test_dispatch_keeps_tiles_at_home_when_ranks_are_already_balanced():
    tiles, cost = np.array([4, 4, 2, 6]), np.ones(4)
    plan = plan_dispatch([[0, 1], [2, 3]], tiles, cost)
    assert all(p.owner == rank for rank, work in enumerate(plan.work) for p in work)


def test_dispatch_splits_a_video_by_frames_to_balance_the_ranks():
    tiles, cost = np.array([16, 0, 0]), np.array([1.0, 0.0, 0.0])
    plan = plan_dispatch([[0], [1], [2]], tiles, cost)
    assert plan.loads == pytest.approx((16 / 3 + 2 / 3, 16 / 3 - 1 / 3, 16 / 3 - 1 / 3), abs=1.0)
    assert max(plan.loads) - min(plan.loads) <= 1.0
    assert plan.send_counts(0)[0] == plan.recv_counts(0)[0] and sum(plan.recv_counts(0)) == 16
    assert plan.work[1][0].owner == 0 and plan.work[1][0].sample == 0


def test_dispatch_is_deterministic_and_refuses_repeated_samples():
    tiles, cost = np.arange(10) % 7, np.linspace(0.5, 2.0, 10)
    mbs = [[0, 5, 9], [1, 2], [3, 4, 6, 7, 8]]
    assert plan_dispatch(mbs, tiles, cost) == plan_dispatch(mbs, tiles, cost)
    with pytest.raises(ValueError, match="sample 5 appears twice"):
        plan_dispatch([[5], [5]], tiles, cost)
    with pytest.raises(ValueError, match="tile_cost"):
        plan_dispatch([[0]], tiles, -cost)


@pytest.fixture
def one_rank_group():
    import os

    import torch.distributed as dist

    from dflop_ds.launch import free_port

    if dist.is_initialized():
        yield
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("frozen", [False, True])
def test_colocated_model_equals_the_sequential_model_on_one_rank(one_rank_group, frozen):
    from dflop_ds.cost import ProxyCost
    from dflop_ds.data import read_dataset
    from dflop_ds.models import TinyMLLMDataset, collate_microbatch, tiny_mllm_layers
    from dflop_ds.pipe import token_normalized_loss
    from dflop_ds.schedule.index import ScheduledIndex
    from dflop_ds.shapes import TINY_POLICY
    from dflop_ds.train.colocated import ColocatedMLLM, DispatchCollate, DispatchDataset, MicrostepRequest, tile_costs
    from dflop_ds.train.sequential import SequentialMLLM

    shapes = read_dataset(ROOT / "examples" / "data" / "mixture.jsonl", TINY_POLICY)[:12]
    dataset = TinyMLLMDataset(shapes, seed=0)
    tiles, per_tile = tile_costs(ProxyCost(), shapes)
    own = [ScheduledIndex(i, 10.0) for i in (3, 0, 7, 1, 2)]
    plan = plan_dispatch([[int(i) for i in own]], tiles, per_tile)
    inputs, labels = DispatchCollate(collate_microbatch, tiles)(
        [DispatchDataset(dataset)[MicrostepRequest(own, plan, 0)]]
    )
    reference_inputs, reference_labels = collate_microbatch([dataset[i] for i in own])
    assert torch.equal(labels[0], reference_labels[0])

    models = [
        cls(*tiny_mllm_layers(seed=0, as_specs=False), freeze_encoder=frozen) for cls in (SequentialMLLM, ColocatedMLLM)
    ]
    losses = [
        token_normalized_loss(models[0](reference_inputs), reference_labels),
        token_normalized_loss(models[1](inputs), labels),
    ]
    for loss in losses:
        loss.backward()
    assert losses[1].item() == pytest.approx(losses[0].item(), rel=1e-6)
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert (a.grad is None) == (b.grad is None) == (frozen and int(name.split(".")[0]) < models[0].n_encoder_layers)
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7)
    if frozen:  # no graph through the encoder: its output is a plain tensor
        encoded = models[1][0]((inputs[0], *inputs[1:4]))[0]
        assert not encoded.requires_grad


def test_dispatch_fan_out_sends_each_owners_tiles_to_all_its_receivers_and_averages_their_gradients():
    from dflop_ds.pipe.exchange import fan_out, fan_out_routing

    # 4 ranks in two tensor-parallel groups owned by ranks 0 and 2: 2 tiles for owner 0, 3 for owner 2
    rows, splits = fan_out_routing([2, 0, 3, 0], owner_of=[0, 0, 2, 2])
    assert rows == [0, 1, 0, 1, 2, 3, 4, 2, 3, 4] and splits == [2, 2, 3, 3]
    assert fan_out_routing([1, 2], owner_of=[0, 1]) == ([0, 1, 2], [1, 2])  # no fan-out: as encoded
    features = torch.randn(5, 3, requires_grad=True)
    copies = fan_out(features, torch.tensor(rows))
    assert torch.equal(copies, features.detach()[rows])
    weights = torch.randn_like(copies)
    (copies * weights).sum().backward()
    expected = torch.zeros(5, 3).index_add_(0, torch.tensor(rows), weights) / 2  # every row has two copies
    torch.testing.assert_close(features.grad, expected)
    assert not fan_out(features.detach(), torch.tensor(rows)).requires_grad
