"""The memory cap a run trains under: the config's, the plan's, or a default from the device's memory.

``dflop.sampler.memory_cap_bytes`` is the activation bytes one device may hold. A number in the
config is used as it is and ``"off"`` means no cap; ``"auto"`` (the default) is the plan's cap
when the run follows a plan that records one (:func:`dflop_ds.config.fill_from_plan` puts it in
the block), else the device default of every rank (:func:`device_activation_budget`):

    budget = (free / sharing + held - states) * (1 - margin)

``free`` is what DeepSpeed's accelerator reports available on the device (what no process
holds), shared by the ``sharing`` ranks of this host on the same device (ranks on a CPU share
the host's memory; a GPU has one rank); ``held`` is what this process already holds
(``memory_allocated``: its weights, and on a CPU its whole resident memory), ``states`` the
weights, gradients and optimizer states of this rank's parameters under the ZeRO stage and
precision (:func:`rank_state_bytes`), and ``margin`` (:data:`DEFAULT_MEMORY_MARGIN`) keeps a
share free for the allocator, communication buffers and the cost model's error. Ranks must
compute the same schedules, so every rank takes the smallest budget of all ranks.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dflop_ds.config import AUTO, OFF
from dflop_ds.deepspeed_keys import deepspeed_keys
from dflop_ds.plan.cluster import state_factor

#: share of a device's free memory the default cap leaves unused
DEFAULT_MEMORY_MARGIN = 0.2
GB = 1e9


@dataclass(frozen=True)
class RunMemoryCap:
    """The cap a run trains under and where it came from.

    Attributes:
        bytes: the activation bytes one device may hold (None: no cap).
        source: ``"config"``, ``"plan"``, ``"device"``, ``"off"`` or ``"not the dflop sampler"``.
        detail: the figures behind a device default, for the log.
    """

    bytes: float | None
    source: str
    detail: str = ""

    def describe(self) -> str:
        """One line for the run's log."""
        if self.bytes is None:
            return f"no memory cap ({self.source})"
        detail = f": {self.detail}" if self.detail else ""
        return f"memory cap {self.bytes / GB:.3g} GB of activations per device (from the {self.source}{detail})"


def rank_state_bytes(module: torch.nn.Module, precision: str, zero_stage: int, dp: int) -> float:
    """Bytes of the weights, gradients and optimizer states of ``module``'s parameters (this rank's
    layers) on one rank of a ``dp``-way data-parallel group under ZeRO stage ``zero_stage``
    (:func:`~dflop_ds.plan.cluster.state_factor`; frozen parameters keep their weights alone).
    A parameter ZeRO-3 partitioned counts whole (``ds_numel``): the state factor shards it."""
    total = 0.0
    for param in module.parameters():
        weight_bytes = float(getattr(param, "ds_numel", param.numel())) * param.element_size()
        total += weight_bytes * float(state_factor(precision, zero_stage, dp, trainable=param.requires_grad))
    return total


def device_activation_budget(
    free: float, held: float, states: float, sharing: int = 1, margin: float = DEFAULT_MEMORY_MARGIN
) -> float:
    """``(free / sharing + held - states) * (1 - margin)``, at least 0: the activation bytes a
    device may hold (see the module docstring)."""
    if sharing < 1 or not 0 <= margin < 1:
        raise ValueError(f"need sharing >= 1 and 0 <= margin < 1, got {sharing}, {margin}")
    return max(float(free) / sharing + float(held) - float(states), 0.0) * (1.0 - margin)


def ranks_sharing_device(device_name: str) -> int:
    """How many ranks of this host run on ``device_name`` (1 without torch.distributed)."""
    if not torch.distributed.is_initialized():
        return 1
    mine = (socket.gethostname(), device_name)
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    return sum(1 for other in everyone if tuple(other) == mine)


def smallest_over_ranks(value: float, device_name: str) -> float:
    """The smallest ``value`` of all ranks (``value`` itself without torch.distributed)."""
    if not torch.distributed.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device_name)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN)
    return float(tensor.item())


def device_memory_cap(module: torch.nn.Module, ds_config: Mapping[str, Any], dp: int, accelerator: Any) -> RunMemoryCap:
    """The device default: :func:`device_activation_budget` of ``accelerator`` (DeepSpeed's
    ``get_accelerator()``) for this rank's ``module``, the smallest over all ranks (a collective
    when torch.distributed is initialized: every rank calls it).

    Raises:
        ValueError: the device has no memory left for activations, naming the figures.
    """
    device = accelerator.current_device_name()
    free = float(accelerator.available_memory())
    held = float(accelerator.memory_allocated())
    keys = deepspeed_keys(ds_config)
    zero_stage, precision = keys.stage, keys.precision
    states = rank_state_bytes(module, precision, zero_stage, dp)
    sharing = ranks_sharing_device(device)
    budget = smallest_over_ranks(device_activation_budget(free, held, states, sharing), device)
    detail = (
        f"{free / GB:.3g} GB available on {device} over {sharing} rank(s), {held / GB:.3g} GB held,"
        f" {states / GB:.3g} GB of model states ({precision}, ZeRO {zero_stage}, dp {dp}),"
        f" margin {DEFAULT_MEMORY_MARGIN:.0%}; the smallest of all ranks"
    )
    if budget <= 0:
        raise ValueError(
            f"dflop.sampler.memory_cap_bytes is 'auto' and the device leaves no memory for activations"
            f" ({detail}): set a number of bytes or 'off'"
        )
    return RunMemoryCap(budget, "device", detail)


def resolve_memory_cap(
    setting: float | str,
    sampler: str,
    from_plan: bool,
    device_default: Callable[[], RunMemoryCap],
    memory_blind: Any = None,
) -> RunMemoryCap:
    """The run's :class:`RunMemoryCap` from ``dflop.sampler.memory_cap_bytes`` (after
    :func:`~dflop_ds.config.fill_from_plan`): a number is the plan's (``from_plan``: the plan
    put it there) or the config's, ``"off"`` none, ``"auto"`` ``device_default()`` for the DFLOP
    sampler and none for the others (they cut microbatches whatever their memory) or when the
    sampler's cost model includes ``memory_blind``, a model that predicts no memory
    (:func:`~dflop_ds.cost.memory_blind_model`; a number is refused for it, by the sampler)."""
    if setting == OFF:
        return RunMemoryCap(None, "off")
    if setting == AUTO and sampler != "dflop":
        return RunMemoryCap(None, "not the dflop sampler")
    if setting == AUTO and memory_blind is not None:
        return RunMemoryCap(None, f"{type(memory_blind).__name__} predicts no memory")
    if setting == AUTO:
        return device_default()
    return RunMemoryCap(float(setting), "plan" if from_plan else "config")
