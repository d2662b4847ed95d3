"""LLaVA-OneVision's data pipeline: LLaVA JSON records as contract microbatches.

The conversation template is the checkpoint's own, else LLaVA-v1's
(:class:`~dflop_ds.models.hf.base.template.TemplatePreprocessor`);
images and videos give the tokens :class:`~dflop_ds.models.hf.llava_onevision.shapes.OnevisionTokenRule`
counts (AnyRes for a lone image, one tile each for several, pooled frames plus a newline for a video).
A video's frames are ``min(frames, video_max_frames)`` frames sampled uniformly by the project's
PyAV path (:func:`~dflop_ds.data.video.decode_frames`), one tile each. The shape policy's encoder
cost is counted by tiles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dflop_ds.models.hf.base.collate import collate_padded
from dflop_ds.models.hf.base.dataset import MediaDataset, MediaItem
from dflop_ds.models.hf.base.tiled_data import TiledPreprocessor
from dflop_ds.models.hf.llava_onevision.synthetic import OnevisionMedia, stack_media
from dflop_ds.shapes import SampleShape, ShapePolicy


class OnevisionPreprocessor(TiledPreprocessor):
    """A LLaVA-OneVision directory's tokenizer and image processor, the conversation template and the
    checkpoint's counting rule (arguments as for :class:`~dflop_ds.models.hf.base.tiled_data.TiledPreprocessor`)."""

    family_name = "llava_onevision"
    media: OnevisionMedia

    def _media(self, tokenizer: Any, image_processor: Any, config: Any, name: str) -> OnevisionMedia:
        return OnevisionMedia(image_processor, config, name)

    def _media_tokens(self, tokenizer: Any) -> tuple[int, int, int | None]:
        return self.media.image_token_id, self.media.video_token_id, self.media.video_token_id

    def _uncut_tokens(self) -> set[int]:
        """Tokens a truncation must keep whole: every image and video token."""
        return {self.image_token_id, self.media.video_token_id}

    def policy(self) -> ShapePolicy:
        """The :class:`ShapePolicy` of this model's data: each sample's images by the counting rule,
        ``min(frames, video_max_frames)`` pooled frames per video plus its newline, exact conversation
        token counts; the encoder's cost is counted by tiles."""
        rule = self.media.rule
        pooled = rule.video(1)[1] - 1
        return self._policy(
            rule.tile_size,
            rule.side**2,
            max_frames=self.video_max_frames,
            tokens_per_frame=pooled,
            sample_images=rule,
            tokens_per_video=1,
        )


def _no_media() -> torch.Tensor:
    return torch.zeros(0, 5, dtype=torch.long)


@dataclass
class OnevisionItem(MediaItem):
    """One sample: its tiles ``pixel_values [T, C, H, W]`` (images, then the video's frames), ids,
    shifted targets and ``media [M, 5]`` rows (sample column 0)."""

    media: torch.Tensor = field(default_factory=_no_media)


class OnevisionDataset(MediaDataset):
    """The samples of ``shapes`` (made under ``preprocessor.policy()``) as LLaVA-OneVision contract
    tensors (arguments as :class:`~dflop_ds.models.hf.base.template.MediaDataset`)."""

    preprocessor: OnevisionPreprocessor
    supports_video = True
    size_sets_tokens = True

    def _blank_media(self, shape: SampleShape) -> tuple[torch.Tensor, list[list[int]]]:
        """Zero tiles and the media rows the sample's shape sizes (what :meth:`_item` loads, for a stand-in)."""
        rule = self.preprocessor.media.rule
        rows = [[0, 0, h, w, tiles] for (w, h), (tiles, _) in zip(shape.image_sizes, rule.images(shape.image_sizes))]
        if shape.video_frames:
            rows.append([0, 1, 0, 0, min(shape.video_frames, self.preprocessor.video_max_frames)])
        tiles = sum(row[4] for row in rows)
        return torch.zeros((tiles, *self.preprocessor.media.tile_shape)), rows

    def _item(self, shape: SampleShape, blank: bool) -> OnevisionItem:
        """The sample of ``shape`` with its media loaded, or (``blank``) zero tiles of the same count."""
        media = self.preprocessor.media
        if blank:
            tiles, rows = self._blank_media(shape)
        else:
            tiles, rows = media.image_tiles(self._load_images(shape))
            if shape.video_frames:
                count = min(shape.video_frames, self.preprocessor.video_max_frames)
                frame_tiles, video_rows = media.frame_tiles(self._uniform_frames(shape, count))
                tiles, rows = torch.cat([tiles, frame_tiles]), rows + video_rows
        counts = media.tokens(rows, len(shape.image_sizes))
        image_tokens = [c for c, row in zip(counts, rows) if not row[1]]
        video_tokens = next((c for c, row in zip(counts, rows) if row[1]), None)
        turns = self._turns(shape)
        ids, targets = self._tensors(shape, lambda: self.preprocessor.encode_media(turns, image_tokens, video_tokens))
        media_rows = torch.tensor(rows, dtype=torch.long).reshape(-1, 5)
        return OnevisionItem(shape.sample_id, tiles, ids, targets, self.preprocessor.pad_token_id, None, media_rows)

    def __getitem__(self, idx: Any) -> OnevisionItem:
        """The sample at ``idx`` (an ``int`` or a ``ScheduledIndex``, whose denominator is kept)."""
        return super().__getitem__(idx)  # type: ignore[return-value]


def collate_onevision(items: Sequence[OnevisionItem], packed: bool = False):
    """One microbatch ``((pixel_values, input_ids, seq_lens, media), (targets, loss_denominator))``:
    every sample's tiles in order and their media rows with the sample's index (padding, packing and
    denominator as :func:`~dflop_ds.models.hf.base.template.collate_padded`)."""
    (_, input_ids, seq_lens), labels = collate_padded(items, packed)
    pixel_values, media = stack_media(
        [(item.pixel_values, item.media.tolist()) for item in items], tuple(items[0].pixel_values.shape[1:])
    )
    return (pixel_values, input_ids, seq_lens, media), labels


def collate_packed_onevision(items: Sequence[OnevisionItem]):
    """:func:`collate_onevision` with ``packed=True`` (a picklable collate for DataLoader workers)."""
    return collate_onevision(items, packed=True)


__all__ = [
    "OnevisionDataset",
    "OnevisionItem",
    "OnevisionPreprocessor",
    "collate_onevision",
    "collate_packed_onevision",
]
