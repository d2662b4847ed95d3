"""A HuggingFace LLaVA directory as a profiling target: its real vision tower and decoder layers.

``dflop-ds profile model --model_name_or_path DIR`` times the layer lists of
:func:`dflop_ds.models.hf.llava.llava_layers` on inputs of the HF microbatch contract
(:func:`~dflop_ds.models.hf.llava.llava_input_factories`), so the fitted cost model, and the
stage split drawn from it, describe the real model. The cost model records the directory's shape
policy (tokens per image, tokenizer), and training refuses it with data shaped under another one.
"""

from __future__ import annotations

from dflop_ds.profile.tiny import ProfileTarget, summed_cross_entropy


def llava_target(model_dir: str, *, text_tokens: int = 8) -> ProfileTarget:
    """The layer lists, contract input factories and shape policy of the LLaVA model in ``model_dir``."""
    from dflop_ds.models.hf.data import LlavaPreprocessor
    from dflop_ds.models.hf.llava import llava_input_factories, llava_layers, load_llava

    model = load_llava(model_dir)
    encoder, projector, llm = llava_layers(model)
    encoder_inputs, llm_inputs = llava_input_factories(model, text_tokens)
    return ProfileTarget(encoder_layers=encoder, projector=projector, llm_layers=llm, encoder_inputs=encoder_inputs,
                         llm_inputs=llm_inputs, output_loss=summed_cross_entropy,
                         policy=LlavaPreprocessor.from_pretrained(model_dir).policy())
