"""The shared-layout families: encoder and LLM layers in one DeepSpeed pipeline.

- ``deepspeed``: ``GPUs = stages * tp * dp``, layers split by cost within memory (a stage may
  hold encoder and LLM layers), our balanced microbatches;
- ``monolithic``: the stock baseline, same space, DeepSpeed's uniform layer split and
  fixed-size sequential microbatches.

Estimate of a layout: ``max(n_mb * d_mean, d_heavy) + (stages - 1) * d_max + all-reduce``
(``d_mean`` the average per-stage time of a microbatch, ``d_heavy`` that of the heaviest sample,
``d_max`` the larger of the two; stock microbatches are charged their expected padding by order
statistics), with a stage-0 memory estimate.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dflop_ds.cost import PlannerCostModel
from dflop_ds.pipe.stage_bounds import StageBounds, split_stages, uniform_bounds
from dflop_ds.plan.cluster import Cluster
from dflop_ds.plan.evaluate import evaluate
from dflop_ds.plan.families.core import BatchStats, Family, Key, SearchInputs, pipeline_grid, rank_estimates
from dflop_ds.plan.layout import Layout, Segment, stages_from_bounds
from dflop_ds.plan.stages import layer_costs


def pipeline_estimates(
    model: PlannerCostModel, cluster: Cluster, data: BatchStats, grid: np.ndarray, uniform: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Step-time and stage-0 memory estimates of shared layouts (rows ``(tp, pp, dp, n_mb)`` of ``grid``)."""
    E, L = model.encoder_layers, model.llm_layers
    pb = model.param_bytes
    tp, pp, dp, m = (grid[:, i].astype(float) for i in range(4))
    sp = cluster.tp_speedup(tp)
    slots = dp * m
    per_mb = np.maximum(data.batch / slots, 1.0)
    act_mb = np.maximum(per_mb[:, None] * data.act_mean, data.act_heavy)
    seg_w = np.array([pb["encoder"], pb["llm"]])
    if uniform:
        # exact stage fractions of DeepSpeed's uniform split; the heaviest stage sets the pace;
        # random fixed-size microbatches are padded to their longest sample
        k = data.batch / slots
        works = np.column_stack([np.full(len(grid), data.work[0]), data.padded_llm_work(k)])
        heavies = np.column_stack([np.full(len(grid), data.heavy[0]), k * data.heavy[1]])
        d_mean = np.empty(len(grid))
        d_heavy = np.empty(len(grid))
        stage_w = np.empty(len(grid))
        mem = np.empty(len(grid))
        for i, (t, p, d, mb) in enumerate(grid.tolist()):
            stg = stages_from_bounds(uniform_bounds(E + 1 + L, p), E, 1, L)
            fr = np.array([[s[0] / E, s[2] / L] for s in stg])
            w = fr @ seg_w + pb["projector"] * np.array([s[1] for s in stg])
            j = int(np.argmax(fr @ works[i]))
            d_mean[i] = fr[j] @ works[i]
            d_heavy[i] = fr[j] @ heavies[i]
            stage_w[i] = w.max()
            in_flight = np.minimum(p - np.arange(p), mb)
            mem[i] = np.max(w / t * cluster.state_factor(d) + in_flight * (fr @ act_mb[i]) / t)
        d_mean = d_mean / (slots * sp)
        d_heavy = d_heavy / sp
        mem = mem + data.work_bytes.max() / tp
    else:
        layer = np.maximum(data.work[0] / E, data.work[1] / L)
        d_mean = (data.work.sum() / pp + 0.5 * layer) / (slots * sp)
        d_heavy = data.heavy.sum() / pp / sp
        stage_w = (pb["encoder"] + pb["projector"] + pb["llm"]) / pp
        act0 = act_mb.sum(axis=1) / pp / tp
        mem = stage_w / tp * cluster.state_factor(dp) + np.minimum(pp, m) * act0 + data.work_bytes.max() / tp
    d_max = np.maximum(d_mean, d_heavy)
    # a rank is no faster than its share of the work nor than its heaviest sample; fill and
    # drain cost (pp - 1) microbatches that may hold a heavy sample
    est = np.maximum(m * d_mean, d_heavy) + (pp - 1) * d_max + cluster.allreduce_seconds(stage_w / tp, dp, tp)
    return est, mem


