"""Refuse a training setup whose pieces disagree, before any process builds an engine.

The DeepSpeed config's batch keys, the ``"dflop"`` block, the world size, an optional plan and
the dataset size must tell one consistent story. :func:`check_training_setup` checks them all
and raises :class:`SetupError` naming the key at fault, so a mistake costs seconds at start-up
instead of a hang or a silently different schedule hours later.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from dflop_ds.config import DFLOPConfig
from dflop_ds.cost import CostModel, LayeredCostModel, check_policy
from dflop_ds.deepspeed_keys import BATCH_KEYS, DeepSpeedKeys, deepspeed_keys
from dflop_ds.pipe.stage_bounds import StageBounds
from dflop_ds.shapes import ShapePolicy


class SetupError(ValueError):
    """The DeepSpeed config, the ``"dflop"`` block, the plan and the data disagree."""


class PlanLike(Protocol):
    """What the checks read from a :class:`dflop_ds.plan.Plan`."""

    n_mb: int
    global_batch_size: int

    @property
    def deepspeed_compatible(self) -> bool: ...

    @property
    def pipeline_stages(self) -> int: ...

    @property
    def tensor_parallel(self) -> int: ...

    @property
    def dp(self) -> int: ...

    def micro_batch_size(self) -> int: ...

    def world_size(self) -> int: ...

    def stage_bounds(self) -> StageBounds: ...


def _positive_int(keys: DeepSpeedKeys, key: str) -> int | None:
    """Batch key ``key`` as a positive int, ``None`` when absent (``"auto"`` is not resolved here)."""
    try:
        return keys.batch_key(key)
    except ValueError as error:
        raise SetupError(str(error)) from None


def resolve_batch_keys(ds_config: Mapping[str, Any], dp: int) -> tuple[int, int, int]:
    """``(train_batch_size, micro_batch, gradient_accumulation_steps)`` as DeepSpeed derives them.

    DeepSpeed needs ``train_batch_size = micro * GAS * dp``; given two of the three keys it
    derives the third, given one it takes ``GAS = 1``. Raises :class:`SetupError` naming the
    keys when they cannot agree.
    """
    keys = deepspeed_keys(ds_config)
    total, micro, gas = (_positive_int(keys, key) for key in BATCH_KEYS)
    if micro is None:
        if total is None:
            raise SetupError("DeepSpeed config: give train_batch_size or train_micro_batch_size_per_gpu")
        gas = gas or 1
        if total % (gas * dp):
            raise SetupError(
                f"DeepSpeed config: train_batch_size={total} is not a multiple of gradient_accumulation_steps={gas}"
                f" x data-parallel size {dp}"
            )
        micro = total // (gas * dp)
    elif gas is None:
        gas = 1 if total is None else total // (micro * dp)
        if total is not None and (gas < 1 or total != micro * gas * dp):
            raise SetupError(
                f"DeepSpeed config: train_batch_size={total} is not a multiple of "
                f"train_micro_batch_size_per_gpu={micro} x data-parallel size {dp}"
            )
    total = micro * gas * dp if total is None else total
    if total != micro * gas * dp:
        raise SetupError(
            f"DeepSpeed config: train_batch_size={total} must equal train_micro_batch_size_per_gpu={micro}"
            f" x gradient_accumulation_steps={gas} x data-parallel size {dp} (= {micro * gas * dp});"
            f" data-parallel size = world size / dflop.plan.pipeline_stages"
        )
    return total, micro, gas


def check_stage_bounds(bounds: Sequence[int], num_stages: int, n_layers: int | None) -> None:
    """``dflop.plan.stage_bounds`` must run from 0 to the layer count, strictly increasing
    (:class:`~dflop_ds.pipe.stage_bounds.StageBounds`), as a :class:`SetupError`."""
    try:
        StageBounds(bounds, n_layers=n_layers, num_stages=num_stages)
    except ValueError as error:
        raise SetupError(f"dflop.plan.{error}") from None


def check_plan_topology(plan: PlanLike, *, world_size: int, stages: int) -> None:
    """The plan must be for this many processes and pipeline stages (checked before any batch
    arithmetic, whose errors would hide the real mismatch)."""
    if not plan.deepspeed_compatible:
        raise SetupError("plan: it puts encoder and LLM on separate GPU sets; stock DeepSpeed cannot run it")
    if world_size != plan.world_size():
        raise SetupError(
            f"this plan is for {plan.world_size()} GPUs, but the run has world size {world_size}:"
            f" launch it on {plan.world_size()} GPUs or re-plan for {world_size}"
        )
    if stages != plan.pipeline_stages:
        raise SetupError(
            f"dflop.plan.pipeline_stages is {stages}, but the plan says {plan.pipeline_stages}:"
            " leave pipeline_stages (and stage_bounds) out of the config, the plan sets them"
        )


def check_plan(
    plan: PlanLike,
    *,
    stages: int,
    world_size: int,
    dp: int,
    total: int,
    micro: int,
    gas: int,
    stage_bounds: Sequence[int] | None,
    n_layers: int | None,
    tp: int = 1,
) -> None:
    """The plan must describe the run the DeepSpeed config and world size set up (``dp``: the
    data-parallel size without tensor-parallel peers; ``tp``: the config's AutoTP size)."""
    check_plan_topology(plan, world_size=world_size, stages=stages)
    if plan.global_batch_size < plan.n_mb * plan.dp:
        raise SetupError(
            f"plan: global_batch_size={plan.global_batch_size} cannot give n_mb={plan.n_mb} non-empty"
            f" microbatches to each of dp={plan.dp} data-parallel ranks"
        )
    if plan.global_batch_size % (plan.n_mb * plan.dp):
        raise SetupError(
            f"plan: global_batch_size={plan.global_batch_size} is not a multiple of dp={plan.dp} x n_mb={plan.n_mb}"
            f" = {plan.dp * plan.n_mb}: every step would train fewer samples than planned"
        )
    expected = plan.micro_batch_size() * plan.n_mb * plan.dp * plan.tensor_parallel
    mismatches: list[tuple[str, Any, Any]] = [
        ("tensor_parallel.autotp_size", tp, plan.tensor_parallel),
        ("data-parallel size (world size / pipeline_stages / autotp_size)", dp, plan.dp),
        ("gradient_accumulation_steps", gas, plan.n_mb),
        ("train_micro_batch_size_per_gpu", micro, plan.micro_batch_size()),
        ("train_batch_size", total, expected),
    ]
    if stage_bounds is not None and n_layers is not None and plan.stage_bounds()[-1] == n_layers:
        mismatches.append(("dflop.plan.stage_bounds", list(stage_bounds), plan.stage_bounds()))
    for key, have, want in mismatches:
        if have != want:
            raise SetupError(
                f"{key} is {have}, but the plan says {want}: run with the plan's DeepSpeed config"
                " (Plan.deepspeed_config) or re-plan for this setup"
            )


def check_training_setup(
    ds_config: Mapping[str, Any],
    dflop: DFLOPConfig,
    world_size: int,
    plan: PlanLike | None = None,
    n_samples: int | None = None,
    *,
    n_layers: int | None = None,
) -> None:
    """Raise :class:`SetupError` (a ``ValueError``) naming the key at fault, or return None.

    Checks: ``dflop.plan.pipeline_stages`` divides ``world_size``; the batch keys satisfy
    ``train_batch_size = micro * GAS * dp`` (with ``micro >= 1``, so one global batch fills
    ``GAS`` microbatches on every data-parallel rank); ``dflop.plan.stage_bounds`` (when given)
    is increasing from 0 to ``n_layers`` (when known); ``dflop.sampler.time_limit_s`` is 0 when
    more than one process computes the schedule (only clock-free solves agree across ranks;
    ``ilp_nodes`` is one); a plan agrees with all of these; the dataset (``n_samples``) holds at
    least one global batch.
    """
    stages = dflop.plan.pipeline_stages
    if world_size < 1:
        raise SetupError(f"world size must be >= 1, got {world_size}")
    if plan is not None:
        check_plan_topology(plan, world_size=world_size, stages=stages)
    if world_size % stages:
        raise SetupError(f"dflop.plan.pipeline_stages={stages} does not divide the world size {world_size}")
    check_engine_features(dflop)
    keys = deepspeed_keys(ds_config)
    tp = keys.autotp_size
    if tp > 1:
        check_tensor_parallel(dflop, tp, world_size, keys.stage)
    dp = world_size // stages
    total, micro, gas = resolve_batch_keys(ds_config, dp)  # micro >= 1, so total >= gas * dp
    if dflop.plan.stage_bounds is not None:
        check_stage_bounds(dflop.plan.stage_bounds, stages, n_layers)
    check_time_limit(dflop, world_size)
    if plan is not None:
        check_plan(
            plan,
            stages=stages,
            world_size=world_size,
            dp=dp // tp,
            total=total,
            micro=micro,
            gas=gas,
            stage_bounds=dflop.plan.stage_bounds,
            n_layers=n_layers,
            tp=tp,
        )
    if n_samples is not None and n_samples < total // tp:  # tensor-parallel peers share their samples
        raise SetupError(
            f"dflop.data.path ({dflop.data.path}) has {n_samples} usable samples"
            f"{'' if dflop.data.max_samples is None else f' (max_samples={dflop.data.max_samples})'},"
            f" fewer than one global batch (train_batch_size={total}{f' / autotp_size {tp}' if tp > 1 else ''})"
        )


def check_time_limit(dflop: DFLOPConfig, world_size: int) -> None:
    """``dflop.sampler.time_limit_s`` must be 0 when more than one of ``world_size`` processes
    computes the schedule: a time-limited solver can answer differently on each."""
    if dflop.sampler.time_limit_s > 0 and world_size > 1:
        raise SetupError(
            f"dflop.sampler.time_limit_s={dflop.sampler.time_limit_s:g}: each of the {world_size} processes"
            " computes the schedule itself, and a time-limited solver can answer differently on each, so stages and"
            " ranks would train mismatched microbatches; with world size > 1 use 0, and dflop.sampler.ilp_nodes for an"
            " exact solver bounded by nodes instead of time (the same answer on every rank)"
        )


def check_engine_features(dflop: DFLOPConfig) -> None:
    """Features that need one engine kind: adaptive correction reads the pipeline engine's
    per-stage timers; a HuggingFace model's colocated encoder runs on the plain engine only."""
    pipelined = dflop.plan.pipeline_stages > 1
    if not pipelined and dflop.correction.enabled:
        raise SetupError(
            "dflop.correction needs the pipeline engine's per-stage timers (dflop.plan.pipeline_stages > 1)"
        )
    if dflop.model.encoder == "colocated" and dflop.correction.enabled:
        raise SetupError(
            "dflop.correction does not model the colocated encoder's phase outside the pipeline"
            " yet: switch one of them off"
        )
    if dflop.model.encoder == "colocated" and dflop.model.name_or_path is not None and pipelined:
        raise SetupError(
            'dflop.model.encoder = "colocated" with a HuggingFace model (dflop.model.name_or_path) runs on the'
            " plain engine only for now (dflop.plan.pipeline_stages = 1)"
        )


def check_tensor_parallel(dflop: DFLOPConfig, tp: int, world_size: int, zero_stage: int) -> None:
    """``tensor_parallel.autotp_size = tp > 1`` runs only where DeepSpeed AutoTP can shard the LLM:
    a HuggingFace model (its tp_plan), the plain engine (pp = 1), ZeRO 0-2, no LoRA, and a
    world size that ``tp`` divides (the encoder local or colocated)."""
    where = f"tensor_parallel.autotp_size={tp}"
    if dflop.plan.pipeline_stages > 1:
        raise SetupError(
            f"{where} needs dflop.plan.pipeline_stages = 1 (got {dflop.plan.pipeline_stages}): AutoTP shards"
            " the plain engine's model, a PipelineModule gives it nothing to shard"
        )
    if dflop.model.name_or_path is None:
        raise SetupError(
            f"{where}: the bundled tiny model has no layers AutoTP can shard; give a HuggingFace model"
            " (model_name_or_path) or use autotp_size 1"
        )
    if dflop.model.lora is not None:
        raise SetupError(f"{where}: dflop.model.lora is not supported with AutoTP yet")
    if zero_stage > 2:
        raise SetupError(f"{where} runs with ZeRO stages 0-2 here (got stage {zero_stage})")
    if world_size % tp:
        raise SetupError(f"{where} does not divide the world size {world_size}")


def check_cost_model(
    cost_model: CostModel, *, encoder_layers: int, llm_layers: int, source: str = "cost model"
) -> None:
    """A cost model predicts the whole depth it was profiled on: refuse one whose recorded
    ``encoder_layers`` / ``llm_layers`` differ from the model being trained (naming both). A
    cost model that records no depths (not a :class:`~dflop_ds.cost.LayeredCostModel`, e.g. the
    proxy) passes."""
    if not isinstance(cost_model, LayeredCostModel):
        return
    profiled_encoder, profiled_llm = cost_model.encoder_layers, cost_model.llm_layers
    if (int(profiled_encoder), int(profiled_llm)) != (int(encoder_layers), int(llm_layers)):
        raise SetupError(
            f"{source} was profiled for {profiled_encoder} encoder and {profiled_llm} LLM layers, but the model has"
            f" {encoder_layers} encoder and {llm_layers} LLM layers: its predictions would be off by the depth"
            " ratio; profile this model (dflop-ds profile model)"
        )


def check_cost_model_fits(
    cost_model: CostModel,
    policy: ShapePolicy | None,
    *,
    encoder_layers: int | None,
    llm_layers: int | None,
    source: str = "cost model",
) -> None:
    """A cost model fits the run when it was profiled under the shape policy the data is shaped
    with (:func:`~dflop_ds.cost.check_policy`) and on the model's depth (:func:`check_cost_model`).
    ``policy`` or the depths None: the run does not know them, that check is skipped."""
    if policy is not None:
        check_policy(cost_model, policy, source=source)
    if encoder_layers is not None and llm_layers is not None:
        check_cost_model(cost_model, encoder_layers=encoder_layers, llm_layers=llm_layers, source=source)


__all__ = [
    "SetupError",
    "check_training_setup",
    "check_tensor_parallel",
    "resolve_batch_keys",
    "check_stage_bounds",
    "check_plan",
    "check_plan_topology",
    "check_cost_model",
    "check_cost_model_fits",
    "check_time_limit",
]
