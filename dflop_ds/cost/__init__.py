"""dflop_ds.cost: cost models: one protocol, its implementations and one file format.

* :class:`CostModel`: the protocol (per-sample and microbatch ``[encoder, llm]`` cost, memory,
  and the declared capabilities); :class:`LayeredCostModel` (depths, layer shares) and
  :class:`PlannerCostModel` (what the planner reads) extend it, :class:`CostWrapper` wraps one.
* :class:`FittedCostModel`: monotone regressors fitted on a profiler's :class:`ModelProfile`.
* :class:`AnalyticMLLM`: FLOP-count models of real MLLMs on real GPUs (:func:`reference_model`).
* :class:`ProxyCost`: the unitless fallback when nothing was profiled.
* :class:`PackedCost`: any of them for packed microbatches (additive plus one overhead);
  :class:`RowPackedCost` for packed rows whose attention spans the whole row.
* :class:`LLMOnlyCost`: any of them with the encoder column zeroed (a colocated encoder).
* :class:`StageCost`: any of them per pipeline stage.
* :func:`sampler_cost_model`: the one chain of these wrappers a sampler balances with;
  :func:`memory_blind_model`: the model of a chain that predicts no memory; :func:`packs_microbatches`:
  whether a chain packs.
* :class:`PackedView`, :class:`EncoderScaled`, :class:`EngineScaled`: the planner's views of a model.
* :func:`save_cost_model` / :func:`load_cost_model`: the one versioned JSON format.
* :class:`Microbatches` and :func:`microbatch_costs` (and the bytes): many microbatches of one
  batch predicted in one call, vectorised where a model declares it (:class:`BatchedCostModel`);
  :func:`microbatch_cost_by_position`: one batch's microbatches costed from their positions
  (:class:`PositionalCostModel`), for a splitter's many calls.
"""

from dflop_ds.cost.analytic import AnalyticMLLM, reference_model, reference_names
from dflop_ds.cost.batched import (
    microbatch_activation_bytes,
    microbatch_cost_by_position,
    microbatch_costs,
    microbatch_working_bytes,
)
from dflop_ds.cost.chain import memory_blind_model, packs_microbatches, sampler_cost_model
from dflop_ds.cost.columns import Microbatches, SampleColumns
from dflop_ds.cost.fitted import FittedCostModel, check_policy
from dflop_ds.cost.io import (
    cost_model_from_dict,
    cost_model_to_dict,
    load_cost_model,
    reusable_fitted_model,
    save_cost_model,
)
from dflop_ds.cost.llm_only import LLMOnlyCost
from dflop_ds.cost.measurements import Measurement, ModelProfile
from dflop_ds.cost.packed import PackedCost, RowPackedCost
from dflop_ds.cost.protocol import (
    BatchedCostModel,
    BatchedPlannerCostModel,
    CostModel,
    CostWrapper,
    LayeredCostModel,
    PlannerCostModel,
    PositionalCostModel,
)
from dflop_ds.cost.proxy import ProxyCost
from dflop_ds.cost.reference_policies import reference_policy
from dflop_ds.cost.stage import StageCost
from dflop_ds.cost.views import EncoderScaled, EngineScaled, PackedView, PlannerView

__all__ = [
    "AnalyticMLLM",
    "BatchedCostModel",
    "BatchedPlannerCostModel",
    "CostModel",
    "CostWrapper",
    "EncoderScaled",
    "EngineScaled",
    "FittedCostModel",
    "LLMOnlyCost",
    "LayeredCostModel",
    "Measurement",
    "Microbatches",
    "ModelProfile",
    "PackedCost",
    "PackedView",
    "PlannerCostModel",
    "PlannerView",
    "PositionalCostModel",
    "ProxyCost",
    "RowPackedCost",
    "SampleColumns",
    "StageCost",
    "check_policy",
    "cost_model_from_dict",
    "cost_model_to_dict",
    "load_cost_model",
    "memory_blind_model",
    "microbatch_activation_bytes",
    "microbatch_cost_by_position",
    "microbatch_costs",
    "microbatch_working_bytes",
    "packs_microbatches",
    "reference_model",
    "reference_names",
    "reference_policy",
    "reusable_fitted_model",
    "sampler_cost_model",
    "save_cost_model",
]