def memory_aware_bounds(
    weights: Sequence[float],
    layer_memory: Sequence[float],
    layer_activation: Sequence[float],
    pp: int,
    n_mb: int,
    fixed_bytes: float,
    cap: float,
) -> StageBounds | None:
    """The exact ``min_max`` split (:func:`~dflop_ds.pipe.stage_bounds.split_stages`) of ``weights`` over
    ``pp`` stages, stage ``s`` holding its layers' ``layer_memory`` plus ``min(pp - s, n_mb)``
    microbatches of their ``layer_activation`` plus ``fixed_bytes``, under ``cap``."""
    pm = np.concatenate([[0.0], np.cumsum(layer_memory)])
    pa = np.concatenate([[0.0], np.cumsum(layer_activation)])

    def stage_memory(stage: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        return pm[hi] - pm[lo] + min(pp - stage, n_mb) * (pa[hi] - pa[lo]) + fixed_bytes

    return split_stages("min_max", weights, pp, stage_memory=stage_memory, memory_cap=cap)


class PipelineFamily(Family):
    """``deepspeed`` (``uniform=False``) or ``monolithic`` (``uniform=True``)."""

    def __init__(self, name: str, uniform: bool) -> None:
        self.name = name
        self.uniform = uniform
        self.balanced = not uniform
        self.evaluate = evaluate

    def ranked(self, inputs: SearchInputs, limit: int) -> tuple[list[tuple[float, Key]], int]:
        """See :meth:`Family.ranked`."""
        model = inputs.model
        grid = pipeline_grid(
            inputs.cluster, model.encoder_layers + 1 + model.llm_layers, inputs.global_batch, inputs.nmb_choices
        )
        if len(grid) == 0:
            return [], 0
        est, mem = pipeline_estimates(model, inputs.cluster, inputs.data, grid, self.uniform)
        return rank_estimates(grid, est, mem, inputs.cluster, limit), len(grid)

    def build(self, inputs: SearchInputs, key: Key) -> Layout | None:
        """See :meth:`Family.build`."""
        tp, pp, dp, m = key
        model, cluster, data = inputs.model, inputs.cluster, inputs.data
        E, L = model.encoder_layers, model.llm_layers
        if self.uniform:  # DeepSpeed's stock split; the evaluation checks its memory
            stages = stages_from_bounds(uniform_bounds(E + 1 + L, pp), E, 1, L)
        else:
            pb = model.param_bytes
            sf = cluster.state_factor(dp)
            per_mb = max(data.batch / (dp * m), 1.0)
            act_mb = np.maximum(per_mb * data.act_mean, data.act_heavy)
            layer_mem = [pb["encoder"] / E * sf / tp] * E + [pb["projector"] * sf / tp] + [pb["llm"] / L * sf / tp] * L
            layer_act = [act_mb[0] / E / tp] * E + [0.0] + [act_mb[1] / L / tp] * L
            bounds = memory_aware_bounds(
                layer_costs(data.work.tolist(), model),
                layer_mem,
                layer_act,
                pp,
                m,
                data.work_bytes.max() / tp,
                cluster.usable_memory,
            )
            if bounds is None:
                return None
            stages = stages_from_bounds(bounds, E, 1, L)
        e_pp = sum(1 for s in stages if s[0] > 0)
        l_pp = sum(1 for s in stages if s[2] > 0 or s[1] > 0)
        splitter = "stock" if self.uniform else "dflop"
        return Layout(Segment(tp, e_pp, dp), Segment(tp, l_pp, dp), m, stages, splitter=splitter)


DEEPSPEED = PipelineFamily("deepspeed", uniform=False)
MONOLITHIC = PipelineFamily("monolithic", uniform=True)
