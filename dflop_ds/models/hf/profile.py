"""A HuggingFace LLaVA directory as a profiling target: its real vision tower and decoder layers.

``dflop-ds profile model --model_name_or_path DIR`` times the layer lists of
:func:`dflop_ds.models.hf.llava.llava_layers` on inputs of the HF microbatch contract, so the
fitted cost model, and the stage split drawn from it, describe the real model. The cost model
records the directory's shape policy (tokens per image, tokenizer), and training refuses it with
data shaped under another policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dflop_ds.profile.inputs import ContractLLMInputs, split_evenly
from dflop_ds.profile.tiny import ProfileTarget, summed_cross_entropy


@dataclass(frozen=True)
class LlavaEncoderInputs:
    """Encoder inputs ``(pixel_values [T, C, H, W], input_ids [B, S], seq_lens [B])`` for ``T`` images.

    The images are spread evenly over the ``batch`` samples; each sample is its image tokens
    (``image_seq_length`` per image) followed by ``text_tokens`` random text tokens.
    """

    pixel_shape: tuple[int, int, int]
    image_seq_length: int
    image_token_id: int
    vocab_size: int
    text_tokens: int = 8
    dtype: torch.dtype = torch.float32

    def __call__(self, tiles: int, batch: int = 1) -> tuple[torch.Tensor, ...]:
        if tiles < 0:
            raise ValueError(f"tiles must be >= 0, got {tiles}")
        pixels = torch.randn(tiles, *self.pixel_shape, dtype=self.dtype)
        per_sample = split_evenly(tiles, batch)
        lengths = [n * self.image_seq_length + self.text_tokens for n in per_sample]
        input_ids = torch.zeros(batch, max(lengths), dtype=torch.long)
        for row, n in enumerate(per_sample):
            images = n * self.image_seq_length
            input_ids[row, :images] = self.image_token_id
            text = torch.randint(0, self.vocab_size, (self.text_tokens,))
            text[text == self.image_token_id] = 0
            input_ids[row, images:images + self.text_tokens] = text
        return pixels, input_ids, torch.tensor(lengths, dtype=torch.long)


def llava_target(model_dir: str, *, text_tokens: int = 8) -> ProfileTarget:
    """The layer lists and contract input factories of the LLaVA model in ``model_dir``."""
    from dflop_ds.models.hf.data import LlavaPreprocessor
    from dflop_ds.models.hf.llava import llava_layers, load_llava

    model = load_llava(model_dir)
    preprocessor = LlavaPreprocessor.from_pretrained(model_dir)
    encoder, projector, llm = llava_layers(model)
    dtype = next(model.parameters()).dtype
    text_config: Any = model.config.text_config
    return ProfileTarget(
        encoder_layers=encoder,
        projector=projector,
        llm_layers=llm,
        encoder_inputs=LlavaEncoderInputs(  # type: ignore[arg-type]
            pixel_shape=preprocessor.pixel_shape, image_seq_length=preprocessor.image_seq_length,
            image_token_id=preprocessor.image_token_id, vocab_size=text_config.vocab_size,
            text_tokens=text_tokens, dtype=dtype),
        llm_inputs=ContractLLMInputs(hidden_size=text_config.hidden_size, dtype=dtype),
        output_loss=summed_cross_entropy,
        policy=preprocessor.policy(),
    )
