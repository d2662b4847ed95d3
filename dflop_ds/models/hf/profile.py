"""A HuggingFace LLaVA or Qwen2-VL directory as a profiling target: its real vision tower and decoder layers.

``dflop-ds profile model --model_name_or_path DIR`` times the layer lists of
:func:`dflop_ds.models.hf.llava.llava_layers` on inputs of the HF microbatch contract
(:func:`~dflop_ds.models.hf.llava.llava_input_factories`), so the fitted cost model, and the
stage split drawn from it, describe the real model. The cost model records the directory's shape
policy (tokens per image, tokenizer), and training refuses it with data shaped under another one.
"""

from __future__ import annotations

from dflop_ds.models.hf.common import model_type
from dflop_ds.models.hf.data import LlavaPreprocessor
from dflop_ds.models.hf.folder import check_model_folder
from dflop_ds.models.hf.llava import llava_input_factories, llava_layers, load_llava
from dflop_ds.models.hf.qwen2_vl import (
    MODEL_CLASSES,
    MRopeLLMInputs,
    Qwen2VLEncoderInputs,
    load_qwen2_vl,
    qwen2_vl_layers,
)
from dflop_ds.models.hf.qwen2_vl_data import Qwen2VLPreprocessor
from dflop_ds.profile.target import ProfileTarget, summed_cross_entropy


def llava_target(model_dir: str, *, text_tokens: int = 8) -> ProfileTarget:
    """The layer lists, contract input factories and shape policy of the LLaVA model in ``model_dir``."""
    model = load_llava(model_dir)
    encoder, projector, llm = llava_layers(model)
    encoder_inputs, llm_inputs = llava_input_factories(model, text_tokens)
    return ProfileTarget(
        encoder_layers=encoder,
        projector=projector,
        llm_layers=llm,
        encoder_inputs=encoder_inputs,
        llm_inputs=llm_inputs,
        output_loss=summed_cross_entropy,
        policy=LlavaPreprocessor.from_pretrained(model_dir).policy(),
    )


def qwen2_vl_target(model_dir: str, *, text_tokens: int = 8) -> ProfileTarget:
    """The layer lists, input factories and shape policy of the Qwen2-VL model in ``model_dir``
    (the encoder sweep's "tiles" are patches, the policy's encoder units)."""
    model = load_qwen2_vl(model_dir)
    encoder, projector, llm = qwen2_vl_layers(model)
    return ProfileTarget(
        encoder_layers=encoder,
        projector=projector,
        llm_layers=llm,
        encoder_inputs=Qwen2VLEncoderInputs(model.config, text_tokens, model.dtype),
        llm_inputs=MRopeLLMInputs(model.config.text_config.hidden_size, model.dtype),
        output_loss=summed_cross_entropy,
        policy=Qwen2VLPreprocessor.from_pretrained(model_dir).policy(),
    )


def hf_target(model_dir: str, *, text_tokens: int = 8) -> ProfileTarget:
    """The profiling target of a HuggingFace directory, by its ``config.model_type`` (LLaVA or Qwen2-VL);
    a folder without config, weights or tokenizer is refused first, naming what it lacks."""
    check_model_folder(model_dir)
    if model_type(model_dir) in MODEL_CLASSES:
        return qwen2_vl_target(model_dir, text_tokens=text_tokens)
    return llava_target(model_dir, text_tokens=text_tokens)
