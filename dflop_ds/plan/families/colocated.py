"""The ``colocated`` family: the vision encoder data-parallel over every GPU, outside the LLM pipeline.

Every GPU holds an encoder replica (``E_dp = GPUs``, ``E_pp = E_tp = 1``); the LLM keeps its own
``(tp, pp, dp)`` in the DeepSpeed engine, its stages split over the projector and the LLM layers
only. One step (``dflop.model.encoder = "colocated"``, :mod:`dflop_ds.train.colocated`):

1. the encoder forward, its work dispatched by predicted cost over all GPUs: a micro-step costs
   its encoder seconds over the GPUs, or its heaviest tile (the dispatch unit) if that is longer;
2. the feature exchange (a variable all-to-all): each first-stage rank receives the features of
   its own samples (visual tokens x the encoder's hidden bytes per token) from the other GPUs;
3. the LLM pipeline (1F1B; microbatches balanced on the LLM alone, as the sampler does with
   ``LLMOnlyCost``), the projector on the first stage; a single LLM stage meets as the cluster's
   ZeRO stage makes it (:meth:`~dflop_ds.plan.cluster.Cluster.sync_model`);
4. the gradients back over the same exchange, the encoder backward, and the encoder's gradient
   all-reduce over every GPU.

Memory per GPU: its LLM stage's as in a shared pipeline, plus the encoder replica's training
state (optimizer sharded over all GPUs under ZeRO) and the encoder activations it keeps: one
micro-step's share without a pipeline, the whole step's share with one (the encoder phase runs
before the pipeline).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from dflop_ds.cost import PlannerCostModel, SampleColumns
from dflop_ds.plan.cluster import Cluster
from dflop_ds.plan.evaluate import Buckets, Evaluation, _stats, forward_fraction, split_batch
from dflop_ds.plan.families.core import BatchStats, Family, Key, SearchInputs, pipeline_grid, rank_estimates
from dflop_ds.plan.families.pipeline import memory_aware_bounds
from dflop_ds.plan.layout import Layout, Segment, flat_bounds, stages_from_bounds
from dflop_ds.plan.simulator import simulate_colocated
from dflop_ds.plan.stages import layer_costs, segment_layer_shares, stage_shares
from dflop_ds.shapes import SampleShape


def exchange_seconds(cluster: Cluster, received_bytes: Any) -> Any:
    """One direction of the feature all-to-all, as its busiest receiver: ``received_bytes`` less
    its own share (``1 / GPUs``) over the link to the farthest GPU (elementwise over arrays)."""
    g = cluster.gpus
    return cluster.p2p_seconds(np.asarray(received_bytes, dtype=float) * (1.0 - 1.0 / g), max(g - 1, 0))


def projector_share(model: PlannerCostModel) -> float:
    """Share of the encoder time the projector takes (it runs on the first LLM stage)."""
    return float(segment_layer_shares(model)[0][-1])


def encoder_state_bytes(model: PlannerCostModel, cluster: Cluster) -> float:
    """Training-state bytes of an encoder replica on every GPU (data parallel over all of them)."""
    return float(model.param_bytes["encoder"] * cluster.state_factor(cluster.gpus))


def colocated_estimates(
    model: PlannerCostModel, cluster: Cluster, data: BatchStats, grid: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Step-time and first-stage memory estimates of colocated layouts (rows ``(tp, pp, dp, n_mb)`` of ``grid``)."""
    L, G = model.llm_layers, cluster.gpus
    pb = model.param_bytes
    tp, pp, dp, m = (grid[:, i].astype(float) for i in range(4))
    sp = cluster.tp_speedup(tp)
    slots = dp * m
    proj = projector_share(model)
    llm_work = data.work[1] + proj * data.work[0]
    d_mean = (llm_work / pp + 0.5 * data.work[1] / L) / (slots * sp)
    d_heavy = (data.heavy[1] + proj * data.heavy[0]) / pp / sp
    stage_w = (pb["projector"] + pb["llm"]) / pp
    pipe = (
        np.maximum(m * d_mean, d_heavy)
        + (pp - 1) * np.maximum(d_mean, d_heavy)
        + cluster.allreduce_seconds(stage_w / tp, dp, tp)
    )
    encoder = data.work[0] * (1.0 - proj) / G
    exchange = 2.0 * exchange_seconds(cluster, data.feature_bytes / dp)
    est = encoder + exchange + pipe + cluster.allreduce_seconds(pb["encoder"], G, 1)
    per_mb = np.maximum(data.batch / slots, 1.0)
    act_llm = np.maximum(per_mb * data.act_mean[1], data.act_heavy[1]) / pp / tp
    enc_act = data.act_mean[0] * data.batch / G / np.where(pp == 1, m, 1.0)
    mem = (
        encoder_state_bytes(model, cluster)
        + enc_act
        + stage_w / tp * cluster.state_factor(dp)
        + np.minimum(pp, m) * act_llm
        + np.maximum(data.work_bytes[0], data.work_bytes[1] / tp)
    )
    return est, mem


