"""What the model profiler needs of a model: its layers, input factories and loss (:class:`ProfileTarget`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflop_ds.profile.inputs import EncoderInputFactory, LLMInputFactory
from dflop_ds.shapes import ShapePolicy


@dataclass
class ProfileTarget:
    """Everything :func:`~dflop_ds.profile.model.profile_model` needs about a model."""

    encoder_layers: Sequence[torch.nn.Module]
    projector: torch.nn.Module | None
    llm_layers: Sequence[torch.nn.Module]
    encoder_inputs: EncoderInputFactory
    llm_inputs: LLMInputFactory
    output_loss: Callable[[Any], torch.Tensor] | None = None
    #: the shape policy of the model's data (stored in the fitted cost model); None: unknown
    policy: ShapePolicy | None = None

    def profile_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``profile_model``."""
        return {
            "encoder_layers": self.encoder_layers,
            "llm_layers": self.llm_layers,
            "projector": self.projector,
            "encoder_inputs": self.encoder_inputs,
            "llm_inputs": self.llm_inputs,
            "output_loss": self.output_loss,
        }


def summed_cross_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``logits [B, S, V]`` against token 0 everywhere, summed: the cost of
    the training loss on the last stage, whatever the targets."""
    flat = logits.reshape(-1, logits.shape[-1])
    targets = torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device)
    return torch.nn.functional.cross_entropy(flat.float(), targets, reduction="sum")
