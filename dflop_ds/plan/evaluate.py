"""Score one layout on one global batch: split it into microbatches, time every stage, simulate.

Per-stage time of a microbatch = encoder seconds x (stage's encoder layers / encoder depth) +
LLM seconds x (stage's LLM layers / LLM depth), divided by the tensor-parallel speed-up
(layers are identical, as the cost-model contract says). When the encoder runs with a different
dp than the LLM (separate GPU sets), the encoder replicas share the encoding of every slot's
microbatches across all LLM pipelines, so an encoder stage's time per slot is the encoder
seconds of that slot summed over LLM ranks, divided by the encoder dp.

A single-stage layout (``pp = 1``, no pipeline) is scored under the cluster's synchronisation
model (:meth:`~dflop_ds.plan.cluster.Cluster.sync_model`: ranks meet at the accumulation
boundary under ZeRO-0/1, per module under ZeRO-2/3) on its microbatches' ``(encoder, llm)``
seconds, plus the gradient communication; DFLOP's microbatches for it are split for that model.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dflop_ds.cost import (
    Microbatches,
    PlannerCostModel,
    SampleColumns,
    microbatch_activation_bytes,
    microbatch_costs,
    microbatch_working_bytes,
)
from dflop_ds.plan.cluster import Cluster
from dflop_ds.plan.layout import Layout, flat_bounds
from dflop_ds.plan.simulator import SimResult, simulate_1f1b, simulate_synchronised
from dflop_ds.plan.stages import stage_shares
from dflop_ds.schedule.aligned import aligned_split
from dflop_ds.schedule.group_sums import group_sums
from dflop_ds.schedule.padded import padded_lpt
from dflop_ds.schedule.ranks import lockstep_order
from dflop_ds.schedule.splitters import SplitRequest, make_splitter
from dflop_ds.shapes import SampleShape
from dflop_ds.sync import SyncModel, step_cost

Buckets = list[list[int]]
#: Predicted (scaled) seconds ``(2,)`` of microbatches already timed for one batch, by their positions in it
#: (the ``dflop`` splitter re-times the same microbatches often).
MicrobatchTimes = dict[tuple[int, ...], np.ndarray]


@dataclass
class Evaluation:
    """A layout scored on one batch.

    Attributes:
        sim: the simulated step.
        memory: ``(n_stages,)`` predicted peak bytes per GPU of each stage.
        feasible: every stage fits the cluster's usable memory.
        order: ``order[r][j]``: sample indices (into the batch) of rank ``r``'s ``j``-th microbatch.
        states: ``(n_stages,)`` bytes per GPU of each stage's model states (weights, gradients,
            optimizer states): the part of ``memory`` no microbatch changes.
    """

    sim: SimResult
    memory: np.ndarray
    feasible: bool
    order: list[Buckets]
    states: np.ndarray

    @classmethod
    def of_step(
        cls, sim: SimResult, memory: np.ndarray, cluster: Cluster, order: list[Buckets], states: np.ndarray
    ) -> Evaluation:
        """A simulated step whose stages need ``memory`` bytes per GPU, ``states`` of them for model
        states: feasible when every stage fits the cluster's usable memory."""
        feasible = bool(memory.max() <= cluster.usable_memory)
        return cls(sim=sim, memory=memory, feasible=feasible, order=order, states=np.asarray(states, dtype=float))

    def compact(self) -> Evaluation:
        """This evaluation without the simulated timelines and the microbatches (``order`` empty):
        the step time, bubble, memory and feasibility the search ranks candidates by, in a
        fraction of the memory at thousands of GPUs."""
        return replace(self, sim=self.sim.without_timelines(), order=[])


def forward_fraction(model: PlannerCostModel) -> float:
    """Share of forward+backward time spent in the forward: the model's ``forward_fraction``
    (1/3, or 1/4 with recompute; an engine profile's measured share)."""
    return float(model.forward_fraction)


def _greedy_ranks(bucket_costs: np.ndarray, dp: int, n_mb: int) -> list[list[int]]:
    """Greedy rank assignment (the search's inner loop): heaviest buckets first, each to the least-loaded
    rank with room."""
    heap = [(0.0, r) for r in range(dp)]
    ranks: list[list[int]] = [[] for _ in range(dp)]
    heaviest = bucket_costs.max(axis=1)
    weight = heaviest.tolist()
    for b in np.argsort(-heaviest, kind="stable").tolist():
        load, r = heap[0]
        ranks[r].append(b)
        if len(ranks[r]) < n_mb:
            heapq.heapreplace(heap, (load + weight[b], r))  # one sift instead of a pop and a push
        else:
            heapq.heappop(heap)
    return ranks


