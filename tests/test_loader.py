"""make_loader: resume after any number of microbatches with DataLoader workers, exactly once;
sampler state fingerprints; exact global batches; the scheduling deadline."""

from __future__ import annotations

import collections
import time

import pytest
import torch
from test_sampler import mixed_shapes

import dflop_ds
from dflop_ds.schedule.epoch import epoch_batches
from dflop_ds.schedule.prefetch import ScheduleTimeoutError
from dflop_ds.schedule.sampler import DFLOPBatchSampler, SamplerSettings, make_sampler
from dflop_ds.testing import StuckSplitSampler

SHAPES = mixed_shapes(101)  # the 101 samples: not a multiple of any batch size used here


class IndexDataset(torch.utils.data.Dataset):
    """Returns the index it is asked for (what a training step would train)."""

    def __len__(self) -> int:
        return len(SHAPES)

    def __getitem__(self, index):
        return int(index)


def collate(items):
    return list(items)


def sampler_for(rank: int, dp: int, **extra):
    kwargs = dict(global_batch_size=16, gradient_accumulation_steps=4, dp_rank=rank, dp_size=dp, seed=11)
    return DFLOPBatchSampler(SHAPES, **{**kwargs, **extra})


def take(iterator, n: int) -> list[list[int]]:
    return [next(iterator) for _ in range(n)]


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("consumed", [3, 8, 13])  # mid-batch (3, 13) and at a batch boundary (8)
def test_resume_with_two_workers_trains_every_sample_exactly_once(dp, consumed):
    reference, interrupted = [], []
    for rank in range(dp):
        loader = dflop_ds.make_loader(IndexDataset(), sampler_for(rank, dp), collate_fn=collate)
        reference.append(take(iter(loader), 24))
        first = dflop_ds.make_loader(IndexDataset(), sampler_for(rank, dp), collate_fn=collate, num_workers=2)
        before = take(iter(first), consumed)  # the workers have fetched further ahead than this
        state = first.state_dict()
        assert (state["next_batch"], state["next_microbatch"]) == divmod(consumed, 4)
        resumed = dflop_ds.make_loader(IndexDataset(), sampler_for(rank, dp), collate_fn=collate, num_workers=2)
        resumed.load_state_dict(state)
        interrupted.append(before + take(iter(resumed), 24 - consumed))
    assert interrupted == reference
    trained = collections.Counter(i for rank in interrupted for mb in rank for i in mb)
    batches = epoch_batches(len(SHAPES), 11, 0, 16)
    assert trained == collections.Counter(int(i) for b in batches for i in b) and set(trained.values()) == {1}


def test_loader_follows_the_consumed_schedule_across_epochs_and_repeated_iteration():
    sampler = sampler_for(0, 1)
    loader = dflop_ds.make_loader(IndexDataset(), sampler, collate_fn=collate, num_workers=2)
    epochs = [[i for mb in loader for i in mb] for _ in range(3)]
    assert sampler.epoch == 3
    expected = [[int(i) for b in epoch_batches(len(SHAPES), 11, e, 16) for i in b] for e in range(3)]
    assert [sorted(e) for e in epochs] == [sorted(e) for e in expected]
    iterator = iter(loader)
    next(iterator)
    assert sampler.last_schedule.batch_id == 0 and sampler.state_dict()["next_microbatch"] == 1
    # an abandoned iterator's prefetched microbatches are not lost: a new one starts after the consumed
    again = next(iter(loader))
    assert sampler.state_dict()["next_microbatch"] == 2 and again == [
        int(i) for i in sampler.last_schedule.split.ranks[0][1]
    ]


def test_loader_refuses_arguments_that_would_reorder_or_resize_microbatches():
    with pytest.raises(ValueError, match="batch_size"):
        dflop_ds.make_loader(IndexDataset(), sampler_for(0, 1), collate_fn=collate, batch_size=4)
    with pytest.raises(ValueError, match="in_order"):
        dflop_ds.make_loader(IndexDataset(), sampler_for(0, 1), collate_fn=collate, in_order=False)


def test_state_of_another_dataset_is_refused_naming_both():
    state = sampler_for(0, 1).state_dict()
    other = DFLOPBatchSampler(SHAPES[::-1], global_batch_size=16, gradient_accumulation_steps=4, seed=11)
    with pytest.raises(ValueError, match="another dataset") as info:
        other.load_state_dict(state)
    assert state["dataset_fingerprint"] in str(info.value) and other.fingerprint in str(info.value)
    assert repr(SHAPES[0].sample_id) in str(info.value) and repr(SHAPES[-1].sample_id) in str(info.value)


