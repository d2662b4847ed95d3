"""Projection: what each way of cutting batches would give on a user's data at a cluster size (a prediction).

For every cluster size, each method runs on the best plan the planner finds for it, and every plan
is simulated (1F1B, :func:`~dflop_ds.plan.planner.simulate_layout`) on the same sampled global
batches of ``batch_per_gpu * GPUs`` samples:

- ``dflop``: dflop-ds as it trains by default: packed microbatches (:class:`~dflop_ds.cost.PackedView`), the
  planner's best plan of any family (cost-balanced stage split, or the colocated encoder);
- the baselines (:data:`METHODS`), each with its registered splitter and padded or packed as its
  users run it (stock DeepSpeed / the HF Trainer, LLaVA's and transformers' ``batch_rebalance``
  pad; verl and ms-swift's packing remove padding; ``stock_packed`` is stock's split packed;
  LLaMA-Factory's packs are scored packed, without the padding of each row to its cutoff, so
  its projected step is a lower bound on the one its users run). A baseline's plan is the
  fastest, in its own simulation, of the best shared-pipeline layouts the planner simulated (the
  ``monolithic`` family's uniform layer split and the ``deepspeed`` family's cost-balanced one,
  with their microbatch counts) searched on its padded or packed costs; layouts whose
  microbatches overflow memory under the baseline's split are skipped.

Single-stage plans (``pp = 1``, the only ones ZeRO-2 and ZeRO-3 run) are scored under the
cluster's sync model (:meth:`~dflop_ds.plan.cluster.Cluster.sync_model`), the same for every
method: each method's microbatches are timed as they are, and ranks meet where the engine makes them.

DFLOP's gain at a size is the best baseline's mean step time over DFLOP's; its spread is the
range of the same ratio batch by batch. Everything here is a prediction of the cost model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dflop_ds.cost import EncoderScaled, PackedView, PlannerCostModel
from dflop_ds.plan.cluster import DEFAULT_GPU_MEMORY_BYTES, Cluster
from dflop_ds.plan.layout import Layout
from dflop_ds.plan.planner import cluster_for_model, has_tensor_parallel_layers, simulate_layout
from dflop_ds.plan.search import PlanError, Scored, SearchResult, search
from dflop_ds.shapes import SampleShape


@dataclass(frozen=True)
class Method:
    """One way of training: its registered splitter and whether its microbatches are packed."""

    name: str
    label: str
    splitter: str
    packed: bool


METHODS = (
    Method("stock", "stock", "stock", packed=False),
    Method("llava", "LLaVA modality grouping", "llava", packed=False),
    Method("verl", "verl (packed)", "verl", packed=True),
    Method("batch_rebalance", "transformers batch_rebalance", "batch_rebalance", packed=False),
    Method("stock_packed", "stock + packing", "stock", packed=True),
    Method("llamafactory_packing", "LLaMA-Factory packing", "llamafactory_packing", packed=True),
    Method("swift_packing", "ms-swift packing", "swift_packing", packed=True),
    Method("dflop", "DFLOP (dflop-ds, packed)", "dflop", packed=True),
)
BASELINES = tuple(m for m in METHODS if m.name != "dflop")
#: the families whose layouts a baseline may run: one pipeline, the encoder in it
SHARED_FAMILIES = ("monolithic", "deepspeed")


def encoder_share(model: PlannerCostModel, shapes: Sequence[SampleShape]) -> float:
    """The encoder's share of the data's work: summed encoder seconds over summed total seconds."""
    costs = np.asarray(model.predict_samples(list(shapes)), dtype=float)
    return float(costs[:, 0].sum() / costs.sum())


def with_encoder_share(model: PlannerCostModel, shapes: Sequence[SampleShape], share: float) -> EncoderScaled:
    """``model`` with its encoder time scaled so that the encoder does ``share`` of the data's work."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"an encoder share must lie strictly between 0 and 1, got {share}")
    costs = np.asarray(model.predict_samples(list(shapes)), dtype=float).sum(axis=0)
    if costs[0] <= 0:
        raise ValueError("the data has no encoder work (no images or videos): its share cannot be scaled")
    return EncoderScaled(model, share / (1.0 - share) * costs[1] / costs[0])


