"""Gather a trained model's full state on rank 0, whichever engine trained it.

Names follow the flat layer list: ``"<layer index>.<parameter>"`` (a pipeline's tied modules
keep DeepSpeed's ``"tied_modules.<key>.<parameter>"``). Under the pipeline engine each stage
owns its layers, so the first data-parallel replica of every stage sends its stage's state to
rank 0. Under the plain engine ZeRO stages 0-2 keep full parameters on every rank; ZeRO-3's
partitioned parameters are gathered first.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _cpu_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in module.state_dict().items()}


def gather_full_state(trainer: Any) -> dict[str, torch.Tensor]:
    """The whole model's state on rank 0 (CPU tensors); other ranks get an empty dict.

    A collective: every rank must call it.
    """
    module = trainer.module
    if not trainer.is_pipeline:
        if getattr(trainer.engine, "zero_optimization_stage", lambda: 0)() == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                state = _cpu_state(module)
        else:
            state = _cpu_state(module)
        return state if not dist.is_initialized() or dist.get_rank() == 0 else {}
    dp_rank, _ = trainer.dp_coords
    mine = _cpu_state(module) if dp_rank == 0 else None
    parts: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if dist.get_rank() != 0:
        return {}
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part or {})
    return merged
