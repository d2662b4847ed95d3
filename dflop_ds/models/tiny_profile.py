"""The bundled tiny MLLM as a profiling target (the default of ``dflop-ds profile model``)."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from dflop_ds.cost import FittedCostModel
from dflop_ds.models.tiny import TinyMLLMConfig, tiny_mllm_layers
from dflop_ds.profile.cache import cached_cost_model
from dflop_ds.profile.inputs import ContractEncoderInputs, ContractLLMInputs
from dflop_ds.profile.target import ProfileTarget, summed_cross_entropy
from dflop_ds.shapes import TINY_POLICY


def tiny_target(config: Any = None, *, seed: int = 0, text_tokens: int = 8) -> ProfileTarget:
    """The tiny MLLM's built layers and contract input factories for ``config``.

    ``text_tokens`` is the text each encoder sample carries into the projector.
    """
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


def tiny_model_identity(model_overrides: dict[str, Any]) -> dict[str, Any]:
    """What keys the tiny MLLM with ``model_overrides`` of its config in the profile cache."""
    return {"name": "tiny_mllm", **asdict(TinyMLLMConfig(**model_overrides))}


def cached_tiny_cost_model(
    model_overrides: dict[str, Any], folder: str | Path | None = None, **kwargs: Any
) -> tuple[FittedCostModel, Path]:
    """:func:`~dflop_ds.profile.cache.cached_cost_model` of the bundled tiny MLLM with
    ``model_overrides`` of its config."""
    config = TinyMLLMConfig(**model_overrides)
    return cached_cost_model(tiny_model_identity(model_overrides), lambda: tiny_target(config), folder, **kwargs)