@dataclass(frozen=True)
class MethodProjection:
    """A method at one cluster size: its plan and simulated step time on each sampled batch."""

    method: Method
    layout: Layout | None
    step_times: tuple[float, ...]
    global_batch: int

    @property
    def step_time(self) -> float:
        """Mean predicted step seconds (nan when no plan fits)."""
        return float(np.mean(self.step_times)) if self.step_times else float("nan")

    @property
    def samples_per_s(self) -> float:
        """Predicted samples per second."""
        return self.global_batch / self.step_time


@dataclass(frozen=True)
class SizeProjection:
    """Every method at one cluster size."""

    gpus: int
    global_batch: int
    methods: tuple[MethodProjection, ...]

    def of(self, name: str) -> MethodProjection:
        """The projection of the method called ``name``."""
        return next(m for m in self.methods if m.method.name == name)

    @property
    def best_baseline(self) -> MethodProjection | None:
        """The fastest baseline (mean step time) among those with a plan; None when none has one."""
        planned = [m for m in self.methods if m.method.name != "dflop" and m.step_times]
        return min(planned, key=lambda m: m.step_time) if planned else None

    @property
    def gain(self) -> float:
        """DFLOP's speed-up over the best baseline: their mean step times' ratio (nan when either has no plan)."""
        return self.gain_of(np.mean)

    @property
    def gain_range(self) -> tuple[float, float]:
        """The lowest and highest ratio, batch by batch, of the best baseline's step to DFLOP's."""
        return self.gain_of(np.min), self.gain_of(np.max)

    def gain_of(self, statistic: Any) -> float:
        """``statistic`` (mean, min or max) of the best baseline's over DFLOP's step times: of the
        means for the mean, of the batch-by-batch ratios otherwise; nan when either has no plan."""
        best, dflop = self.best_baseline, self.of("dflop")
        if best is None or not dflop.step_times:
            return float("nan")
        if statistic is np.mean:
            return best.step_time / dflop.step_time
        return float(statistic(np.divide(best.step_times, dflop.step_times)))


def _simulate(
    model: PlannerCostModel,
    cluster: Cluster,
    layout: Layout,
    shapes: Sequence[SampleShape],
    batch: int,
    n_batches: int,
    seed: int,
) -> tuple[float, ...]:
    """Step seconds of ``layout`` on each sampled batch; empty when a batch does not fit in memory."""
    evals = simulate_layout(model, cluster, layout, shapes, batch, n_batches=n_batches, seed=seed)
    return tuple(e.sim.step_time for e in evals) if all(e.feasible for e in evals) else ()


def shared_layouts(candidates: Sequence[Scored], per_family: int) -> list[Layout]:
    """The ``per_family`` fastest distinct feasible layouts of each shared-pipeline family, as simulated."""
    layouts: list[Layout] = []
    for family in SHARED_FAMILIES:
        ranked = sorted((s for s in candidates if s.family == family and s.feasible), key=lambda s: s.step_time)
        picked: list[Layout] = []
        for scored in ranked:
            if scored.layout not in picked:
                picked.append(scored.layout)
            if len(picked) == per_family:
                break
        layouts.extend(picked)
    return layouts


def best_baseline_plan(
    method: Method,
    model: PlannerCostModel,
    cluster: Cluster,
    shapes: Sequence[SampleShape],
    layouts: Sequence[Layout],
    batch: int,
    n_batches: int,
    seed: int,
) -> MethodProjection:
    """``method`` on the fastest of ``layouts`` (each cut by its splitter) that fits in memory."""
    best: MethodProjection = MethodProjection(method, None, (), batch)
    for layout in dict.fromkeys(replace(layout, splitter=method.splitter) for layout in layouts):
        times = _simulate(model, cluster, layout, shapes, batch, n_batches, seed)
        if times and (not best.step_times or np.mean(times) < best.step_time):
            best = MethodProjection(method, layout, times, batch)
    return best


