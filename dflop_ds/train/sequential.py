"""The plain engine's model: the flat layer lists run one after the other."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def built_layers(layers: Sequence[Any]) -> list[nn.Module]:
    """``layers`` as modules: ``LayerSpec``s built, modules kept."""
    return [
        layer.build() if hasattr(layer, "build") and not isinstance(layer, nn.Module) else layer for layer in layers
    ]


class SequentialMLLM(nn.Sequential):
    """Encoder, projector and LLM layers run one after the other: the model of the plain engine.

    Parameters keep the flat layer index as their name prefix (``"3.weight"``), as in a
    ``PipelineModule``, so checkpoints and comparisons line up across engine kinds.
    """

    def __init__(
        self,
        encoder_layers: Sequence[Any],
        projector: Any,
        llm_layers: Sequence[Any],
        *,
        freeze_encoder: bool = False,
        checkpoint_layers: bool = False,
    ) -> None:
        built = built_layers((*encoder_layers, projector, *llm_layers))
        super().__init__(*built)
        self.n_encoder_layers = len(encoder_layers)
        self.checkpoint_layers = checkpoint_layers
        if freeze_encoder:
            for layer in built[: self.n_encoder_layers]:
                layer.requires_grad_(False)

    def forward(self, *inputs: Any) -> Any:
        """Run the layers on ``inputs``: one tuple, or its tensors as separate arguments (how
        the engine calls it under AutoTP, whose check that a tensor-parallel group received the
        same data compares a flat argument list only). With ``checkpoint_layers`` each layer's
        activations are recomputed in backward instead of kept."""
        x = inputs[0] if len(inputs) == 1 else inputs
        if not (self.checkpoint_layers and torch.is_grad_enabled()):
            return super().forward(x)
        for layer in self:
            x = checkpoint(layer, x, use_reentrant=False)
        return x
