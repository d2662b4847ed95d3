"""A HuggingFace model directory as a profiling target: its real vision tower and decoder layers.

``dflop-ds profile model --model_name_or_path DIR`` times the layer lists of the directory's
family (:func:`~dflop_ds.models.hf.registry.family_of`) on inputs of the HF microbatch contract,
so the fitted cost model, and the stage split drawn from it, describe the real model. The cost
model records the directory's shape policy (tokens per image, tokenizer), and training refuses it
with data shaped under another one.
"""

from __future__ import annotations

from dflop_ds.models.hf.folder import check_model_folder
from dflop_ds.models.hf.preprocessor import hf_preprocessor
from dflop_ds.models.hf.registry import family_of
from dflop_ds.profile.target import ProfileTarget


def hf_target(model_dir: str, *, text_tokens: int = 8) -> ProfileTarget:
    """The profiling target of a HuggingFace directory, by its family; a folder without config,
    weights or tokenizer is refused first, naming what it lacks."""
    check_model_folder(model_dir)
    return family_of(model_dir).profile_target(model_dir, hf_preprocessor(model_dir), text_tokens)