def project_size(
    model: PlannerCostModel,
    cluster: Cluster,
    shapes: Sequence[SampleShape],
    global_batch: int,
    *,
    n_batches: int = 3,
    seed: int = 0,
    per_family: int = 2,
    methods: Sequence[Method] = METHODS,
    tensor_parallel_layers: bool | None = None,
    **search_options: Any,
) -> SizeProjection:
    """Every method of ``methods`` on its best plan for ``cluster`` (see the module docstring):
    ``n_batches`` sampled global batches, the ``per_family`` best layouts of each shared-pipeline
    family for a baseline; ``tensor_parallel_layers`` decides ``cluster.max_tp`` when unset
    (:func:`~dflop_ds.plan.planner.cluster_for_model`; None: the cost model says).

    A method whose search finds no layout that fits has no plan (empty ``step_times``).
    """
    if tensor_parallel_layers is None:
        tensor_parallel_layers = has_tensor_parallel_layers(model)
    cluster = cluster_for_model(cluster, tensor_parallel_layers)
    pool = list(getattr(shapes, "shapes", shapes))
    views = {False: model, True: PackedView(model)}
    results: dict[bool, SearchResult | None] = {}
    out: list[MethodProjection] = []
    for method in methods:
        view = views[method.packed]
        if method.packed not in results:
            # a search only baselines read needs its shared-pipeline layouts, not the sampler's final re-scoring
            baselines_only = not any(m.packed == method.packed and m.splitter == "dflop" for m in methods)
            options = {"families": SHARED_FAMILIES, "final_partition": False} if baselines_only else {}
            try:
                results[method.packed] = search(
                    view, cluster, pool, global_batch, n_batches=n_batches, seed=seed, **{**options, **search_options}
                )
            except PlanError:
                results[method.packed] = None
        result = results[method.packed]
        if result is None:
            out.append(MethodProjection(method, None, (), global_batch))
        elif method.splitter == "dflop":
            times = _simulate(view, cluster, result.best.layout, pool, global_batch, n_batches, seed)
            out.append(MethodProjection(method, result.best.layout, times, global_batch))
        else:
            layouts = shared_layouts(result.candidates, per_family)
            out.append(best_baseline_plan(method, view, cluster, pool, layouts, global_batch, n_batches, seed))
    return SizeProjection(cluster.gpus, global_batch, tuple(out))


def project(
    model: PlannerCostModel,
    shapes: Sequence[SampleShape],
    gpu_counts: Sequence[int],
    *,
    batch_per_gpu: int = 2,
    cluster: Cluster | None = None,
    **options: Any,
) -> list[SizeProjection]:
    """:func:`project_size` at every count of ``gpu_counts``, global batch ``batch_per_gpu * GPUs``;
    ``cluster`` gives the other cluster settings (GPUs per node, memory, ZeRO stage, precision)."""
    base = cluster or Cluster(gpus=1, gpu_memory_bytes=model.gpu_memory_bytes or DEFAULT_GPU_MEMORY_BYTES)
    return [
        project_size(model, replace(base, gpus=gpus), shapes, batch_per_gpu * gpus, **options) for gpus in gpu_counts
    ]


def table_lines(sizes: Sequence[SizeProjection]) -> list[str]:
    """The projection as a table: per size, every method's predicted step (mean, range over the
    sampled batches), samples/s and plan, then DFLOP's gain over the best baseline."""
    lines = [f"{'GPUs':>6} {'batch':>6}  {'method':<30} {'step_s':>8} {'(min-max)':<17} {'samples/s':>10}  plan"]
    for size in sizes:
        for m in size.methods:
            if not m.step_times:
                lines.append(f"{size.gpus:>6} {size.global_batch:>6}  {m.method.label:<30} no plan fits in memory")
                continue
            spread = f"({min(m.step_times):.3f}-{max(m.step_times):.3f})"
            lines.append(
                f"{size.gpus:>6} {size.global_batch:>6}  {m.method.label:<30} {m.step_time:>8.3f} {spread:<17} "
                f"{m.samples_per_s:>10.1f}  {m.layout.describe() if m.layout else ''}"
            )
        best, (low, high) = size.best_baseline, size.gain_range
        if best is None or not size.of("dflop").step_times:
            reason = "no baseline plan fits" if best is None else "no DFLOP plan fits"
            lines.append(f"{'':>14}DFLOP over the best baseline: n/a ({reason})")
            continue
        lines.append(
            f"{'':>14}DFLOP over the best baseline ({best.method.label}): x{size.gain:.3f} "
            f"(x{low:.3f}-{high:.3f} over {len(size.of('dflop').step_times)} sampled batches)"
        )
    return lines
