"""Gather a trained model's full state on rank 0, whichever engine trained it.

Names follow the flat layer list: ``"<layer index>.<parameter>"`` (a pipeline's tied modules
keep DeepSpeed's ``"tied_modules.<key>.<parameter>"``). Under the pipeline engine each stage
owns its layers, so the first data-parallel replica of every stage sends its stage's state to
rank 0. Under the plain engine ZeRO stages 0-2 keep full parameters on every rank; ZeRO-3's
partitioned parameters are gathered first. Under AutoTP (``tensor_parallel.autotp_size > 1``)
the sharded linears (DeepSpeed's ``LinearLayer`` / ``LinearAllreduce``) are gathered module by
module with DeepSpeed's ``GatherReplacedLayerParams`` and re-sharded after, so the state holds
the full (unsharded) weights under the same names.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _cpu_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in module.state_dict().items()}


def _tensor_parallel_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state with every AutoTP-sharded parameter gathered whole (a collective over
    the tensor-parallel group: every rank walks the modules in the same order)."""
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    state: dict[str, torch.Tensor] = {}
    for prefix, child in module.named_modules():
        own = list(child.parameters(recurse=False))
        with GatherReplacedLayerParams(own, child, enabled=bool(own)):
            for name, tensor in [*child.named_parameters(recurse=False), *child.named_buffers(recurse=False)]:
                if tensor is not None and name not in child._non_persistent_buffers_set:
                    state[f"{prefix}.{name}" if prefix else name] = tensor.detach().to("cpu", copy=True)
    return state


def gather_full_state(trainer: Any) -> dict[str, torch.Tensor]:
    """The whole model's state on rank 0 (CPU tensors); other ranks get an empty dict.

    A collective: every rank must call it.
    """
    module = trainer.module
    if not trainer.is_pipeline:
        if trainer.tp_coords[1] > 1:
            state = _tensor_parallel_state(module)
        elif getattr(trainer.engine, "zero_optimization_stage", lambda: 0)() == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                state = _cpu_state(module)
        else:
            state = _cpu_state(module)
        return state if not dist.is_initialized() or dist.get_rank() == 0 else {}
    dp_rank, _ = trainer.dp_coords
    mine = _cpu_state(module) if dp_rank == 0 else None
    parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if parts is None:  # not rank 0
        return {}
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part or {})
    colocated = getattr(trainer, "colocated_pipeline", None)  # the encoder lives beside the pipeline
    return merged if colocated is None else colocated.full_state(merged)
