"""Plans of the tiny MLLM (5 encoder layers, a projector, 5 LLM layers) that several test files build."""

from __future__ import annotations

from typing import Any

from dflop_ds.plan import Plan
from dflop_ds.plan.layout import Layout, Segment

#: the tiny MLLM's layer counts, as a plan records them
TINY_LAYERS = {"encoder": 5, "projector": 1, "llm": 5}


def tiny_plan(layout: Layout, global_batch_size: int, **settings: Any) -> Plan:
    """``Plan.from_layout`` of the tiny MLLM: on 2 GPUs of 8 GB in one node, family ``"deepspeed"``, fp32,
    unless ``settings`` say otherwise (they also carry the plan's other keyword arguments)."""
    options: dict[str, Any] = {
        "gpus": 2,
        "gpus_per_node": 2,
        "gpu_memory_bytes": 8e9,
        "family": "deepspeed",
        "precision": "fp32",
    }
    options.update(settings)
    return Plan.from_layout(layout, layer_counts=dict(TINY_LAYERS), global_batch_size=global_batch_size, **options)


def one_stage_plan(**settings: Any) -> Plan:
    """No pipeline: data parallel over both GPUs, 2 microbatches of a global batch of 8."""
    return tiny_plan(Layout(Segment(1, 1, 2), Segment(1, 1, 2), 2, ((5, 1, 5),)), 8, **settings)


def two_stage_plan(**settings: Any) -> Plan:
    """A 2-stage pipeline (the encoder, the projector and one LLM layer first), 4 microbatches of a
    global batch of 12."""
    return tiny_plan(Layout(Segment(1, 1, 1), Segment(1, 2, 1), 4, ((5, 1, 1), (0, 0, 4))), 12, **settings)
