"""The parallelism search: enumerate each family's layouts, rank them by a cheap estimate, simulate the best.

The families (:mod:`dflop_ds.plan.families`, one strategy each) are searched for a cluster, a
cost model and the data (a list of sample shapes global batches are drawn from):

- ``deepspeed``: one DeepSpeed pipeline, shared tp and dp, ``GPUs = stages * tp * dp``, layers
  split by cost (a stage may hold encoder and LLM layers), our balanced microbatches;
- ``colocated``: the encoder data-parallel over every GPU outside the pipeline, its features
  exchanged with an all-to-all; the LLM pipeline ``GPUs = stages * tp * dp`` over the LLM layers;
- ``monolithic``: the stock baseline, same space as ``deepspeed`` but DeepSpeed's uniform layer
  split and fixed-size sequential microbatches.

In every family ``dp * n_mb`` divides the global batch, so DeepSpeed's ``train_batch_size``
equals it. Pruning, in order: (1) every layout gets a vectorised memory and step-time estimate;
layouts over the memory estimate are dropped; (2) only the ``top_k`` best estimates per family
are simulated, on the first sampled global batch, with a padding-aware vector LPT; a simulated
layout whose exact memory check fails is replaced by the next; those within ``refine_margin``
of their family's best are scored on the other sampled batches too
(:func:`~dflop_ds.plan.families.core.explore`); (3) the best few of the balanced families are
re-scored with the registered ``dflop`` splitter (``partition_batch``, heuristic with improving moves measured by
the cost model's padded microbatch cost, no ILP, then ``assign_to_ranks``), as the sampler would split the batches.

DFLOP's ``separate`` family (encoder and LLM on disjoint GPU sets) is not searched: see
docs/architecture.md, "Separately parallelized segments".
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import numpy as np

from dflop_ds.cost import PlannerCostModel
from dflop_ds.plan.cluster import Cluster
from dflop_ds.plan.families import DEFAULT_NMB, FAMILIES, PlanError, Scored, sample_batches
from dflop_ds.plan.families.core import SearchInputs, batch_stats, explore, score
from dflop_ds.shapes import SampleShape

__all__ = ["DEFAULT_NMB", "FAMILIES", "PlanError", "Scored", "SearchResult", "sample_batches", "search"]

RUNNABLE = ("deepspeed", "colocated")  # the families a plan is chosen from
_Params = ParamSpec("_Params")
_Result = TypeVar("_Result")


def existing_objects_frozen(function: Callable[_Params, _Result]) -> Callable[_Params, _Result]:
    """Run ``function`` with the objects that exist when it starts left out of the garbage
    collector's scans (:func:`gc.freeze`, undone at the end).

    A search at thousands of GPUs allocates millions of small lists and tuples, and every full
    collection they trigger would walk every object of the process, the imported torch and
    DeepSpeed included: a third of a 16384-GPU search's CPU time here (10.2 s -> 6.8 s). Objects
    the search creates are collected as usual. A caller that froze objects itself keeps its
    freeze as it is (nothing frozen or undone here: :func:`gc.unfreeze` would undo it too).
    """

    @functools.wraps(function)
    def frozen(*args: _Params.args, **kwargs: _Params.kwargs) -> _Result:
        if gc.get_freeze_count():
            return function(*args, **kwargs)
        gc.freeze()
        try:
            return function(*args, **kwargs)
        finally:
            gc.unfreeze()

    return frozen


@dataclass
class SearchResult:
    """The outcome of :func:`search`.

    Attributes:
        best: best layout overall (the faster of the ``deepspeed`` and ``colocated`` winners).
        best_deepspeed: best shared-pipeline layout (ours: balanced, cost split).
        monolithic: the stock baseline (uniform split, fixed-size microbatches); None when no
            such layout fits in memory (ours may still fit: its split is memory-aware).
        winners: the best layout of every searched family (None when none fits).
        candidates: every simulated layout.
        n_layouts: layouts enumerated (before pruning).
        seconds: wall time of the search.
    """

    best: Scored
    best_deepspeed: Scored
    monolithic: Scored | None
    winners: dict[str, Scored | None]
    candidates: list[Scored]
    n_layouts: int
    seconds: float

    @property
    def best_colocated(self) -> Scored | None:
        """Best colocated layout (None when the family was not searched or nothing fits)."""
        return self.winners.get("colocated")

    @property
    def gap(self) -> float:
        """How much slower the best shared-pipeline plan is than the best overall (0.1 = 10%)."""
        return self.best_deepspeed.step_time / self.best.step_time - 1.0

    def speedup(self, scored: Scored) -> float | None:
        """Predicted speed-up of ``scored`` over the monolithic baseline (None without a baseline)."""
        return None if self.monolithic is None else self.monolithic.step_time / scored.step_time


@existing_objects_frozen
def search(
    model: PlannerCostModel,
    cluster: Cluster,
    shapes: Sequence[SampleShape],
    global_batch: int,
    *,
    n_batches: int = 3,
    top_k: int = 6,
    refine_margin: float = 0.1,
    max_tries: int = 4,
    refine_layouts: int = 2,
    nmb_choices: Sequence[int] = DEFAULT_NMB,
    families: Sequence[str] = tuple(FAMILIES),
    final_partition: bool = True,
    final_k: int = 2,
    seed: int = 0,
) -> SearchResult:
    """Find the best layout of each family for ``cluster``, the data ``shapes`` and ``global_batch``.

    Args:
        model: a cost model (planner interface in docs/architecture.md).
        cluster: GPUs, memory and links.
        shapes: the data: a list of sample shapes or a ``DataProfile`` (its ``.shapes``);
            global batches of ``global_batch`` samples are drawn from it.
        n_batches: sampled batches each simulated layout is scored on (mean step time).
        top_k: layouts simulated per family (more if some fail the exact memory check), on
            the first sampled batch.
        max_tries: at most ``max_tries * top_k`` layouts per family are tried (simulated or
            found over memory) before giving up.
        refine_layouts: the best this many layouts (tp, pp, dp) are also simulated with every
            other microbatch count in ``nmb_choices``.
        refine_margin: layouts within this fraction of their family's best on the first batch
            are simulated on the other batches too; the winners come from those.
        nmb_choices: microbatch counts per rank considered.
        families: which of ``FAMILIES`` to search (``"deepspeed"`` is required).
        final_partition: re-score the ``final_k`` best layouts of the balanced families with our
            ``dflop`` splitter and pick the winners by those scores.
        seed: batch sampling and tie-breaking.

    Raises:
        PlanError: no shared-pipeline layout fits, or ``families`` names an unknown family.
    """
    start = time.perf_counter()
    if global_batch < 1:
        raise PlanError(f"global_batch must be >= 1, got {global_batch}")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or "deepspeed" not in families:
        raise PlanError(f'families {list(families)}: choose among {list(FAMILIES)}, "deepspeed" included')
    pool = list(getattr(shapes, "shapes", shapes))  # a DataProfile or a list of shapes
    batches = sample_batches(len(pool), global_batch, n_batches, seed)
    costs = np.asarray(model.predict_samples(pool), dtype=float)
    inputs = SearchInputs(
        model, cluster, pool, costs, batches, batch_stats(model, pool, costs, batches), global_batch, nmb_choices
    )
    n_layouts = 0
    scored: dict[str, list[Scored]] = {}
    winners: dict[str, Scored | None] = {}
    for name in families:
        family = FAMILIES[name]
        ranked, n = family.ranked(inputs, max_tries * top_k)
        n_layouts += n
        scored[name] = explore(
            family, inputs, ranked, top_k=top_k, refine_layouts=refine_layouts, refine_margin=refine_margin, seed=seed
        )
        done = sorted(
            (s for s in scored[name] if s.feasible and len(s.evaluations) == len(batches)), key=lambda s: s.step_time
        )
        winners[name] = done[0] if done else None
        if final_partition and family.balanced and done:
            finals = [
                score(family, inputs, s.layout, len(batches), s.estimate, fast=False, seed=seed) for s in done[:final_k]
            ]
            finals = [s for s in finals if s.feasible]
            if finals:  # report what the sampler's dflop splitter gives
                scored[name].extend(finals)
                winners[name] = min(finals, key=lambda s: s.step_time)
    best_ds = winners["deepspeed"]
    if best_ds is None:
        raise PlanError(
            f"no deepspeed layout fits {cluster.gpus} GPUs of {cluster.gpu_memory_bytes / 1e9:.0f} GB "
            f"for a global batch of {global_batch} (memory or batch size too small)"
        )
    runnable = [w for f, w in winners.items() if f in RUNNABLE and w is not None]
    return SearchResult(
        best=min(runnable, key=lambda s: s.step_time),
        best_deepspeed=best_ds,
        monolithic=winners.get("monolithic"),
        winners=winners,
        candidates=[s for f in families for s in scored[f]],
        n_layouts=n_layouts,
        seconds=time.perf_counter() - start,
    )