class ColocatedFamily(Family):
    """The encoder over every GPU, the LLM pipeline over the LLM layers (see the module docstring)."""

    name = "colocated"
    balanced = True

    def __init__(self) -> None:
        self.evaluate = evaluate_colocated

    def ranked(self, inputs: SearchInputs, limit: int) -> tuple[list[tuple[float, Key]], int]:
        """See :meth:`Family.ranked`."""
        grid = pipeline_grid(inputs.cluster, 1 + inputs.model.llm_layers, inputs.global_batch, inputs.nmb_choices)
        if len(grid) == 0:
            return [], 0
        est, mem = colocated_estimates(inputs.model, inputs.cluster, inputs.data, grid)
        return rank_estimates(grid, est, mem, inputs.cluster, limit), len(grid)

    def build(self, inputs: SearchInputs, key: Key) -> Layout | None:
        """See :meth:`Family.build`: the projector and LLM layers split by cost within memory."""
        tp, pp, dp, m = key
        model, cluster, data = inputs.model, inputs.cluster, inputs.data
        E, L, G = model.encoder_layers, model.llm_layers, cluster.gpus
        pb = model.param_bytes
        sf = cluster.state_factor(dp)
        act_llm = max(max(data.batch / (dp * m), 1.0) * data.act_mean[1], data.act_heavy[1])
        enc_act = data.act_mean[0] * data.batch / G / (m if pp == 1 else 1)
        fixed = encoder_state_bytes(model, cluster) + enc_act + max(data.work_bytes[0], data.work_bytes[1] / tp)
        bounds = memory_aware_bounds(
            layer_costs(data.work.tolist(), model)[E:],
            [pb["projector"] * sf / tp] + [pb["llm"] / L * sf / tp] * L,
            [0.0] + [act_llm / L / tp] * L,
            pp,
            m,
            fixed,
            cluster.usable_memory,
        )
        if bounds is None:
            return None
        stages = stages_from_bounds([0] + [E + b for b in bounds[1:]], E, 1, L)
        return Layout(Segment(1, 1, G), Segment(tp, pp, dp), m, stages, colocated=True)


def evaluate_colocated(
    model: PlannerCostModel,
    cluster: Cluster,
    layout: Layout,
    shapes: Sequence[SampleShape] | SampleColumns,
    costs: np.ndarray,
    *,
    fast: bool = True,
    seed: int = 0,
) -> Evaluation:
    """Split one global batch (``shapes``, or their :class:`~dflop_ds.cost.SampleColumns`) for a
    colocated ``layout`` and simulate its step.

    The microbatches balance the LLM pipeline alone (the encoder's work is dispatched apart), as
    the sampler does: :func:`~dflop_ds.plan.evaluate.split_batch` of the same pipeline without
    encoder layers.
    """
    if not layout.colocated:
        raise ValueError(f"layout {layout.describe()} is not colocated")
    stages = tuple((0, projector, llm) for _, projector, llm in layout.stages)
    llm_only = replace(layout, encoder=layout.llm, stages=stages, colocated=False)
    columns = SampleColumns.of(shapes)
    order = split_batch(
        llm_only, columns.shapes, costs, fast=fast, seed=seed, cluster=cluster, model=model, columns=columns
    )
    return colocated_step(model, cluster, layout, columns, order)


