"""What every family of the search shares: the sampled batches and their statistics, scoring a
layout on them, and the estimate -> simulate -> refine loop.

A family is a :class:`Family`: it enumerates its layouts as keys ``(tp, pp, dp, n_mb)`` of one
DeepSpeed topology (``tp * pp * dp = GPUs``, ``dp * n_mb`` dividing the global batch, so
DeepSpeed's ``train_batch_size`` equals it), ranks them by a vectorised estimate with a memory
estimate, builds the :class:`Layout` of a key and evaluates a layout on one global batch.
:func:`explore` then simulates the best estimates on one batch, tries other microbatch counts
for the best layouts, and scores those close to the family's best on the other batches.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from dflop_ds.cost import (
    Microbatches,
    PlannerCostModel,
    SampleColumns,
    microbatch_activation_bytes,
    microbatch_working_bytes,
)
from dflop_ds.plan.cluster import Cluster
from dflop_ds.plan.evaluate import Evaluation
from dflop_ds.plan.layout import Layout
from dflop_ds.shapes import SampleShape

DEFAULT_NMB = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
Key = tuple[int, ...]  # (tp, pp, dp, n_mb) of the LLM pipeline


class PlanError(ValueError):
    """No layout fits the cluster (memory, GPU count or batch size)."""


@dataclass
class Scored:
    """A simulated layout.

    Attributes:
        layout: the layout.
        family: the family's name (``"deepspeed"``, ``"colocated"`` or ``"monolithic"``).
        step_time: mean simulated step seconds over the sampled batches.
        step_times: per batch.
        bubble_fraction: mean pipeline idle share (slowest rank).
        memory: ``(n_stages,)`` peak bytes per GPU of each stage over the batches.
        estimate: the analytic estimate that ranked it.
        evaluations: the per-batch evaluations, compacted (:meth:`Evaluation.compact`: no timelines
            or microbatches; :func:`~dflop_ds.plan.planner.simulate_layout` redraws them).
    """

    layout: Layout
    family: str
    step_time: float
    step_times: list[float]
    bubble_fraction: float
    memory: np.ndarray
    estimate: float
    evaluations: list[Evaluation] = field(repr=False, default_factory=list)

    @property
    def feasible(self) -> bool:
        """Every batch fitted in memory."""
        return all(e.feasible for e in self.evaluations)


def sample_batches(n_pool: int, global_batch: int, n_batches: int, seed: int) -> list[np.ndarray]:
    """``n_batches`` random global batches (indices into the pool; with replacement only if the pool is smaller)."""
    if n_pool < 1:
        raise PlanError("no sample shapes to draw global batches from")
    rng = np.random.default_rng(seed)
    replace = n_pool < global_batch
    return [rng.choice(n_pool, size=global_batch, replace=replace) for _ in range(n_batches)]


@dataclass
class BatchStats:
    """Batch statistics the estimates use (seconds at tp=1, bytes over the whole depth)."""

    batch: int
    work: np.ndarray  # (2,) mean per-batch seconds [enc, llm]
    heavy: np.ndarray  # (2,) seconds of the heaviest sample
    act_mean: np.ndarray  # (2,) mean activation bytes per sample
    act_heavy: np.ndarray  # (2,) largest single-sample activation bytes
    work_bytes: np.ndarray  # (2,) largest single-sample one-layer working bytes
    llm_sorted: np.ndarray  # per-sample LLM seconds of the sampled batches, ascending
    feature_bytes: float  # mean per-batch bytes of the encoder's output features

    def padded_llm_work(self, k: np.ndarray) -> np.ndarray:
        """Expected LLM seconds of a batch cut into random microbatches of ``k`` samples, each
        padded to its longest: ``batch * E[max of k sample costs]`` (order statistics)."""
        c = self.llm_sorted
        n = len(c)
        ks, inverse = np.unique(np.asarray(k, dtype=float), return_inverse=True)
        frac = np.arange(n + 1) / n
        cdf = frac[None, :] ** ks[:, None]  # P(max of k <= c_(i))
        expected_max = (cdf[:, 1:] - cdf[:, :-1]) @ c
        return self.batch * expected_max[inverse]


def batch_stats(
    model: PlannerCostModel, pool: Sequence[SampleShape], costs: np.ndarray, batches: list[np.ndarray]
) -> BatchStats:
    """The :class:`BatchStats` of ``batches`` (indices into ``pool``, per-sample ``costs``)."""
    columns = SampleColumns.of(pool)
    used = np.unique(np.concatenate(batches))
    alone = Microbatches.of(columns, [[i] for i in used.tolist()])  # each used sample a microbatch of its own
    act = microbatch_activation_bytes(model, alone)
    work = microbatch_working_bytes(model, alone).max(axis=0)
    feature_bytes_per_token = float(model.encoder_hidden_bytes_per_token)  # the encoder's output features
    return BatchStats(
        batch=len(batches[0]),
        work=np.mean([costs[b].sum(axis=0) for b in batches], axis=0),
        heavy=costs[used].max(axis=0),
        act_mean=act.mean(axis=0),
        act_heavy=act.max(axis=0),
        work_bytes=work,
        llm_sorted=np.sort(np.concatenate([costs[b, 1] for b in batches])),
        feature_bytes=float(np.mean([feature_bytes_per_token * columns.visual[b].sum() for b in batches])),
    )


@dataclass
class SearchInputs:
    """Everything a family reads: the model, the cluster, the data and the search's settings."""

    model: PlannerCostModel
    cluster: Cluster
    pool: list[SampleShape]
    costs: np.ndarray  # (len(pool), 2) per-sample seconds
    batches: list[np.ndarray]
    data: BatchStats
    global_batch: int
    nmb_choices: Sequence[int]
    #: each batch's samples as :class:`~dflop_ds.cost.SampleColumns` (made once: every scored
    #: layout splits and times the same few batches)
    batch_columns: list[SampleColumns] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.batch_columns = [SampleColumns.of([self.pool[j] for j in b]) for b in self.batches]


