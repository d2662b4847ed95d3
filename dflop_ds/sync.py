"""How data-parallel ranks meet in a step (the synchronisation model), decided in one place.

What "balanced" means depends on where the engine makes ranks wait for each other:

- ``pipeline`` (pipeline stages > 1): DeepSpeed's 1F1B schedule; the simulator replays it.
- ``boundary`` (ZeRO-0/1, DDP under ``no_sync``): gradients are reduced once, at the accumulation
  boundary, so a step costs the slowest rank's total: ``max_r sum_k t[r, k]``.
- ``microstep`` (ZeRO-2 where one reduce bucket spans the whole model): gradients are reduced in
  every micro-step, so a step costs ``sum_k max_r t[r, k]``.
- ``module`` (ZeRO-3; ZeRO-2 with reduce buckets smaller than a layer, as every real model has):
  the vision encoder and the LLM each meet on their own, so a step costs
  ``sum_k (max_r enc[r, k] + max_r llm[r, k])``.

:func:`sync_model_of` derives the model from a DeepSpeed config; :func:`step_cost` scores a split's
per-microbatch ``(encoder, llm)`` times under a model; :func:`step_lower_bound` bounds any split's
step from below, knowing that a sample cannot be split. Pure functions of numpy arrays.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

import numpy as np

from dflop_ds.deepspeed_keys import deepspeed_keys

#: ZeRO-2's default ``reduce_bucket_size`` (elements) in DeepSpeed 0.19.8
ZERO2_DEFAULT_REDUCE_BUCKET = 500_000_000


class SyncModel(str, Enum):
    """Where data-parallel ranks wait for each other (see the module docstring)."""

    PIPELINE = "pipeline"
    BOUNDARY = "boundary"
    MICROSTEP = "microstep"
    MODULE = "module"

    def __str__(self) -> str:
        return self.value

    @property
    def pipelined(self) -> bool:
        """True for the 1F1B pipeline (simulated, not scored by :func:`step_cost`)."""
        return self is SyncModel.PIPELINE

    def describe(self) -> str:
        """One line: the model and the step it implies."""
        return f"{self.value}: {_DESCRIPTIONS[self]}"


_DESCRIPTIONS = {
    SyncModel.PIPELINE: "1F1B pipeline; the slowest stage paces every microbatch",
    SyncModel.BOUNDARY: "ranks meet at the accumulation boundary; step = slowest rank's total",
    SyncModel.MICROSTEP: "ranks meet every microbatch; step = sum over microbatches of the slowest rank",
    SyncModel.MODULE: "encoder and LLM meet apart every microbatch; step = sum of the slowest encoder + slowest LLM",
}


def sync_model_for(zero_stage: int, pipeline_stages: int = 1, module_buckets: bool = True) -> SyncModel:
    """The sync model of an engine: ``pipeline_stages > 1`` is a pipeline; otherwise ZeRO-0/1 meet
    at the boundary, ZeRO-3 per module, and ZeRO-2 per module when its reduce buckets are smaller
    than a layer (``module_buckets``, true for real models) or per micro-step otherwise."""
    if pipeline_stages > 1:
        return SyncModel.PIPELINE
    if zero_stage >= 3:
        return SyncModel.MODULE
    if zero_stage == 2:
        return SyncModel.MODULE if module_buckets else SyncModel.MICROSTEP
    return SyncModel.BOUNDARY


def sync_model_of(
    ds_config: Mapping[str, Any], pipeline_stages: int = 1, largest_layer_elements: int | None = None
) -> SyncModel:
    """The sync model of DeepSpeed config ``ds_config`` run with ``pipeline_stages`` stages.

    ZeRO-2 meets per module when ``zero_optimization.reduce_bucket_size`` (DeepSpeed's default
    5e8 elements when unset) is below ``largest_layer_elements``, the parameter count of the
    model's largest layer; unknown (None) counts as a real model's layer, which exceeds no default
    bucket only for tiny models, so ZeRO-2 then meets per module. The HF Trainer's ``"auto"``
    bucket (hidden size squared, below a layer's size) also meets per module.
    """
    keys = deepspeed_keys(ds_config)
    bucket = (ds_config.get("zero_optimization") or {}).get("reduce_bucket_size", ZERO2_DEFAULT_REDUCE_BUCKET)
    # "auto" (the HF Trainer's) becomes hidden_size squared: below any layer of the model
    numeric = isinstance(bucket, (int, float)) and not isinstance(bucket, bool)
    module_buckets = largest_layer_elements is None or not numeric or float(bucket) < float(largest_layer_elements)
    return sync_model_for(keys.stage, pipeline_stages, module_buckets)


def as_sync_model(value: SyncModel | str) -> SyncModel:
    """``value`` as a :class:`SyncModel`; a ``ValueError`` listing the names otherwise."""
    try:
        return SyncModel(value)
    except ValueError:
        raise ValueError(f"unknown sync model {value!r}: choose one of {[m.value for m in SyncModel]}") from None


def step_cost(times: np.ndarray, sync: SyncModel | str) -> float:
    """A step's cost under ``sync`` from ``times[r, k]`` = ``(encoder, llm)`` seconds (or any
    columns, summed where the model sums them) of rank ``r``'s ``k``-th microbatch.

    ``times`` is ``(dp, n_mb, c)``; a ``(dp, n_mb)`` array is one column. Pipelines have no closed
    form (the simulator scores them): a ``ValueError``.
    """
    sync = as_sync_model(sync)
    t = np.asarray(times, dtype=float)
    if t.ndim == 2:
        t = t[..., None]
    if t.ndim != 3:
        raise ValueError(f"times must be (dp, n_mb) or (dp, n_mb, columns), got shape {t.shape}")
    if sync is SyncModel.BOUNDARY:
        return float(t.sum(axis=(1, 2)).max())
    if sync is SyncModel.MICROSTEP:
        return float(t.sum(axis=2).max(axis=0).sum())
    if sync is SyncModel.MODULE:
        return float(t.max(axis=0).sum())
    raise ValueError("a pipeline's step has no closed form: simulate it (dflop_ds.plan.simulator)")


def step_lower_bound(costs: np.ndarray, dp: int, n_mb: int, sync: SyncModel | str) -> float:
    """A lower bound on :func:`step_cost` of any split of the items ``costs`` (``(n, c)`` seconds,
    a microbatch costing the sum of its items) into ``n_mb`` non-empty microbatches on each of
    ``dp`` ranks. It knows that a sample cannot be split (:func:`_rank_bound`,
    :func:`_microstep_bound`); ``module`` adds the columns' bounds (each column meets on its own),
    ``microstep`` and ``boundary`` bound the summed column (a microbatch runs its columns one
    after the other). Pipelines: the ``boundary`` bound (a rank's work is a floor there too).
    """
    sync = as_sync_model(sync)
    c = np.asarray(costs, dtype=float)
    if c.ndim == 1:
        c = c[:, None]
    if c.size == 0:
        return 0.0
    if sync is SyncModel.MODULE:
        return float(sum(_microstep_bound(c[:, j], dp, n_mb) for j in range(c.shape[1])))
    if sync is SyncModel.MICROSTEP:
        return _microstep_bound(c.sum(axis=1), dp, n_mb)
    return _rank_bound(c.sum(axis=1), dp, n_mb)


def _rank_bound(items: np.ndarray, dp: int, n_mb: int) -> float:
    """The slowest rank's total is at least: the average rank's; the largest item's plus the
    ``n_mb - 1`` smallest (its rank fills ``n_mb`` non-empty microbatches); and, with more items
    than ranks, the ``dp``-th and ``dp+1``-th largest (two of the ``dp + 1`` largest share a rank)
    plus the ``n_mb - 2`` smallest."""
    x = np.sort(items)  # ascending
    smallest = np.concatenate([[0.0], np.cumsum(x)])  # smallest[k]: the k smallest summed
    bound = max(x.sum() / dp, x[-1] + smallest[min(n_mb - 1, x.size - 1)])
    if x.size > dp:
        bound = max(bound, x[-dp] + x[-dp - 1] + smallest[min(max(n_mb - 2, 0), x.size - 2)])
    return float(bound)


def _microstep_bound(items: np.ndarray, dp: int, n_mb: int) -> float:
    """``sum_k max_r t[r, k]`` of one column is at least the average rank's total, and at least
    the largest item plus the other microsteps' average: a microstep is never faster than its
    average rank, and the ``n_mb - 1`` microsteps without the largest item hold at least ``dp``
    items each, so at least the ``(n_mb - 1) * dp`` smallest."""
    x = np.sort(items)
    others = float(x[: min((n_mb - 1) * dp, x.size - 1)].sum())
    return float(max(x.sum() / dp, x[-1] + others / dp))