def fast_balanced_split(
    costs: np.ndarray,
    dp: int,
    n_mb: int,
    *,
    lengths: np.ndarray,
    predict_buckets: Callable[[Buckets], np.ndarray] | None = None,
    sync: SyncModel = SyncModel.PIPELINE,
) -> list[Buckets]:
    """The search's estimate of our scheduler, cheap enough for its inner loop: ``dp * n_mb``
    padding-aware LPT microbatches (:func:`padded_lpt`) with their costs (``predict_buckets``,
    the ``(n, 2)`` costs of a list of microbatches, else summed ``costs``), onto ranks as ``sync``
    needs: for a pipeline the heaviest column first onto the least-loaded rank; at the
    accumulation boundary the same by the summed columns; for ranks that meet every microbatch
    (``microstep``, ``module``) in lockstep (:func:`~dflop_ds.schedule.ranks.lockstep_order`),
    or the microstep-aligned split the ``dflop`` splitter also tries when that is cheaper.
    The chosen plans are re-scored with the ``dflop`` splitter itself (:func:`split_batch` with
    ``fast=False``)."""
    n_buckets = dp * n_mb
    if costs.shape[0] < n_buckets:
        raise ValueError(f"a batch of {costs.shape[0]} samples cannot fill {n_mb} microbatches on {dp} ranks")
    buckets = padded_lpt(costs, lengths, n_buckets)
    if predict_buckets is not None:
        bucket_costs = np.asarray(predict_buckets(buckets), dtype=float)
    else:
        bucket_costs = group_sums(costs, buckets)
    if sync is SyncModel.PIPELINE:
        order = _greedy_ranks(bucket_costs, dp, n_mb)
    elif sync is SyncModel.BOUNDARY:
        order = _greedy_ranks(bucket_costs.sum(axis=1, keepdims=True), dp, n_mb)
    else:
        order = lockstep_order(bucket_costs, dp, n_mb)
    split = [[buckets[b] for b in rank] for rank in order]
    if sync in (SyncModel.MICROSTEP, SyncModel.MODULE):
        split = _best_aligned(split, bucket_costs[np.asarray(order)], costs, dp, n_mb, predict_buckets, sync)
    return split


def _best_aligned(
    split: list[Buckets],
    times: np.ndarray,
    costs: np.ndarray,
    dp: int,
    n_mb: int,
    predict_buckets: Callable[[Buckets], np.ndarray] | None,
    sync: SyncModel,
) -> list[Buckets]:
    """The cheaper under ``sync`` of ``split`` (its microbatches' ``times``, ``(dp, n_mb, c)``) and
    the best start of the microstep-aligned split the ``dflop`` splitter also tries
    (:func:`aligned_split` without its improving rounds, as cheap as the search's inner loop
    needs), timed by ``predict_buckets`` (else summed ``costs``)."""
    columns = costs.sum(axis=1, keepdims=True) if sync is SyncModel.MICROSTEP else costs
    local = aligned_split(columns, dp, n_mb, rounds=0)
    flat = [mb for rank in local for mb in rank]
    if predict_buckets is not None:
        mb_times = np.asarray(predict_buckets(flat), dtype=float)
    else:
        mb_times = group_sums(costs, flat)
    return local if step_cost(mb_times.reshape(dp, n_mb, -1), sync) < step_cost(times, sync) else split


@dataclass
class _MicrobatchStats:
    time: np.ndarray  # (R, m, 2) seconds at tp=1, whole depth
    act: np.ndarray  # (R, m, 2) kept activation bytes, whole depth
    work: np.ndarray  # (R, m, 2) transient bytes of one layer
    enc_bytes: np.ndarray  # (R, m) hidden bytes crossing an encoder cut
    llm_bytes: np.ndarray  # (R, m) hidden bytes crossing an LLM cut


def microbatch_seconds(
    model: PlannerCostModel,
    shapes: Sequence[SampleShape],
    items: Sequence[int],
    known: MicrobatchTimes,
    scale: Any = 1.0,
    summed: bool = False,
) -> np.ndarray:
    """``model.predict_microbatch`` of the samples at positions ``items`` of ``shapes`` times
    ``scale`` (``summed``: the columns' sum, shape ``(1,)``), remembered in ``known`` (the
    splitter asks for the same microbatches again)."""
    key = tuple(items)
    seconds = known.get(key)
    if seconds is None:
        seconds = np.asarray(model.predict_microbatch([shapes[i] for i in items]), dtype=float) * scale
        known[key] = seconds = np.array([sum(seconds.tolist())]) if summed else seconds
    return seconds