def pipeline_grid(cluster: Cluster, n_layers: int, batch: int, nmb: Sequence[int]) -> np.ndarray:
    """(tp, pp, dp, n_mb) of one DeepSpeed pipeline of at most ``n_layers`` stages using every GPU,
    with ``dp * n_mb`` dividing ``batch`` (DeepSpeed's ``train_batch_size`` is the global batch)."""
    rows: list[tuple[int, int, int, int]] = []
    for tp in cluster.tp_degrees():
        if cluster.gpus % tp:
            continue
        rest = cluster.gpus // tp
        for pp in range(1, min(n_layers, rest) + 1):
            if rest % pp or not cluster.runs_shared(tp, pp):
                continue
            dp = rest // pp
            rows.extend((tp, pp, dp, m) for m in nmb if dp * m <= batch)
    grid = np.array(rows, dtype=np.int64).reshape(-1, 4)
    return grid[batch % (grid[:, 2] * grid[:, 3]) == 0]


def rank_estimates(
    grid: np.ndarray, est: np.ndarray, mem: np.ndarray, cluster: Cluster, limit: int
) -> list[tuple[float, Key]]:
    """The ``limit`` best rows of ``grid`` within the memory estimate, best first; ties (common:
    with pp = 1 the estimate ignores n_mb) go to more, smaller microbatches."""
    ok = np.flatnonzero(mem <= cluster.usable_memory)
    ok = ok[np.lexsort((-grid[ok, 3], est[ok]))][:limit]
    return [(float(est[i]), tuple(int(x) for x in grid[i])) for i in ok]


def layout_key(layout: Layout) -> Key:
    """The search key of a layout: ``(tp, pp, dp, n_mb)`` of its LLM pipeline."""
    return (layout.llm.tp, layout.n_stages, layout.llm.dp, layout.n_mb)