def colocated_step(
    model: PlannerCostModel,
    cluster: Cluster,
    layout: Layout,
    batch: Sequence[SampleShape] | SampleColumns,
    order: list[Buckets],
) -> Evaluation:
    """Simulate one step of a colocated ``layout`` whose LLM microbatches are ``order[r][j]``
    (indices into ``batch``: shapes, or their columns) and predict its memory per stage."""
    tp, dp, G, p = layout.llm.tp, layout.llm.dp, cluster.gpus, layout.n_stages
    speed = cluster.tp_speedup(tp)
    llm_frac = np.array([s[2] for s in layout.stages], float) / model.llm_layers
    on_projector = np.array([s[1] for s in layout.stages], float)
    columns = SampleColumns.of(batch)
    st = _stats(model, columns, order)
    proj = projector_share(model)
    llm_share = stage_shares(flat_bounds(layout.stages), model)[:, 1]
    total = (st.time[..., 0][..., None] * proj * on_projector + st.time[..., 1][..., None] * llm_share) / speed
    ff = forward_fraction(model)
    comm = np.repeat(cluster.p2p_seconds(st.llm_bytes / tp, tp * dp)[..., None], max(p - 1, 0), axis=2)
    params = model.param_bytes
    weights = params["projector"] * on_projector + params["llm"] * llm_frac
    encoder = encoder_phase_seconds(model, columns, order, G)
    sim = simulate_colocated(
        total * ff,
        total * (1.0 - ff),
        encoder_fwd=ff * encoder,
        encoder_bwd=(1.0 - ff) * encoder,
        exchange=float(np.sum(exchange_seconds(cluster, st.enc_bytes.max(axis=0)))),
        act_comm=comm,
        allreduce=cluster.allreduce_seconds(weights / tp, dp, tp),
        encoder_allreduce=cluster.allreduce_seconds(params["encoder"], G, 1),
        sync=cluster.sync_model(p),
    )
    act = (st.act[..., 1][..., None] * llm_frac).reshape(-1, p).max(axis=0) / tp
    held = st.act[..., 0].sum(axis=0) / G  # encoder activations per GPU of each micro-step
    enc_act = float(held.max() if p == 1 else held.sum())
    work = max(float(st.work[..., 0].max()), float(st.work[..., 1].max()) / tp)
    static = weights / tp * cluster.state_factor(dp) + encoder_state_bytes(model, cluster)
    memory = static + np.minimum(p - np.arange(p), layout.n_mb) * act + enc_act + work
    return Evaluation.of_step(sim, memory, cluster, order, static)


def encoder_phase_seconds(
    model: PlannerCostModel, batch: Sequence[SampleShape] | SampleColumns, order: list[Buckets], gpus: int
) -> float:
    """Forward+backward encoder seconds of the step on the busiest GPU: every micro-step's encoder
    work (projector excluded) over ``gpus``, or its heaviest tile when that is longer (``order``:
    indices into ``batch``, shapes or their columns)."""
    columns = SampleColumns.of(batch)
    proj = projector_share(model)
    encoder = np.asarray(model.predict_samples(columns.shapes), dtype=float)[:, 0] * (1.0 - proj)
    per_tile = encoder / np.maximum(columns.tiles, 1)
    seconds = 0.0
    for j in range(len(order[0])):
        items = [i for rank in order for i in rank[j]]
        seconds += max(float(encoder[items].sum()) / gpus, float(per_tile[items].max(initial=0.0)))
    return seconds


COLOCATED = ColocatedFamily()
