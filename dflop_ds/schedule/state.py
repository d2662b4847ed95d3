"""Where a batch sampler is in its schedule, and which dataset that schedule belongs to."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from dflop_ds.shapes import SampleShape


@dataclass(frozen=True, order=True)
class Position:
    """The next microbatch a data-parallel rank will train: microbatch ``microbatch`` of global
    batch ``batch`` (counted within ``epoch``)."""

    epoch: int = 0
    batch: int = 0
    microbatch: int = 0


def dataset_fingerprint(shapes: Sequence[SampleShape]) -> str:
    """A short hash of every sample's id and shape, in dataset order: a sampler state taken on
    one dataset is refused on another (reordered, filtered or re-tokenized) one."""
    digest = hashlib.sha256()
    for shape in shapes:
        row = [
            shape.sample_id,
            [list(size) for size in shape.image_sizes],
            shape.video_frames,
            shape.text_tokens,
            shape.label_tokens,
            shape.encoder_tiles,
            shape.visual_tokens,
            shape.llm_tokens,
        ]
        digest.update(json.dumps(row, separators=(",", ":")).encode())
        digest.update(b"\n")
    return digest.hexdigest()[:16]


def describe_dataset(shapes: Sequence[SampleShape]) -> str:
    """``"101 samples, ids 'a' .. 'z', fingerprint 0123abcd..."`` for error messages."""
    if not shapes:
        return "an empty dataset"
    return (
        f"{len(shapes)} samples, ids {shapes[0].sample_id!r} .. {shapes[-1].sample_id!r},"
        f" fingerprint {dataset_fingerprint(shapes)}"
    )
