"""The bundled tiny MLLM as a profiling target (the default of ``dflop-ds profile model``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch

from dflop_ds.profile.inputs import ContractEncoderInputs, ContractLLMInputs
from dflop_ds.shapes import TINY_POLICY, ShapePolicy


@dataclass
class ProfileTarget:
    """Everything :func:`~dflop_ds.profile.model.profile_model` needs about a model."""

    encoder_layers: Sequence[torch.nn.Module]
    projector: torch.nn.Module | None
    llm_layers: Sequence[torch.nn.Module]
    encoder_inputs: ContractEncoderInputs
    llm_inputs: ContractLLMInputs
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


def tiny_target(config: Any = None, *, seed: int = 0, text_tokens: int = 8) -> ProfileTarget:
    """The tiny MLLM's built layers and contract input factories for ``config``.

    ``text_tokens`` is the text each encoder sample carries into the projector.
    """
    from dflop_ds.models import TinyMLLMConfig, tiny_mllm_layers

    config = config or TinyMLLMConfig()
    encoder, projector, llm = tiny_mllm_layers(config, seed=seed, as_specs=False)
    return ProfileTarget(
        encoder_layers=encoder,
        projector=projector,
        llm_layers=llm,
        encoder_inputs=ContractEncoderInputs(
            image_size=config.image_size,
            channels=config.channels,
            text_tokens=text_tokens,
            vocab_size=config.vocab_size,
        ),
        llm_inputs=ContractLLMInputs(hidden_size=config.llm_dim),
        output_loss=summed_cross_entropy,
        policy=replace(TINY_POLICY, tokens_per_tile=config.tokens_per_tile, tokens_per_frame=config.tokens_per_tile),
    )
