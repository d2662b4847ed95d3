"""Default input factories for the pipeline tuple contract (docs/architecture.md).

A profiler needs inputs of a given size for the first layer of each segment. A factory is a
callable: the encoder's ``(tiles, batch) -> (pixels, input_ids, text_lens, tiles_per_sample)``
and the LLM's ``(batch, seq_len) -> (hidden, seq_lens)``. Pass your own to profile modules
with another input layout; later layers get the outputs of the layers before them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflop_ds.shapes import split_evenly

EncoderInputFactory = Callable[[int, int], tuple[torch.Tensor, ...]]
LLMInputFactory = Callable[[int, int], tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class ContractEncoderInputs:
    """Encoder inputs ``(pixels [T, C, P, P], input_ids [B, S], text_lens [B], tiles_per_sample [B])``.

    The ``tiles`` are spread evenly over the ``batch`` samples; every sample has
    ``text_tokens`` random text tokens below ``vocab_size``.
    """

    image_size: int
    channels: int = 3
    text_tokens: int = 8
    vocab_size: int = 32
    dtype: torch.dtype = torch.float32

    def __call__(self, tiles: int, batch: int = 1) -> tuple[torch.Tensor, ...]:
        if tiles < 0:
            raise ValueError(f"tiles must be >= 0, got {tiles}")
        pixels = torch.randn(tiles, self.channels, self.image_size, self.image_size, dtype=self.dtype)
        input_ids = torch.randint(1, max(2, self.vocab_size), (batch, self.text_tokens))
        text_lens = torch.full((batch,), self.text_tokens, dtype=torch.long)
        tiles_per_sample = torch.tensor(split_evenly(tiles, batch), dtype=torch.long)
        return pixels, input_ids, text_lens, tiles_per_sample


@dataclass(frozen=True)
class ContractLLMInputs:
    """LLM inputs ``(hidden [B, S, D], seq_lens [B])``: every sample ``seq_len`` long.

    A collated microbatch is padded to its longest sample, so ``(batch, longest)`` is what
    the LLM's cost depends on.
    """

    hidden_size: int
    dtype: torch.dtype = torch.float32

    def __call__(self, batch: int, seq_len: int) -> tuple[torch.Tensor, ...]:
        if batch < 1 or seq_len < 1:
            raise ValueError(f"batch and seq_len must be >= 1, got {batch} and {seq_len}")
        hidden = torch.randn(batch, seq_len, self.hidden_size, dtype=self.dtype)
        return hidden, torch.full((batch,), seq_len, dtype=torch.long)
