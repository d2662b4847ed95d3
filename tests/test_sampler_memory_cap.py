"""The memory cap: no microbatch predicted above it, oversize samples refused or trained alone."""

from __future__ import annotations

import collections
import dataclasses
import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflop_ds.config import DFLOPConfig
from dflop_ds.cost import PackedCost, ProxyCost
from dflop_ds.schedule.epoch import epoch_batches
from dflop_ds.schedule.fit_batches import MemoryCapError
from dflop_ds.schedule.memory import OversizeSampleError, fit_under_cap, microbatch_bytes, sample_bytes
from dflop_ds.schedule.partition import InfeasibleError, partition_batch
from dflop_ds.schedule.sampler import DFLOPBatchSampler, SamplerSettings, make_sampler
from dflop_ds.schedule.splitters import DFLOPSplitter, OverBudgetError
from dflop_ds.shapes import SampleShape

TOKENS_PER_FRAME = 1  # a strongly pooling video projector: long videos cost memory (tiles) more than time


def clip(sample_id: str, frames: int, text: int) -> SampleShape:
    """A synthetic sample: ``frames`` encoder tiles and their tokens before ``text`` text tokens."""
    return SampleShape(
        sample_id,
        video_frames=frames,
        encoder_tiles=frames,
        text_tokens=text,
        llm_tokens=frames * TOKENS_PER_FRAME + text,
        label_tokens=max(text // 2, 1),
    )


def planted(n: int, long_videos: int, seed: int = 0, frames: int = 48) -> list[SampleShape]:
    """Short texts and images with ``long_videos`` long videos planted at random positions."""
    rng = np.random.default_rng(seed)
    shapes = [clip(f"s{i}", int(rng.choice([0, 1, 4])), int(rng.integers(8, 120))) for i in range(n)]
    for i in rng.choice(n, size=long_videos, replace=False):
        shapes[i] = clip(f"video{i}", frames, 200)
    return shapes


def sampler(shapes, cost_model, **kwargs) -> list[DFLOPBatchSampler]:
    options = dict(global_batch_size=32, gradient_accumulation_steps=4, dp_size=2, seed=3, prefetch=0)
    options.update(kwargs)
    return [DFLOPBatchSampler(shapes, dp_rank=r, cost_model=cost_model, **options) for r in range(options["dp_size"])]


def trained(samplers, epochs: int = 1) -> list[list[list[int]]]:
    """Per rank, every microbatch of ``epochs`` epochs."""
    out = [[] for _ in samplers]
    for _ in range(epochs):
        for r, s in enumerate(samplers):
            out[r] += [[int(i) for i in mb] for mb in s]
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_no_microbatch_is_predicted_above_the_cap_with_planted_long_videos(packed):
    shapes = planted(96, long_videos=10)
    cost = PackedCost(ProxyCost(tile_cost=1.0)) if packed else ProxyCost(tile_cost=1.0)
    video = float(sample_bytes(cost, shapes).max())
    free = trained(sampler(shapes, cost))
    largest = max(microbatch_bytes(cost, [shapes[i] for i in mb]) for rank in free for mb in rank)
    assert largest > 1.15 * video, "the planted videos must make a microbatch much larger than one video"
    cap = (video + largest) / 2  # below what the uncapped split builds, above any sample alone
    capped = trained(sampler(shapes, cost, memory_cap=cap))
    sizes = [microbatch_bytes(cost, [shapes[i] for i in mb]) for rank in capped for mb in rank]
    assert max(sizes) <= cap
    counts = collections.Counter(i for rank in capped for mb in rank for i in mb)
    assert sorted(counts) == list(range(len(shapes))) and set(counts.values()) == {1}
    assert all(len(rank) == 4 * 3 for rank in capped)  # 3 global batches of 4 microbatches per rank


def test_a_sample_over_the_cap_alone_is_an_error_naming_it():
    shapes = planted(64, long_videos=3)
    shapes[5] = clip("huge-video", 400, 300)
    cost = ProxyCost()
    cap = 2 * microbatch_bytes(cost, [clip("v", 48, 200)])
    with pytest.raises(OversizeSampleError) as error:
        sampler(shapes, cost, memory_cap=cap)
    message = str(error.value)
    assert "'huge-video'" in message and f"{microbatch_bytes(cost, [shapes[5]]):.4g} bytes" in message
    assert f"{cap:.4g}" in message and "allow_oversize" in message


def test_allow_oversize_trains_the_sample_alone_once_with_a_warning(caplog):
    shapes = planted(64, long_videos=3)
    shapes[5] = clip("huge-video", 400, 300)
    shapes[40] = clip("huge-video-2", 300, 100)
    cost = PackedCost(ProxyCost())
    cap = 2 * microbatch_bytes(cost, [clip("v", 48, 200)])
    with caplog.at_level(logging.WARNING):
        samplers = sampler(shapes, cost, memory_cap=cap, allow_oversize=True)
    assert "huge-video" in caplog.text and "huge-video-2" in caplog.text
    batches = trained(samplers, epochs=2)
    microbatches = [mb for rank in batches for mb in rank]
    for big in (5, 40):
        holding = [mb for mb in microbatches if big in mb]
        assert holding == [[big], [big]], "trained alone, once per epoch"
    others = [mb for mb in microbatches if 5 not in mb and 40 not in mb]
    assert max(microbatch_bytes(cost, [shapes[i] for i in mb]) for mb in others) <= cap
    counts = collections.Counter(i for mb in microbatches for i in mb)
    assert set(counts.values()) == {2} and len(counts) == len(shapes)


def test_a_baseline_sampler_runs_under_a_cap_through_the_contract_and_the_config_keys_are_typed():
    shapes = planted(32, 1)
    cost = ProxyCost(tile_cost=1.0)
    usage = sample_bytes(cost, shapes)
    for method in ("stock", "verl"):  # the registered splitters other than dflop cut whatever the memory

        def build(cap, method=method):
            return make_sampler(
                SamplerSettings(method, prefetch=0),
                shapes,
                global_batch_size=16,
                gradient_accumulation_steps=2,
                cost_model=cost,
                memory_cap=cap,
            )

        roomy = build(float(usage.sum()))  # any microbatch fits
        assert sorted(i for mb in roomy for i in mb) == list(range(32))
        with pytest.raises(OverBudgetError, match=f"splitter '{method}' put samples"):
            list(build(1.05 * float(usage.max())))  # two samples together exceed it somewhere
        with pytest.raises(OversizeSampleError):
            build(0.5 * float(usage.max()))
    assert DFLOPConfig.from_dict({}).sampler.memory_cap_bytes == "auto"
    assert DFLOPConfig.from_dict({"sampler": {"memory_cap_bytes": "off"}}).sampler.memory_cap_bytes == "off"
    assert (
        DFLOPConfig.from_dict({"sampler": {"memory_cap_bytes": 2e9, "allow_oversize": True}}).sampler.allow_oversize
        is True
    )
    with pytest.raises(ValueError, match="memory_cap_bytes"):
        DFLOPConfig.from_dict({"sampler": {"memory_cap_bytes": "2GB"}})
    with pytest.raises(ValueError, match="memory_cap_bytes"):
        DFLOPConfig.from_dict({"sampler": {"memory_cap_bytes": 0}})
    with pytest.raises(ValueError, match="allow_oversize"):
        DFLOPConfig.from_dict({"sampler": {"allow_oversize": 1}})


def with_videos(n: int, videos: int, seed: int = 0) -> list[SampleShape]:
    """Short texts with ``videos`` equal long videos at random positions."""
    rng = np.random.default_rng(seed)
    shapes = [clip(f"s{i}", 0, int(rng.integers(8, 20))) for i in range(n)]
    for i in rng.choice(n, size=videos, replace=False):
        shapes[i] = clip(f"video{i}", 40, 200)
    return shapes


def videos_per_batch(shapes, seed: int, epoch: int, drop_last: bool = False) -> list[int]:
    """How many videos each global batch of 16 of ``epoch`` holds as the epoch permutation draws them."""
    batches = epoch_batches(len(shapes), seed, epoch, 16, drop_last)
    return [sum(shapes[i].sample_id.startswith("video") for i in batch) for batch in batches]


def check_trained_within_cap(samplers, shapes, cost, cap, epochs: int) -> list[list[int]]:
    """Train ``epochs`` epochs: every sample once per epoch, every batch whole, microbatches of two
    or more samples within ``cap``; returns the microbatches."""
    microbatches = [mb for rank in trained(samplers, epochs) for mb in rank]
    counts = collections.Counter(i for mb in microbatches for i in mb)
    assert len(counts) == len(shapes) and set(counts.values()) == {epochs}
    assert all(microbatch_bytes(cost, [shapes[i] for i in mb]) <= cap for mb in microbatches if len(mb) > 1)
    return microbatches


def test_a_batch_over_its_microbatches_is_fixed_before_training_by_exchanging_samples():
    """Issue 25: every sample fits the cap alone, but a batch drawing more videos than it has
    microbatches could not be split (the run died when training reached it). The sampler now
    moves the excess videos to the epoch's other batches; every sample is still trained once."""
    shapes = with_videos(64, videos=8)
    cost = PackedCost(ProxyCost(tile_cost=1.0))
    video = float(sample_bytes(cost, shapes).max())
    cap = 1.3 * video  # one video and some text per microbatch: 2 videos per batch of 2 microbatches
    assert videos_per_batch(shapes, seed=3, epoch=0) == [0, 1, 4, 3]
    plain = epoch_batches(64, 3, 0, 16)[2]
    size = lambda rows: microbatch_bytes(cost, [shapes[plain[r]] for r in rows])  # noqa: E731
    assert fit_under_cap(sample_bytes(cost, [shapes[i] for i in plain]), np.zeros(16), 2, size, cap) is None
    samplers = sampler(shapes, cost, global_batch_size=16, gradient_accumulation_steps=2, dp_size=1, memory_cap=cap)
    microbatches = check_trained_within_cap(samplers, shapes, cost, cap, epochs=2)
    assert len(microbatches) == 2 * 4 * 2  # 2 epochs of 4 batches of 2 microbatches
    again = sampler(shapes, cost, global_batch_size=16, gradient_accumulation_steps=2, dp_size=1, memory_cap=cap)
    again[0].load_state_dict({**samplers[0].state_dict(), "epoch": 0, "next_batch": 2, "next_microbatch": 1})
    assert [list(map(int, mb)) for mb in again[0]] == microbatches[5:8], "a resume hits the same batches"
    (other_cap,) = sampler(shapes, cost, global_batch_size=16, gradient_accumulation_steps=2, dp_size=1)
    with pytest.raises(ValueError, match=f"memory_cap={cap!r}.*resuming inside it needs the same cap"):
        other_cap.load_state_dict(again[0].state_dict() | {"epoch": 0, "next_batch": 2})
    other_cap.load_state_dict(again[0].state_dict() | {"epoch": 1, "next_batch": 0})  # an epoch boundary: any cap


def test_an_epoch_that_cannot_fit_is_refused_before_training_naming_batch_and_cap():
    shapes = with_videos(64, videos=9)  # 9 videos, 4 batches of 2 microbatches: room for 8
    cost = PackedCost(ProxyCost(tile_cost=1.0))
    cap = 1.3 * float(sample_bytes(cost, shapes).max())
    with pytest.raises(MemoryCapError) as error:
        sampler(shapes, cost, global_batch_size=16, gradient_accumulation_steps=2, dp_size=1, memory_cap=cap)
    message = str(error.value)
    assert "epoch 0 global batch" in message and f"{cap:.4g} bytes" in message and "memory_cap_bytes" in message
    assert "'video" in message and "gradient_accumulation_steps" in message


def test_check_steps_refuses_a_later_epoch_before_the_first_step():
    """With drop_last each epoch trains another subset: epoch 2 keeps all 9 videos (room for 8)."""
    shapes = with_videos(68, videos=9)
    cost = PackedCost(ProxyCost(tile_cost=1.0))
    cap = 1.3 * float(sample_bytes(cost, shapes).max())
    assert [sum(videos_per_batch(shapes, 1, e, drop_last=True)) for e in range(3)] == [7, 7, 9]
    options = dict(global_batch_size=16, gradient_accumulation_steps=2, dp_size=1, seed=1, drop_last=True)
    (capped,) = sampler(shapes, cost, memory_cap=cap, **options)
    capped.check_steps(8)  # epochs 0 and 1
    with pytest.raises(MemoryCapError, match="epoch 2 global batch"):
        capped.check_steps(9)


def test_allow_oversize_trains_oversize_samples_alone_moving_the_excess_to_other_batches():
    shapes = with_videos(64, videos=12)  # 4 microbatches per batch: 3 videos alone and the text together
    cost = PackedCost(ProxyCost(tile_cost=1.0))
    video = float(sample_bytes(cost, shapes).max())
    assert max(videos_per_batch(shapes, seed=3, epoch=0)) > 3
    options = dict(global_batch_size=16, gradient_accumulation_steps=4, dp_size=1, allow_oversize=True)
    samplers = sampler(shapes, cost, memory_cap=0.5 * video, **options)
    microbatches = check_trained_within_cap(samplers, shapes, cost, 0.5 * video, epochs=2)
    assert all(len(mb) == 1 for mb in microbatches if any(shapes[i].sample_id.startswith("video") for i in mb))
    with pytest.raises(MemoryCapError, match="16 of them exceed the cap alone"):  # every sample oversize
        sampler(shapes, cost, memory_cap=1e-3 * video, **options)


def test_the_fit_found_before_training_is_a_valid_split_for_any_costs():
    """The last resort of scheduling: :meth:`DFLOPBatchSampler.fit_under_cap`'s cost-blind split,
    turned into per-rank microbatches by ``DFLOPSplitter.split_buckets``."""
    shapes = with_videos(64, videos=8)
    cost = PackedCost(ProxyCost(tile_cost=1.0))
    cap = 1.3 * float(sample_bytes(cost, shapes).max())
    capped = sampler(shapes, cost, global_batch_size=16, gradient_accumulation_steps=2, dp_size=2, memory_cap=cap)[0]
    batch = capped.batches_in_epoch(0)[2]
    buckets = capped.fit_under_cap(batch, cap)
    assert buckets is not None and len(buckets) == 4 and all(buckets)
    assert sorted(p for b in buckets for p in b) == list(range(16))
    assert all(microbatch_bytes(cost, [shapes[batch[p]] for p in b]) <= cap for b in buckets)
    for sync in ("pipeline", "microstep", "module"):
        costs = np.random.default_rng(1).random((16, 2))  # whatever the step's costs
        request = dataclasses.replace(capped.split_request(batch, costs, batch_seed=0), sync=sync)
        split = DFLOPSplitter().split_buckets(request, buckets, "memory-fit")
        assert split.solver == "memory-fit" and [len(rank) for rank in split.ranks] == [2, 2]
        placed = sorted(sorted(mb) for rank in split.ranks for mb in rank)
        assert placed == sorted(sorted(int(batch[p]) for p in b) for b in buckets)
        assert split.predicted.shape[:2] == (2, 2) and split.makespan == split.predicted.max()


def test_partition_gives_oversize_items_a_bucket_of_their_own():
    costs = np.array([[1.0], [2.0], [3.0], [9.0], [4.0], [5.0]])
    memory = np.array([1.0, 1.0, 1.0, 50.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="item 3"):
        partition_batch(costs, 4, memory=memory, memory_cap=2.0, time_limit_s=0)
    split = partition_batch(costs, 4, memory=memory, memory_cap=2.0, time_limit_s=0, allow_oversize=True)
    assert [3] in split.buckets and sorted(i for b in split.buckets for i in b) == list(range(6))
    assert all(memory[b].sum() <= 2.0 for b in split.buckets if b != [3])
    with pytest.raises(InfeasibleError, match="bucket of their own"):
        partition_batch(
            costs,
            2,
            memory=np.array([9.0, 9.0, 1.0, 1.0, 1.0, 1.0]),
            memory_cap=2.0,
            time_limit_s=0,
            allow_oversize=True,
        )


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    videos=st.integers(0, 12),
    cap_factor=st.floats(0.5, 4.0),
    packed=st.booleans(),
    sync=st.sampled_from(["pipeline", "boundary", "microstep", "module"]),
    dp=st.sampled_from([1, 2]),
)
def test_capped_partitions_stay_valid(seed, videos, cap_factor, packed, sync, dp):
    """Whatever the cap: every sample once per pass, GAS non-empty microbatches per rank, and each
    microbatch of two or more samples within the cap; or a clear error (oversize, infeasible)."""
    shapes = planted(48, long_videos=videos, seed=seed, frames=40)
    cost = PackedCost(ProxyCost(tile_cost=1.0)) if packed else ProxyCost(tile_cost=1.0)
    cap = cap_factor * float(sample_bytes(cost, shapes).max())
    try:
        samplers = sampler(
            shapes,
            cost,
            global_batch_size=24,
            gradient_accumulation_steps=3,
            dp_size=dp,
            sync=sync,
            memory_cap=cap,
            allow_oversize=cap_factor < 1,
        )
        batches = trained(samplers)
    except InfeasibleError as error:
        assert "memory_cap" in str(error)
        return
    assert all(len(rank) == 3 * 2 for rank in batches)  # 2 global batches of 24 per epoch
    microbatches = [mb for rank in batches for mb in rank]
    assert all(microbatches)
    counts = collections.Counter(i for mb in microbatches for i in mb)
    assert len(counts) == len(shapes) and set(counts.values()) == {1}
    for mb in microbatches:
        if len(mb) > 1:
            assert microbatch_bytes(cost, [shapes[i] for i in mb]) <= cap * (1 + 1e-9)


def test_partition_checks_the_true_padded_memory_and_falls_back_to_a_first_fit():
    lengths = np.array([100.0, 100.0, 10.0, 10.0, 10.0, 10.0])

    def padded(items: list[int]) -> float:
        return len(items) * float(lengths[items].max())

    additive = partition_batch(lengths, 2, memory=lengths, memory_cap=200.0, time_limit_s=0)
    assert max(padded(b) for b in additive.buckets) > 200, "the additive cap alone lets padding through"
    split = partition_batch(
        lengths, 2, memory=lengths, memory_cap=200.0, time_limit_s=0, lengths=lengths, microbatch_memory=padded
    )
    assert sorted(map(sorted, split.buckets)) == [[0, 1], [2, 3, 4, 5]] and split.solver == "memory-first-fit"
    with pytest.raises(InfeasibleError):
        partition_batch(lengths, 2, memory=lengths, memory_cap=150.0, time_limit_s=0, microbatch_memory=padded)
