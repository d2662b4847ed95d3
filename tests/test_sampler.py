"""The batch samplers: exactly-once coverage, agreement between ranks, balance, failures."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from dflop_ds.cost import ProxyCost
from dflop_ds.schedule.index import ScheduledIndex
from dflop_ds.schedule.prefetch import BackgroundMap
from dflop_ds.schedule.sampler import DFLOPBatchSampler, SamplerSettings, StockBatchSampler, make_sampler
from dflop_ds.shapes import TINY_POLICY


def mixed_shapes(n: int, seed: int = 0):
    """Text-only, image and video samples with heavy-tailed text lengths."""
    rng = np.random.default_rng(seed)
    shapes = []
    for i in range(n):
        kind = rng.choice(["text", "image", "video"], p=[0.3, 0.5, 0.2])
        text = int(rng.lognormal(4.5, 0.8)) + 2
        images = [(int(rng.integers(200, 1500)), int(rng.integers(200, 1500)))] if kind == "image" else []
        frames = int(rng.integers(10, 3000)) if kind == "video" else 0
        shapes.append(
            TINY_POLICY.shape(
                f"s{i}", image_sizes=images, video_frames=frames, text_tokens=text, label_tokens=text // 2
            )
        )
    return shapes


def run_epoch(sampler):
    return [list(mb) for mb in sampler]


@pytest.mark.parametrize("method", ["stock", "dflop"])
def test_exact_global_batches_and_every_sample_once_per_pass_across_ranks_and_epochs(method):
    shapes = mixed_shapes(203)  # 203 = 5 x 40 + 3: the remainder is carried, epoch to epoch
    dp, gas, size = 2, 4, 40
    samplers = [
        make_sampler(
            SamplerSettings(method, seed=7),
            shapes,
            global_batch_size=size,
            gradient_accumulation_steps=gas,
            dp_rank=r,
            dp_size=dp,
        )
        for r in range(dp)
    ]
    trained, orders = collections.Counter(), []
    for epoch in range(4):
        per_rank = [run_epoch(s) for s in samplers]
        # every rank gets the same number of microbatches, GAS per global batch, none empty
        assert len(per_rank[0]) == len(per_rank[1]) == gas * samplers[0].n_batches(epoch)
        assert all(len(mb) > 0 for rank in per_rank for mb in rank)
        for batch_id, batch in enumerate(samplers[0].batches_in_epoch(epoch)):
            got = [int(i) for rank in per_rank for mb in rank[batch_id * gas : (batch_id + 1) * gas] for i in mb]
            assert len(got) == size and sorted(got) == sorted(batch.tolist()) and len(set(got)) == size
            trained.update(got)
        orders.append([int(i) for mb in per_rank[0] for i in mb])
    assert [s.epoch for s in samplers] == [4, 4]
    # 4 epochs = 20 batches of 40 = 800 samples: 3 full passes over the 203 samples, 191 into the 4th
    assert sum(trained.values()) == 800 and sorted(trained) == list(range(len(shapes)))
    assert collections.Counter(trained.values()) == {4: 800 - 3 * 203, 3: 203 - (800 - 3 * 203)}
    assert orders[0] != orders[1] != orders[2], "each epoch must reshuffle"


def test_ranks_and_repeated_instances_agree_on_the_schedule():
    shapes = mixed_shapes(150)

    def make(rank: int) -> DFLOPBatchSampler:
        return DFLOPBatchSampler(
            shapes, global_batch_size=48, gradient_accumulation_steps=3, dp_rank=rank, dp_size=2, seed=3
        )

    # the first and last pipeline stage of a rank each build their own sampler
    assert run_epoch(make(0)) == run_epoch(make(0))
    a, b = make(0), make(1)
    for ba, bb in zip(a._schedules(0, 0), b._schedules(0, 0)):
        assert ba.split.ranks == bb.split.ranks


def test_balanced_split_beats_stock_and_varies_microbatch_sizes():
    shapes = mixed_shapes(512, seed=1)
    kwargs = dict(global_batch_size=128, gradient_accumulation_steps=8, dp_rank=0, dp_size=2, seed=0, prefetch=0)
    stock, dflop = StockBatchSampler(shapes, **kwargs), DFLOPBatchSampler(shapes, **kwargs)
    for s, d in zip(stock._schedules(0, 0), dflop._schedules(0, 0)):
        assert d.split.makespan < s.split.makespan
        assert d.split.makespan >= d.split.lower_bound - 1e-9
    sizes = {len(mb) for mb in run_epoch(dflop)}
    assert len(sizes) > 1, "a balanced split should vary the sample count per microbatch"


def test_loss_denominator_counts_label_tokens_of_the_whole_global_batch():
    shapes = mixed_shapes(64)
    gas, dp = 2, 2
    samplers = [
        DFLOPBatchSampler(shapes, global_batch_size=32, gradient_accumulation_steps=gas, dp_rank=r, dp_size=dp)
        for r in range(dp)
    ]
    per_batch = collections.defaultdict(list)
    for s in samplers:
        for mb in s:
            assert all(isinstance(i, ScheduledIndex) for i in mb)
            per_batch[mb[0].batch_id].extend(mb)
    for items in per_batch.values():
        tokens = sum(shapes[int(i)].label_tokens for i in items)
        assert {i.loss_denominator for i in items} == {tokens / (gas * dp)}


def test_resume_continues_with_the_next_batch():
    shapes = mixed_shapes(120)
    kwargs = dict(global_batch_size=20, gradient_accumulation_steps=2, seed=5)
    full = run_epoch(DFLOPBatchSampler(shapes, **kwargs))
    first = DFLOPBatchSampler(shapes, **kwargs)
    it = iter(first)
    consumed = [list(next(it)) for _ in range(6)]  # three whole global batches
    state = first.state_dict()
    resumed = DFLOPBatchSampler(shapes, **kwargs)
    resumed.load_state_dict(state)
    assert consumed + run_epoch(resumed) == full
    with pytest.raises(ValueError, match="global_batch_size"):
        DFLOPBatchSampler(shapes, **{**kwargs, "global_batch_size": 30}).load_state_dict(state)


def test_bad_sizes_are_refused_clearly():
    shapes = mixed_shapes(10)
    with pytest.raises(ValueError, match="microbatches"):
        DFLOPBatchSampler(shapes, global_batch_size=4, gradient_accumulation_steps=4, dp_size=2)
    with pytest.raises(ValueError, match="fewer than"):
        DFLOPBatchSampler(shapes, global_batch_size=16, gradient_accumulation_steps=8, dp_size=2)
    with pytest.raises(ValueError, match="dp_rank"):
        DFLOPBatchSampler(shapes, global_batch_size=4, gradient_accumulation_steps=2, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="unknown sampler"):
        make_sampler(SamplerSettings("random"), shapes, global_batch_size=4, gradient_accumulation_steps=2)


class ExplodingSampler(DFLOPBatchSampler):
    def split(self, batch, costs, batch_seed):
        if self.boom_at == int(batch_seed % 10_007):
            raise ZeroDivisionError("solver exploded")
        return super().split(batch, costs, batch_seed)


def test_a_scheduler_error_in_the_background_thread_surfaces_in_the_training_loop():
    shapes = mixed_shapes(60)
    sampler = ExplodingSampler(shapes, global_batch_size=12, gradient_accumulation_steps=2, prefetch=2)
    sampler.boom_at = 2
    got = []
    with pytest.raises(RuntimeError, match="solver exploded") as info:
        for mb in sampler:
            got.append(mb)
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert len(got) == 2 * 2  # the two batches before the failing one were delivered


def test_background_map_surfaces_even_base_exceptions_and_keeps_order():
    def fn(key):
        if key == 3:
            raise SystemExit("worker killed")
        return key * key

    ahead = BackgroundMap(fn, range(5), depth=2, poll_s=0.05)
    assert [next(ahead) for _ in range(3)] == [0, 1, 4]
    with pytest.raises(RuntimeError, match="worker killed"):
        next(ahead)
    ahead.close()


def test_proxy_cost_is_the_default_cost_model():
    shapes = mixed_shapes(20)
    sampler = DFLOPBatchSampler(shapes, global_batch_size=10, gradient_accumulation_steps=2)
    np.testing.assert_allclose(sampler.costs, ProxyCost().predict_samples(shapes))


def test_a_given_cost_model_drives_costs_and_microbatch_predictions():
    from test_costmodel import synthetic_profile

    from dflop_ds.cost import FittedCostModel

    cost_model = FittedCostModel().fit(synthetic_profile())
    shapes = mixed_shapes(80)
    sampler = DFLOPBatchSampler(
        shapes, global_batch_size=40, gradient_accumulation_steps=4, dp_size=2, cost_model=cost_model, prefetch=0
    )
    np.testing.assert_allclose(sampler.costs, cost_model.predict_samples(shapes))
    sched = next(sampler._schedules(0, 0))
    for rank, predicted in zip(sched.split.ranks, sched.split.predicted):
        for microbatch, cost in zip(rank, predicted):
            np.testing.assert_allclose(cost, cost_model.predict_microbatch([shapes[i] for i in microbatch]))
    assert not np.allclose(sampler.costs, ProxyCost().predict_samples(shapes))


def test_closing_the_sampler_stops_its_scheduling_thread():
    import threading

    before = set(threading.enumerate())  # other tests may have left their samplers' threads
    sampler = DFLOPBatchSampler(mixed_shapes(64), global_batch_size=16, gradient_accumulation_steps=4, prefetch=2)
    first = next(iter(sampler))
    ours = [t for t in threading.enumerate() if t not in before and t.name == "dflop-scheduler"]
    assert first and len(ours) == 1 and ours[0].is_alive()
    sampler.close(wait_s=10)
    assert not ours[0].is_alive()
