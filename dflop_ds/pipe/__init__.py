"""dflop_ds.pipe: DeepSpeed glue: MLLMPipelineModule, stage splits and the token-normalized loss.

``MLLMPipelineModule`` is imported lazily so that the loss and the split helpers work without
importing DeepSpeed.
"""

from typing import Any

from dflop_ds.pipe.loss import token_loss_sum, token_normalized_loss
from dflop_ds.pipe.stage_bounds import StageBounds, plan_stage_bounds, split_by_cost, stage_costs

__all__ = [
    "MLLMPipelineModule",
    "mark_boundary_outputs",
    "unused_float_inputs",
    "StageBounds",
    "plan_stage_bounds",
    "split_by_cost",
    "stage_costs",
    "token_loss_sum",
    "token_normalized_loss",
]


def __getattr__(name: str) -> Any:
    if name in ("MLLMPipelineModule", "mark_boundary_outputs", "unused_float_inputs"):
        from dflop_ds.pipe import module

        return getattr(module, name)
    raise AttributeError(f"module 'dflop_ds.pipe' has no attribute {name!r}")
