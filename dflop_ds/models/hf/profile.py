"""A HuggingFace model directory as a profiling target: its real vision tower and decoder layers.

``dflop-ds profile model --model_name_or_path DIR`` times the layer lists of the directory's
family (:func:`~dflop_ds.models.hf.preprocessor.family_preprocessor`) on inputs of the HF microbatch contract,
so the fitted cost model, and the stage split drawn from it, describe the real model. The cost
model records the directory's shape policy (tokens per image, tokenizer), and training refuses it
with data shaped under another one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dflop_ds.models.hf.base.folder import check_model_folder
from dflop_ds.models.hf.preprocessor import family_preprocessor
from dflop_ds.profile.inputs import ContractLLMInputs
from dflop_ds.profile.target import ProfileTarget, summed_cross_entropy


def hf_target(model_dir: str, *, text_tokens: int = 8) -> ProfileTarget:
    """The profiling target of a HuggingFace directory, by its family; a folder without config,
    weights or tokenizer is refused first, naming what it lacks."""
    check_model_folder(model_dir)
    family, preprocessor = family_preprocessor(model_dir)
    return family.profile_target(model_dir, preprocessor, text_tokens)


def family_profile_target(
    model_dir: str,
    preprocessor: Any,
    text_tokens: int,
    *,
    load: Callable[[str], Any],
    layers: Callable[[Any], tuple[list, Any, list]],
    encoder_inputs: Callable[[Any, int, Any], Any],
    llm_inputs: Callable[[int, Any], Any] = ContractLLMInputs,
) -> ProfileTarget:
    """A family's ``profile_target`` (bind the keywords): the layer lists of the model in ``model_dir``
    (``load``, then ``layers``), the input factories of its first encoder layer
    (``encoder_inputs(config, text_tokens, dtype)``) and first decoder layer (``llm_inputs(hidden size,
    dtype)``, the contract's by default), and ``preprocessor``'s shape policy."""
    model = load(model_dir)
    encoder, projector, llm = layers(model)
    return ProfileTarget(
        encoder_layers=encoder,
        projector=projector,
        llm_layers=llm,
        encoder_inputs=encoder_inputs(model.config, text_tokens, model.dtype),
        llm_inputs=llm_inputs(int(model.config.text_config.hidden_size), model.dtype),
        output_loss=summed_cross_entropy,
        policy=preprocessor.policy(),
    )
