"""Moving training inputs onto the engine's device."""

from __future__ import annotations

from typing import Any

import torch


def move_to(value: Any, device: torch.device) -> Any:
    """``value`` (a tensor or nested tuples/lists of tensors) on ``device``."""
    if torch.is_tensor(value):
        return value.to(device, non_blocking=True)
    if isinstance(value, (tuple, list)):
        return type(value)(move_to(v, device) for v in value)
    return value
