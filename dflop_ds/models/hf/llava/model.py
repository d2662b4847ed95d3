"""HF ``LlavaForConditionalGeneration`` as the pipeline's flat layer lists.

:func:`llava_layers` turns a loaded model into ``(encoder_layers, projector, llm_layers)``:

* encoder (:mod:`~dflop_ds.models.hf.base.vision`): :class:`VisionEmbeddings` (patch + position
  embeddings, and CLIP's ``pre_layrnorm``) then one :class:`VisionLayer` per tower layer up to
  ``vision_feature_layer`` (layers after it do not change the features LLaVA uses and are left
  out). ``(pixel_values|vis, input_ids, seq_lens) -> (vis, input_ids, seq_lens)``; zero images give an empty ``vis``.
* projector: :class:`FeatureProjector`: feature select strategy, ``multi_modal_projector``, token
  embedding, and the features written where the ``<image>`` tokens are:
  ``-> (hidden [B, S, D], seq_lens)``.
* LLM: one :class:`~dflop_ds.models.hf.base.layers.DecoderLayer` per decoder layer, then the
  :class:`~dflop_ds.models.hf.base.layers.LMHead` (final norm + ``lm_head``).

A packed microbatch (``input_ids [1, sum(seq_lens)]``, :mod:`dflop_ds.models.packing`) runs through
the same layers: the projector's merge is row-major either way, and the decoder layers restart
positions and attention at every sample, giving ``hidden``/``logits [1, sum(seq_lens), ...]``.

Every entry holds the HF submodules themselves, so the layers and the HF model share weights.
Supported: vision towers :data:`VISION_TYPES`, text models :data:`TEXT_TYPES`, an integer
``vision_feature_layer``, strategies ``default`` and ``full``. transformers is imported only
by the functions that need it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflop_ds.models.hf.base.layers import (
    TEXT_TYPES,
    LMHead,
    decoder_layers,
    load_checked,
    tied_embedding_key,
)
from dflop_ds.models.hf.base.vision import (
    FeatureProjector,
    TileEncoderInputs,
    VisionEmbeddings,
    VisionLayer,
    feature_depth,
)
from dflop_ds.profile.inputs import ContractLLMInputs

MODEL_TYPE = "llava"
VISION_TYPES = ("clip_vision_model", "siglip_vision_model")
STRATEGIES = ("default", "full")


def check_llava_config(config: Any, where: str = "model") -> None:
    """Refuse a config this adapter cannot run exactly, naming ``where`` and what is supported."""
    if getattr(config, "model_type", None) != MODEL_TYPE:
        raise ValueError(
            f"{where}: model type {getattr(config, 'model_type', None)!r} is not supported by the "
            f"LLaVA adapter (supported: 'llava' with vision towers {list(VISION_TYPES)} and text models "
            f"{list(TEXT_TYPES)})"
        )
    vision_type = config.vision_config.model_type
    if vision_type not in VISION_TYPES:
        raise ValueError(f"{where}: vision tower {vision_type!r} is not supported (supported: {list(VISION_TYPES)})")
    text_type = config.text_config.model_type
    if text_type not in TEXT_TYPES:
        raise ValueError(f"{where}: text model {text_type!r} is not supported (supported: {list(TEXT_TYPES)})")
    layer = config.vision_feature_layer
    if not isinstance(layer, int):
        raise ValueError(
            f"{where}: vision_feature_layer={layer!r} (several layers) is not supported; use a single integer layer"
        )
    n = int(config.vision_config.num_hidden_layers)
    if not -(n + 1) <= layer <= n:
        raise ValueError(f"{where}: vision_feature_layer={layer} is outside the tower's {n} layers")
    strategy = config.vision_feature_select_strategy
    if strategy not in STRATEGIES:
        raise ValueError(
            f"{where}: vision_feature_select_strategy={strategy!r} is not supported (supported: {list(STRATEGIES)})"
        )


def load_llava(model_dir: str | Path, *, dtype: torch.dtype | None = None) -> Any:
    """Load a ``save_pretrained`` LLaVA directory as ``LlavaForConditionalGeneration`` (offline).

    The config is checked first (:func:`check_llava_config`), so an unsupported model is named
    before its weights are read.
    """
    from transformers import LlavaForConditionalGeneration

    return load_checked(model_dir, check_llava_config, lambda config: LlavaForConditionalGeneration, dtype)


def llava_input_factories(model: Any, text_tokens: int = 8) -> tuple[TileEncoderInputs, Any]:
    """``(encoder_inputs, llm_inputs)`` factories for :func:`dflop_ds.profile.model.profile_model`
    over :func:`llava_layers`, so that a cost model (and from it the stage split) measures the real layers."""
    dtype = model.dtype
    return (
        TileEncoderInputs(model.config, text_tokens, dtype),
        ContractLLMInputs(int(model.config.text_config.hidden_size), dtype),
    )


def llava_layers(model: Any) -> tuple[list[nn.Module], nn.Module, list[nn.Module]]:
    """``(encoder_layers, projector, llm_layers)`` of a ``LlavaForConditionalGeneration``, sharing its weights.

    With tied word embeddings the projector's ``embed_tokens`` and the head's ``lm_head`` declare
    the same :data:`TIED_EMBEDDING_KEY`, which ``MLLMPipelineModule`` keeps equal across stages.
    """
    config = model.config
    check_llava_config(config, type(model).__name__)
    body = model.model
    tower, language_model = body.vision_tower, body.language_model
    vision = getattr(tower, "vision_model", tower)  # older transformers wrap the transformer once more
    encoder: list[nn.Module] = [VisionEmbeddings(vision.embeddings, getattr(vision, "pre_layrnorm", None))]
    encoder += [VisionLayer(layer) for layer in list(vision.encoder.layers)[: feature_depth(config)]]
    key = tied_embedding_key(model.lm_head, language_model)
    projector = FeatureProjector(
        body.multi_modal_projector,
        language_model.embed_tokens,
        config.image_token_id,
        config.vision_feature_select_strategy,
        tied_key=key,
    )
    llm: list[nn.Module] = [*decoder_layers(language_model), LMHead(language_model.norm, model.lm_head, tied_key=key)]
    return encoder, projector, llm


__all__ = [
    "MODEL_TYPE",
    "STRATEGIES",
    "VISION_TYPES",
    "check_llava_config",
    "llava_input_factories",
    "llava_layers",
    "load_llava",
]
