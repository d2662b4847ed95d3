"""The planner's front door: search, turn the winners into :class:`Plan` objects, re-simulate plans."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dflop_ds.cost import PlannerCostModel
from dflop_ds.plan.cluster import Cluster
from dflop_ds.plan.evaluate import Evaluation
from dflop_ds.plan.families import family_of
from dflop_ds.plan.layout import Layout
from dflop_ds.plan.plan_file import Plan, layout_to_dict
from dflop_ds.plan.search import PlanError, Scored, SearchResult, sample_batches, search
from dflop_ds.shapes import SampleShape


@dataclass
class PlanSet:
    """Plans from one search.

    Attributes:
        best: best plan overall (the faster of the shared-pipeline and colocated ones).
        best_deepspeed: best shared-pipeline plan (encoder and LLM layers in one pipeline).
        monolithic: the stock baseline plan (uniform split, fixed-size microbatches), or None
            when no such layout fits in memory.
        result: the underlying :class:`SearchResult`.
        colocated: best colocated plan (encoder data-parallel over every GPU), or None.
    """

    best: Plan
    best_deepspeed: Plan
    monolithic: Plan | None
    result: SearchResult
    colocated: Plan | None = None


def describe_cost_model(model: PlannerCostModel) -> dict[str, Any]:
    """Name and provenance of a cost model for plan files and printouts."""
    analytic = bool(model.is_analytic)
    return {
        "name": str(model.name),
        "is_analytic": analytic,
        "note": "analytic: FLOP counts and stated throughput, not measured" if analytic else "measured",
    }


def activation_budget(scored: Scored, cluster: Cluster) -> float:
    """The activation bytes one device may hold under ``scored``'s layout, in the cost model's
    sizes (tensor parallelism 1): the usable memory of a GPU less the largest stage's model states,
    times the tensor-parallel degree (each GPU keeps ``1 / tp`` of the activations). What the
    plan writes as ``memory_cap_bytes``; the plan's own microbatches fit under it."""
    states = max(float(e.states.max()) for e in scored.evaluations)
    return max(cluster.usable_memory - states, 0.0) * scored.layout.llm.tp


def _plan(model: PlannerCostModel, cluster: Cluster, global_batch: int, scored: Scored, result: SearchResult) -> Plan:
    predicted = {
        "step_time_s": scored.step_time,
        "step_times_s": list(scored.step_times),
        "bubble_fraction": scored.bubble_fraction,
        "peak_memory_bytes": [float(x) for x in scored.memory],
        "monolithic_step_time_s": None if result.monolithic is None else result.monolithic.step_time,
        "speedup_vs_monolithic": result.speedup(scored),
        "best_step_time_s": result.best.step_time,
        "sampled_batches": len(scored.step_times),
        "search_s": result.seconds,
        "is_analytic": bool(model.is_analytic),
        "sync_model": str(cluster.sync_model(scored.layout.n_stages)),
    }
    return Plan.from_layout(
        scored.layout,
        layer_counts={"encoder": model.encoder_layers, "projector": 1, "llm": model.llm_layers},
        global_batch_size=global_batch,
        gpus=cluster.gpus,
        gpus_per_node=cluster.gpus_per_node,
        gpu_memory_bytes=cluster.gpu_memory_bytes,
        family=scored.family,
        predicted=predicted,
        cost_model=describe_cost_model(model),
        zero_stage=cluster.zero_stage,
        precision=cluster.precision,
        activation_checkpointing=bool(model.activation_checkpointing),
        memory_cap_bytes=activation_budget(scored, cluster) or None,
    )


def has_tensor_parallel_layers(model: PlannerCostModel) -> bool:
    """Whether the cost model's model has layers DeepSpeed AutoTP can shard (its
    ``tensor_parallel_layers``; False for a profiled model, e.g. the bundled tiny model's)."""
    return bool(model.tensor_parallel_layers)


def cluster_for_model(cluster: Cluster, tensor_parallel_layers: bool) -> Cluster:
    """``cluster`` with ``max_tp`` decided for a model: left unset (None) it becomes
    ``gpus_per_node`` for a model with tensor-parallel layers and 1 for one without.

    Raises:
        PlanError: ``max_tp > 1`` was asked for a model without tensor-parallel layers.
    """
    if cluster.max_tp is None:
        return replace(cluster, max_tp=cluster.gpus_per_node if tensor_parallel_layers else 1)
    if cluster.max_tp > 1 and not tensor_parallel_layers:
        raise PlanError(
            f"max_tp={cluster.max_tp}: the model has no tensor-parallel layers (DeepSpeed AutoTP shards"
            " a HuggingFace model with a tp_plan; the bundled tiny model has none), so no plan with"
            " tensor parallelism could run; plan with max_tp=1"
        )
    return cluster


def make_plans(
    model: PlannerCostModel,
    cluster: Cluster,
    shapes: Sequence[SampleShape],
    global_batch: int,
    *,
    tensor_parallel_layers: bool | None = None,
    **search_kwargs: Any,
) -> PlanSet:
    """Search (see :func:`dflop_ds.plan.search.search`) and return the plans.

    ``cluster.max_tp`` is decided by :func:`cluster_for_model` from ``tensor_parallel_layers``
    (None: :func:`has_tensor_parallel_layers` of ``model``). Every plan records the monolithic
    baseline's layout, so ``simulate`` can redraw both, and the ZeRO stage, precision and
    activation checkpointing its memory model assumed.
    """
    if tensor_parallel_layers is None:
        tensor_parallel_layers = has_tensor_parallel_layers(model)
    cluster = cluster_for_model(cluster, tensor_parallel_layers)
    result = search(model, cluster, shapes, global_batch, **search_kwargs)
    chosen = (result.best, result.best_deepspeed, result.monolithic, result.best_colocated)
    plans = [None if s is None else _plan(model, cluster, global_batch, s, result) for s in chosen]
    if result.monolithic is not None:
        baseline = layout_to_dict(result.monolithic.layout)
        for p in plans:
            if p is not None:
                p.baseline = baseline
    best, best_deepspeed = plans[0], plans[1]
    assert best is not None and best_deepspeed is not None  # search raises PlanError otherwise
    return PlanSet(best=best, best_deepspeed=best_deepspeed, monolithic=plans[2], result=result, colocated=plans[3])


def cluster_of(plan: Plan, **overrides: Any) -> Cluster:
    """The cluster a plan was made for (link and memory assumptions at their defaults unless overridden)."""
    fields: dict[str, Any] = {
        "gpus": plan.gpus,
        "gpus_per_node": plan.gpus_per_node,
        "gpu_memory_bytes": plan.gpu_memory_bytes,
        "zero_stage": plan.zero_stage,
        "precision": plan.precision,
    }
    fields.update(overrides)
    return Cluster(**fields)


def simulate_layout(
    model: PlannerCostModel,
    cluster: Cluster,
    layout: Layout,
    shapes: Sequence[SampleShape],
    global_batch: int,
    *,
    n_batches: int = 1,
    seed: int = 0,
    fast: bool = False,
) -> list[Evaluation]:
    """Simulate ``layout`` on ``n_batches`` global batches drawn from ``shapes`` (same draws as the search)."""
    pool = list(getattr(shapes, "shapes", shapes))  # a DataProfile or a list of shapes
    costs = np.asarray(model.predict_samples(pool), dtype=float)
    family = family_of(layout)
    return [
        family.evaluate(model, cluster, layout, [pool[j] for j in b], costs[b], fast=fast, seed=seed + i)
        for i, b in enumerate(sample_batches(len(pool), global_batch, n_batches, seed))
    ]
