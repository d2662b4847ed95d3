"""The search's families, one strategy each (see :class:`~dflop_ds.plan.families.core.Family`).

- ``deepspeed``: one DeepSpeed pipeline of encoder and LLM layers split by cost, our microbatches;
- ``colocated``: the encoder data-parallel over every GPU, the LLM pipeline over its own layers;
- ``monolithic``: the stock baseline (uniform split, fixed-size microbatches).
"""

from dflop_ds.plan.families.colocated import COLOCATED, ColocatedFamily, evaluate_colocated
from dflop_ds.plan.families.core import DEFAULT_NMB, Family, PlanError, Scored, sample_batches
from dflop_ds.plan.families.pipeline import DEEPSPEED, MONOLITHIC, PipelineFamily
from dflop_ds.plan.layout import Layout

FAMILIES: dict[str, Family] = {f.name: f for f in (DEEPSPEED, COLOCATED, MONOLITHIC)}


def family_of(layout: Layout) -> Family:
    """The family that evaluates ``layout``: ``colocated``, or a shared pipeline's (``monolithic``
    for the stock splitter, ``deepspeed`` for the others: they evaluate alike)."""
    if layout.colocated:
        return COLOCATED
    return MONOLITHIC if layout.splitter == "stock" else DEEPSPEED


__all__ = [
    "COLOCATED",
    "ColocatedFamily",
    "DEEPSPEED",
    "DEFAULT_NMB",
    "FAMILIES",
    "Family",
    "MONOLITHIC",
    "PipelineFamily",
    "PlanError",
    "Scored",
    "evaluate_colocated",
    "family_of",
    "sample_batches",
]