class Family(ABC):
    """One family of layouts: its space, estimate, layouts and evaluation."""

    name: str
    balanced: bool  # microbatches from our scheduler: re-scored with partition_batch at the end

    @abstractmethod
    def ranked(self, inputs: SearchInputs, limit: int) -> tuple[list[tuple[float, Key]], int]:
        """``(ranked, n_layouts)``: at most ``limit`` ``(estimate, key)`` within the memory
        estimate, best first, and how many layouts were enumerated."""

    @abstractmethod
    def build(self, inputs: SearchInputs, key: Key) -> Layout | None:
        """The layout of ``key``, or None when its layers cannot be split within memory."""

    #: ``evaluate(model, cluster, layout, shapes, costs, *, fast, seed) -> Evaluation``: split one
    #: global batch (``shapes``, or their :class:`~dflop_ds.cost.SampleColumns`, per-sample
    #: ``costs``) for ``layout`` and simulate the step
    evaluate: Callable[..., Evaluation]

    def valid(self, inputs: SearchInputs, key: Key) -> bool:
        """``dp * n_mb`` divides the global batch (DeepSpeed's ``train_batch_size`` equals it)."""
        return inputs.global_batch % (key[2] * key[3]) == 0


def score(
    family: Family,
    inputs: SearchInputs,
    layout: Layout,
    n_batches: int,
    estimate: float,
    *,
    fast: bool,
    seed: int,
    done: Sequence[Evaluation] = (),
) -> Scored:
    """Evaluate ``layout`` on the first ``n_batches`` of ``inputs.batches`` (after the evaluations
    ``done``), stopping at a memory failure."""
    evals = list(done)
    for i in range(len(evals), n_batches):
        if evals and not evals[-1].feasible:
            break
        evaluation = family.evaluate(
            inputs.model,
            inputs.cluster,
            layout,
            inputs.batch_columns[i],
            inputs.costs[inputs.batches[i]],
            fast=fast,
            seed=seed + i,
        )
        evals.append(evaluation.compact())  # candidates are many: keep no timelines
    times = [e.sim.step_time for e in evals]
    return Scored(
        layout=layout,
        family=family.name,
        step_time=float(np.mean(times)),
        step_times=times,
        bubble_fraction=float(np.mean([e.sim.bubble_fraction for e in evals])),
        memory=np.max([e.memory for e in evals], axis=0),
        estimate=float(estimate),
        evaluations=evals,
    )


def explore(
    family: Family,
    inputs: SearchInputs,
    ranked: list[tuple[float, Key]],
    *,
    top_k: int,
    refine_layouts: int,
    refine_margin: float,
    seed: int,
) -> list[Scored]:
    """Simulate a family's best estimates and refine them (the search's steps 2 and 3 for one family).

    First pass: one batch each, in order of estimate, at most two microbatch counts per layout,
    until ``top_k`` layouts fit in memory. Then the best ``refine_layouts`` layouts with every
    other microbatch count (the estimate ranks them poorly). Last, the remaining batches only for
    layouts within ``refine_margin`` of the family's best.
    """
    scored: list[Scored] = []
    tried: set[Key] = set()

    def simulate(estimate: float, key: Key) -> None:
        layout = family.build(inputs, key)
        tried.add(key)
        if layout is not None:
            scored.append(score(family, inputs, layout, 1, estimate, fast=True, seed=seed))

    per_layout: dict[Key, int] = {}
    for estimate, key in ranked:
        if sum(1 for s in scored if s.feasible) >= top_k:
            break
        if per_layout.get(key[:-1], 0) >= 2:
            continue
        per_layout[key[:-1]] = per_layout.get(key[:-1], 0) + 1
        simulate(estimate, key)
    best_keys: dict[Key, Scored] = {}
    for sc in sorted((s for s in scored if s.feasible), key=lambda s: s.step_time):
        best_keys.setdefault(layout_key(sc.layout)[:-1], sc)
    for group, sc in list(best_keys.items())[:refine_layouts]:
        for m in inputs.nmb_choices:
            other = group + (m,)
            if other not in tried and family.valid(inputs, other):
                simulate(sc.estimate, other)
    fits = [s for s in scored if s.feasible]
    if not fits:
        return scored
    cutoff = (1.0 + refine_margin) * min(s.step_time for s in fits)
    return [
        score(family, inputs, s.layout, len(inputs.batches), s.estimate, fast=True, seed=seed, done=s.evaluations)
        if s.feasible and s.step_time <= cutoff
        else s
        for s in scored
    ]
