"""What ``dflop-ds check-model`` (:mod:`~dflop_ds.models.hf.check`) needs of a model family."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


def no_batches(seed: int, config: Any) -> list[tuple[str, list]]:
    """No microbatches beyond :func:`synthetic_batches` (families without videos)."""
    return []


class MicrobatchBuilder(Protocol):
    """Builds one contract microbatch ``(inputs, labels)`` of synthetic samples, right-padded or packed."""

    def __call__(self, samples: Sequence[Any], *, packed: bool = False) -> tuple: ...


@dataclass(frozen=True)
class CheckParts:
    """What check-model needs of a model family: load the model, its layer lists, a microbatch
    builder from the directory (``(model_dir, config) ->`` :class:`MicrobatchBuilder`), how a
    prompt marks an image, the HF model's keyword arguments of a microbatch, and the HF vision
    tower's hidden states (``hidden_states[j]`` after encoder entry ``j``; ``None`` without images);
    ``extra_batches(seed, config)``: the family's own microbatches (videos) besides :func:`synthetic_batches`."""

    load: Callable[[Path], Any]
    layers: Callable[[Any], tuple[list, Any, list]]
    microbatches: Callable[[Path, Any], MicrobatchBuilder]
    image_mark: str
    hf_kwargs: Callable[[Any, tuple], dict]
    vision_states: Callable[[Any, tuple], Any]
    extra_batches: Callable[[int, Any], list[tuple[str, list]]] = no_batches


__all__ = ["CheckParts", "MicrobatchBuilder", "no_batches"]