def test_mid_batch_state_needs_the_same_microbatch_layout():
    sampler = sampler_for(0, 1)
    iterator = iter(sampler)
    take(iterator, 2)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        sampler_for(0, 1, gradient_accumulation_steps=2).load_state_dict(sampler.state_dict())
    take(iterator, 2)  # at a batch boundary another layout (or dp size) resumes on the same global batches
    other = sampler_for(1, 2, gradient_accumulation_steps=2)
    other.load_state_dict(sampler.state_dict())
    assert other.position == sampler.position


@pytest.mark.parametrize("n", [40, 63, 101])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_global_batch_has_exactly_the_global_batch_size(n, drop_last):
    shapes = mixed_shapes(n, seed=n)
    sampler = make_sampler(
        SamplerSettings("dflop", seed=1, drop_last=drop_last, prefetch=0),
        shapes,
        global_batch_size=32 if n == 40 else 16,
        gradient_accumulation_steps=4,
        dp_size=2,
    )
    size = sampler.global_batch_size
    seen = []
    for epoch in range(5):
        per_batch = collections.defaultdict(list)
        for mb in sampler:
            per_batch[mb[0].batch_id].extend(int(i) for i in mb)
        # this rank's half; the whole batch is the sampler's batch of that id
        for batch_id, batch in enumerate(sampler.batches_in_epoch(epoch)):
            assert len(batch) == size and len(set(batch.tolist())) == size
            assert set(per_batch[batch_id]) < set(batch.tolist())
            seen.extend(batch.tolist())
    counts = collections.Counter(seen)
    if drop_last:
        assert sampler.dropped_per_epoch == n % size and len(seen) == 5 * (n - n % size)
        assert max(counts.values()) <= 5
    else:
        assert sampler.dropped_per_epoch == 0
        passes = len(seen) // n  # the first passes x n samples trained are every sample `passes` times
        assert all(sorted(seen[p * n : (p + 1) * n]) == list(range(n)) for p in range(passes))


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_stuck_split_raises_naming_epoch_and_batch_instead_of_hanging(prefetch):
    sampler = StuckSplitSampler(
        SHAPES,
        stuck_batch=2,
        global_batch_size=16,
        gradient_accumulation_steps=4,
        prefetch=prefetch,
        schedule_timeout_s=0.5,
    )
    got = []
    start = time.monotonic()
    with pytest.raises(ScheduleTimeoutError, match="epoch 0 batch 2") as info:
        for mb in sampler:
            got.append(mb)
    assert time.monotonic() - start < 15
    assert isinstance(info.value, TimeoutError) and "schedule_timeout_s=0.5" in str(info.value)
    assert len(got) == 2 * 4  # the batches before the stuck one were delivered
    sampler.release.set()


def test_an_overrunning_exact_solve_falls_back_to_the_heuristic():
    sampler = StuckSplitSampler(
        SHAPES,
        stuck_exact=True,
        global_batch_size=16,
        gradient_accumulation_steps=4,
        ilp_nodes=100,
        prefetch=0,
        schedule_timeout_s=3.0,
    )
    reference = DFLOPBatchSampler(SHAPES, global_batch_size=16, gradient_accumulation_steps=4, prefetch=0)
    start = time.monotonic()
    mbs = take(iter(sampler), 4)
    assert time.monotonic() - start < 30  # the 3 s timeout, then the fallback: not the stuck solve
    assert sampler.last_schedule.split.solver.endswith("+fallback")
    assert mbs == take(iter(reference), 4)  # the heuristic's split: the same on every rank
    sampler.release.set()


def test_bad_schedule_timeout_is_refused():
    with pytest.raises(ValueError, match="schedule_timeout_s"):
        sampler_for(0, 1, schedule_timeout_s=0)


def test_import_and_heuristic_need_no_pulp_and_an_exact_solve_without_it_falls_back():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['pulp'] = None\n"
        "import numpy as np, dflop_ds, dflop_ds.plan\n"
        "from dflop_ds.schedule import SplitRequest, make_splitter, partition_batch\n"
        "print(partition_batch(np.arange(1.0, 9.0), 2, time_limit_s=0).solver)\n"
        "costs = np.random.default_rng(0).random((12, 2))  # the heuristic is off the bound here\n"
        "print(make_splitter('dflop', node_limit=50).split(SplitRequest(list(range(12)), costs, 3, 1)).solver)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    heuristic, fallback = result.stdout.split()
    assert not heuristic.startswith("ilp") and fallback.endswith("+fallback")
    assert "needs PuLP" in result.stderr
