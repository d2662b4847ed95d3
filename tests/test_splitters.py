"""The splitter registry: every splitter places each sample once; the sampler, the planner and the
benchmarks cut a batch the same way for the same splitter name."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.e2e_methods import PACKED_METHODS, SPLITTERS, method_cost_model, split_for
from dflop_ds.cost import PackedCost, ProxyCost, reference_model
from dflop_ds.plan import Cluster
from dflop_ds.plan.evaluate import evaluate
from dflop_ds.plan.layout import Layout, Segment, separate_stages
from dflop_ds.plan.plan_file import Plan, PlanFileError, layout_from_dict, layout_to_dict
from dflop_ds.schedule import splitters
from dflop_ds.schedule.sampler import GlobalBatchSampler, SamplerSettings, SplitterSampler, make_sampler
from dflop_ds.schedule.splitters import (
    SplitRequest,
    check_split,
    make_splitter,
    register_splitter,
    splitter_names,
)
from dflop_ds.shapes import TINY_POLICY, SampleShape

IMAGES = [(), ((336, 336),), ((672, 336),), ((672, 672),)]


def shapes_of(n: int, seed: int = 0) -> list[SampleShape]:
    """Text-only and image samples of varied lengths."""
    rng = np.random.default_rng(seed)
    return [
        TINY_POLICY.shape(
            f"s{i}",
            image_sizes=IMAGES[int(rng.integers(4))],
            text_tokens=int(rng.integers(4, 200)),
            label_tokens=int(rng.integers(1, 4)),
        )
        for i in range(n)
    ]


def test_the_named_splitters_are_registered() -> None:
    assert {"stock", "dflop", "llava", "verl", "batch_rebalance", "batch_rebalance_text"} <= set(splitter_names())
    assert {"llamafactory_packing", "swift_packing"} <= set(splitter_names())
    assert set(SPLITTERS.values()) <= set(splitter_names())


def test_the_package_imports_every_module_that_registers_a_splitter() -> None:
    """Splitters register by being imported, and the package imports each by name: a module that
    registers one and is not imported in ``splitters/__init__.py`` would never be registered."""
    package = Path(splitters.__file__).parent
    imported = {
        node.module.rsplit(".", 1)[1]
        for node in ast.walk(ast.parse((package / "__init__.py").read_text()))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(splitters.__name__ + ".")
    }
    registering = {
        path.stem for path in package.glob("*.py") if path.stem != "base" and "@register_splitter(" in path.read_text()
    }
    assert registering, f"no splitter modules found in {package}"
    assert registering <= imported, f"splitter modules not imported by the package: {sorted(registering - imported)}"


@settings(max_examples=25, deadline=None)
@given(n_mb=st.integers(1, 4), dp=st.integers(1, 3), extra=st.integers(0, 9), seed=st.integers(0, 2**16))
def test_every_splitter_returns_each_sample_exactly_once(n_mb: int, dp: int, extra: int, seed: int) -> None:
    n = n_mb * dp + extra
    shapes = shapes_of(n, seed)
    batch = np.random.default_rng(seed).permutation(1000)[:n].tolist()  # dataset indices, not positions
    costs = ProxyCost().predict_samples(shapes)
    for name in splitter_names():
        result = make_splitter(name).split(SplitRequest(batch, costs, n_mb, dp, shapes=shapes, seed=seed))
        assert len(result.ranks) == dp and all(len(rank) == n_mb and all(rank) for rank in result.ranks), name
        assert sorted(i for rank in result.ranks for mb in rank for i in mb) == sorted(batch), name
        assert result.predicted.shape[:2] == (dp, n_mb), name
        assert result.makespan == pytest.approx(result.predicted.max())


def test_stock_cuts_contiguous_equal_counts_larger_first() -> None:
    result = make_splitter("stock").split(SplitRequest(list(range(10, 21)), np.ones(11), 2, 2))
    assert result.ranks == [[[10, 11, 12], [13, 14, 15]], [[16, 17, 18], [19, 20]]]


def test_stock_split_is_what_the_planner_evaluates() -> None:
    """The planner's monolithic baseline scores the very microbatches the stock sampler trains,
    including a batch that does not divide into equal microbatches."""
    model, cluster = reference_model("llava-ov-7b-a100"), Cluster(gpus=8)
    shapes = shapes_of(60, seed=4)
    costs = np.asarray(model.predict_samples(shapes), dtype=float)
    stages = separate_stages(model.encoder_layers, model.llm_layers, 1, 1)
    layout = Layout(
        Segment(1, 2, 2), Segment(1, 2, 2), 4, ((stages[0][0], 1, 0), (0, 0, model.llm_layers)), splitter="stock"
    )
    for size in (40, 43):
        batch = np.random.default_rng(size).permutation(len(shapes))[:size]
        planned = evaluate(model, cluster, layout, [shapes[i] for i in batch], costs[batch]).order
        sampler = make_sampler(
            SamplerSettings("stock", prefetch=0),
            shapes,
            global_batch_size=size,
            gradient_accumulation_steps=4,
            dp_size=2,
            cost_model=model,
        )
        trained = sampler.split(batch, costs[batch], batch_seed=0).ranks
        assert [[[int(batch[p]) for p in mb] for mb in rank] for rank in planned] == trained
        methods = split_for("stock", batch.tolist(), shapes, costs[batch], 4, 2)
        assert methods == trained


def sched_seed(epoch: int, batch_id: int, seed: int = 0) -> int:
    """The seed the sampler gives the splitter of one global batch."""
    return seed * 1_000_003 + epoch * 10_007 + batch_id


def rank0_sampler(name: str, shapes: list[SampleShape], cost_model: Any = None, **options) -> GlobalBatchSampler:
    """Rank 0's sampler ``name`` of 2 data-parallel ranks, 16 samples in 2 microbatches per rank,
    scheduled inline, for ranks that meet every microbatch; ``options`` go to :class:`SamplerSettings`."""
    return make_sampler(
        SamplerSettings(name, prefetch=0, **options),
        shapes,
        global_batch_size=16,
        gradient_accumulation_steps=2,
        dp_size=2,
        dp_rank=0,
        cost_model=cost_model,
        sync="microstep",
    )


@pytest.mark.parametrize("name", ["llava", "verl"])
def test_a_baseline_trains_through_the_sampler_by_name(name: str) -> None:
    shapes = shapes_of(40, seed=1)
    sampler = rank0_sampler(name, shapes, time_limit_s=1.0)  # dflop's options are dropped
    assert isinstance(sampler, SplitterSampler) and sampler.state_dict()["method"] == name
    sched = sampler.schedule(0, 0, sampler.batches_in_epoch(0)[0])
    assert sched.split.solver == name
    assert sorted(i for rank in sched.split.ranks for mb in rank for i in mb) == sorted(sampler.batches_in_epoch(0)[0])
    assert sched.split.ranks == split_for(
        name,
        sampler.batches_in_epoch(0)[0].tolist(),
        shapes,
        sampler.costs[sampler.batches_in_epoch(0)[0]],
        2,
        2,
        seed=sched_seed(0, 0),
    )


def test_unknown_and_duplicate_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown splitter 'nope'.*stock"):
        make_splitter("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_splitter("stock")(type("Other", (), {"name": "stock"}))


def test_a_splitter_that_loses_a_sample_is_caught() -> None:
    with pytest.raises(ValueError, match="'broken' did not place each of the 4 samples exactly once"):
        check_split([[[0, 1], [1, 3]]], 4, 2, 1, "broken")
    with pytest.raises(ValueError, match="empty microbatch"):
        check_split([[[0, 1, 2, 3], []]], 4, 2, 1, "broken")


def test_requests_are_checked() -> None:
    with pytest.raises(ValueError, match="cannot fill 3 microbatches on each of 2 ranks"):
        SplitRequest([0, 1, 2], np.ones(3), 3, 2)
    with pytest.raises(ValueError, match="verl.*shapes"):
        make_splitter("verl").split(SplitRequest([0, 1], np.ones(2), 1, 2))


def test_plans_name_their_splitter_and_read_the_old_flag(tmp_path) -> None:
    layout = Layout(Segment(1, 1, 2), Segment(1, 1, 2), 2, ((4, 1, 6),), splitter="verl")
    assert layout_from_dict(layout_to_dict(layout)) == layout
    old = {**layout_to_dict(layout), "balanced": False}
    del old["splitter"]
    assert layout_from_dict(old).splitter == "stock"
    plan = Plan.from_layout(
        layout,
        layer_counts={"encoder": 4, "projector": 1, "llm": 6},
        global_batch_size=8,
        gpus=2,
        gpus_per_node=2,
        gpu_memory_bytes=1e9,
        family="deepspeed",
    )
    assert plan.dflop_settings()["sampler"] == "verl"
    data = plan.to_dict()
    data["splitter"] = "fancy"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match="splitter 'fancy' is not registered"):
        Plan.load(path)


@pytest.mark.parametrize("method", ["stock", "stock_packed", "verl", "dflop"])
def test_a_benchmark_method_schedules_as_its_sampler(method: str) -> None:
    """bench-hf's samplers (the method's splitter on :func:`method_cost_model`) cut a batch as
    bench-e2e's :func:`split_for` does; packed methods on the packed cost, padded ones not."""
    shapes = shapes_of(40, seed=2)
    cost = reference_model("llava-ov-7b-a100")
    cost_model = method_cost_model(method, cost)
    assert isinstance(cost_model, PackedCost) == (method in PACKED_METHODS)
    sampler = rank0_sampler(SPLITTERS[method], shapes, cost_model=cost_model, time_limit_s=0.0)
    batch = sampler.batches_in_epoch(0)[0]
    group = [shapes[i] for i in batch]
    split = split_for(
        method,
        batch.tolist(),
        shapes,
        cost_model.predict_samples(shapes)[batch],
        2,
        2,
        microbatch_cost=lambda pos: cost.predict_microbatch([group[p] for p in pos]),
        seed=sched_seed(0, 0),
        sync="microstep",
    )
    assert sampler.schedule(0, 0, batch).split.ranks == split
    with pytest.raises(ValueError, match="unknown method 'fancy'"):
        method_cost_model("fancy", cost)