def one_sample_microbatches(
    model: PlannerCostModel, columns: SampleColumns, scale: Any = 1.0, summed: bool = False
) -> MicrobatchTimes:
    """:func:`microbatch_seconds` of every sample of ``columns`` alone in a microbatch, keyed as it
    keys them, predicted in one batched call (:func:`~dflop_ds.cost.microbatch_costs`) instead of
    one ``predict_microbatch`` call each: a batch split one sample per microbatch (the rule at
    thousands of GPUs) asks for every one, and those calls were a tenth of a 16384-GPU search."""
    seconds = microbatch_costs(model, Microbatches.singletons(columns)) * scale
    if summed:  # a row's two columns added as microbatch_seconds adds them
        seconds = seconds.sum(axis=1, keepdims=True)
    return {(i,): row for i, row in enumerate(seconds)}


def _stats(
    model: PlannerCostModel, batch: Sequence[SampleShape] | SampleColumns, order: list[Buckets]
) -> _MicrobatchStats:
    """The predictions of every microbatch ``order[r][j]`` of ``batch`` (shapes or their columns), one call per kind."""
    R, m = len(order), len(order[0])
    groups = Microbatches.of(batch, [idx for rank in order for idx in rank])
    columns = groups.columns
    time = microbatch_costs(model, groups).reshape(R, m, 2)
    act = microbatch_activation_bytes(model, groups).reshape(R, m, 2)
    work = microbatch_working_bytes(model, groups).reshape(R, m, 2)
    enc_hbpt = float(model.encoder_hidden_bytes_per_token)
    llm_hbpt = float(model.hidden_bytes_per_token)
    enc_bytes = enc_hbpt * groups.sums(columns.visual).reshape(R, m)
    llm_bytes = llm_hbpt * (groups.sizes * groups.maxima(columns.tokens)).reshape(R, m)
    return _MicrobatchStats(time, act, work, enc_bytes, llm_bytes)


def split_batch(
    layout: Layout,
    shapes: Sequence[SampleShape],
    costs: np.ndarray,
    *,
    fast: bool,
    seed: int,
    cluster: Cluster,
    model: PlannerCostModel,
    columns: SampleColumns | None = None,
) -> list[Buckets]:
    """The microbatches of ``layout`` for one batch (``shapes`` with per-sample ``costs`` ``(n, 2)``;
    ``columns``: the shapes' :class:`~dflop_ds.cost.SampleColumns` when already made):
    ``order[r][j]`` = positions in the batch of rank ``r``'s ``j``-th microbatch.

    A layout whose splitter is not ``"dflop"`` is split by that registered splitter, as the
    sampler would; so is a ``"dflop"`` one unless ``fast`` (then :func:`fast_balanced_split`, the
    search's inner loop). For DFLOP's balancing, the
    two cost columns are scaled to the seconds they add to the heaviest encoder and LLM stage,
    so that the larger column is the one that paces the pipeline; a single stage is split for the
    cluster's synchronisation model (:meth:`~dflop_ds.plan.cluster.Cluster.sync_model`).
    """
    if layout.splitter != "dflop":  # a baseline: exactly the split the sampler and the benchmarks make
        request = SplitRequest.of_positions(costs, shapes, layout.n_mb, layout.llm.dp, seed=seed)
        return make_splitter(layout.splitter).split(request).ranks
    e_frac = max(s[0] for s in layout.stages) / model.encoder_layers
    l_frac = max(s[2] for s in layout.stages) / model.llm_layers
    enc_share = 1.0 if layout.shared else layout.llm.dp / layout.encoder.dp
    scale = np.array(
        [e_frac / cluster.tp_speedup(layout.encoder.tp) * enc_share, l_frac / cluster.tp_speedup(layout.llm.tp)]
    )

    sync = cluster.sync_model(layout.n_stages)
    if fast:
        columns = SampleColumns.of(shapes) if columns is None else columns

        def bucket_costs(buckets: Buckets) -> np.ndarray:
            return microbatch_costs(model, Microbatches.of(columns, buckets)) * scale

        return fast_balanced_split(
            costs * scale, layout.llm.dp, layout.n_mb, lengths=columns.tokens, predict_buckets=bucket_costs, sync=sync
        )
    # At the boundary only rank totals count: the dflop splitter balances the summed columns and
    # places its microbatches by rank totals (assign_to_ranks), which is exactly its pipeline
    # placement of that one summed column. Handing it the summed column gives the same split
    # (tests/test_plan_sync.py) without re-timing every microbatch for both columns, a third of
    # a 16384-GPU search.
    summed = sync is SyncModel.BOUNDARY
    known: MicrobatchTimes = {}
    if len(shapes) == layout.n_mb * layout.llm.dp:  # one sample per microbatch: the splitter times each alone
        known = one_sample_microbatches(model, SampleColumns.of(shapes) if columns is None else columns, scale, summed)

    def microbatch_cost(items: Sequence[int]) -> np.ndarray:
        return microbatch_seconds(model, shapes, items, known, scale, summed)

    scaled = costs * scale
    request = SplitRequest.of_positions(
        scaled.sum(axis=1, keepdims=True) if summed else scaled,
        shapes,
        layout.n_mb,
        layout.llm.dp,
        microbatch_cost=microbatch_cost,
        seed=seed,
        sync=SyncModel.PIPELINE if summed else sync,
    )
    return make_splitter("dflop").split(request).ranks


