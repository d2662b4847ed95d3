"""Run a model with its attention replaced by an identity, to time attention separately.

DFLOP times the LLM with and without attention; the difference is the attention time. Any
module that calls ``torch.nn.functional.scaled_dot_product_attention`` (however it imported
it) is covered: a torch-function mode intercepts the call and returns the values instead of
the attention-weighted values. Models with a hand-written attention can pass their own
``attention_off`` context to the profiler instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_SDPA = F.scaled_dot_product_attention


class AttentionOff(TorchFunctionMode):
    """Torch-function mode that turns scaled-dot-product attention into ``output = value``.

    ``calls`` counts the attention calls replaced, so the profiler can tell whether the model
    uses this op at all.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is _SDPA or getattr(func, "__name__", "") == "scaled_dot_product_attention":
            query = kwargs.get("query", args[0] if args else None)
            value = kwargs.get("value", args[2] if len(args) > 2 else None)
            if isinstance(query, torch.Tensor) and isinstance(value, torch.Tensor):
                length = query.shape[-2]
                if value.shape[-2] >= length:
                    self.calls += 1
                    if value.dim() >= 3 and query.dim() >= 3 and value.shape[-3] != query.shape[-3]:
                        # grouped-query attention: each key/value head serves several query heads
                        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], dim=-3)
                    return value[..., :length, :]
        return func(*args, **kwargs)