def evaluate(
    model: PlannerCostModel,
    cluster: Cluster,
    layout: Layout,
    shapes: Sequence[SampleShape] | SampleColumns,
    costs: np.ndarray,
    *,
    fast: bool = True,
    seed: int = 0,
) -> Evaluation:
    """Split ``shapes`` (one global batch, or its :class:`~dflop_ds.cost.SampleColumns`; per-sample
    ``costs``) for ``layout`` and simulate the step."""
    columns = SampleColumns.of(shapes)
    order = split_batch(
        layout, columns.shapes, costs, fast=fast, seed=seed, cluster=cluster, model=model, columns=columns
    )
    st = _stats(model, columns, order)
    stages = layout.stages
    p = len(stages)
    enc_frac = np.array([s[0] for s in stages], float) / model.encoder_layers  # of the layers (memory)
    llm_frac = np.array([s[2] for s in stages], float) / model.llm_layers
    time_share = stage_shares(flat_bounds(stages), model)  # of the time (the model's layer shares)
    segs = [layout.stage_segment(s) for s in range(p)]
    tp = np.array([g.tp for g in segs], float)
    dp = np.array([g.dp for g in segs])
    speed = np.array([cluster.tp_speedup(g.tp) for g in segs])

    enc_time, enc_act, enc_bytes = st.time[..., 0], st.act[..., 0], st.enc_bytes
    if not layout.shared and layout.encoder.dp != layout.llm.dp:
        share = 1.0 / layout.encoder.dp
        enc_time = np.broadcast_to(enc_time.sum(axis=0) * share, enc_time.shape)
        enc_act = np.broadcast_to(enc_act.sum(axis=0) * share, enc_act.shape)
        enc_bytes = np.broadcast_to(enc_bytes.sum(axis=0) * share, enc_bytes.shape)
    total = (enc_time[..., None] * time_share[:, 0] + st.time[..., 1][..., None] * time_share[:, 1]) / speed
    ff = forward_fraction(model)

    comm = np.zeros(total.shape[:2] + (max(p - 1, 0),))
    projector_passed = np.cumsum([stage[1] for stage in stages]) > 0
    for s in range(p - 1):
        nbytes = st.llm_bytes if projector_passed[s] else enc_bytes
        # separate GPU sets: the encoder-to-LLM hand-over leaves the node; one pipeline: the
        # next stage sits tp * dp ranks further (DeepSpeed's pipe-data-model axis order)
        crossing = not layout.shared and segs[s] is not segs[s + 1]
        stride = cluster.gpus_per_node if crossing else int(tp[s] * dp[s])
        comm[..., s] = (
            nbytes / tp[s] / (cluster.intra_node_bw if stride < cluster.gpus_per_node else cluster.inter_node_bw)
        )

    params = model.param_bytes
    weights = np.array(
        [
            params["encoder"] * enc_frac[s] + params["projector"] * stages[s][1] + params["llm"] * llm_frac[s]
            for s in range(p)
        ]
    )
    allreduce = np.array([cluster.allreduce_seconds(weights[s] / tp[s], int(dp[s]), int(tp[s])) for s in range(p)])
    sync = cluster.sync_model(p)
    if sync.pipelined:
        sim = simulate_1f1b(total * ff, total * (1.0 - ff), act_comm=comm, allreduce=allreduce)
    else:  # one stage: the (encoder, llm) seconds of each microbatch, met as the engine meets them
        columns = np.stack([enc_time * time_share[0, 0], st.time[..., 1] * time_share[0, 1]], axis=-1) / speed[0]
        sim = simulate_synchronised(columns, sync, forward_fraction=ff, allreduce=allreduce)

    act = (enc_act[..., None] * enc_frac + st.act[..., 1][..., None] * llm_frac).reshape(-1, p).max(axis=0) / tp
    work = (
        np.maximum(
            np.where(enc_frac > 0, st.work[..., 0].max(), 0.0), np.where(llm_frac > 0, st.work[..., 1].max(), 0.0)
        )
        / tp
    )
    in_flight = np.minimum(p - np.arange(p), layout.n_mb)
    static = np.array([weights[s] / tp[s] * cluster.state_factor(int(dp[s])) for s in range(p)])
    memory = static + in_flight * act + work
    return Evaluation.of_step(sim, memory, cluster, order, static)
