"""InternVL's data pipeline: LLaVA JSON records as LLaVA-contract microbatches of tiles.

The conversation template is LLaVA-v1's (:class:`~dflop_ds.models.hf.llava_data.LlavaPreprocessor`);
each image writes ``<img>``, its tiles' ``<IMG_CONTEXT>`` tokens and ``</img>`` (tiles by
:class:`~dflop_ds.models.hf.internvl_shapes.InternVLTileRule`), a video one ``Frame<i>: <img>...</img>``
line per frame, ``min(frames, video_max_frames)`` frames sampled uniformly by the project's PyAV
path, one tile each. The shape policy counts the encoder by tiles.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dflop_ds.data.errors import PathArg
from dflop_ds.data.video import DEFAULT_VIDEO_MAX_FRAMES
from dflop_ds.models.hf.folder import load_text_and_image_parts
from dflop_ds.models.hf.internvl_synthetic import InternVLMedia
from dflop_ds.models.hf.llava_data import (
    DEFAULT_SYSTEM,
    LlavaDataset,
    LlavaItem,
    LlavaPreprocessor,
    counting_identity,
)
from dflop_ds.shapes import SampleShape, ShapePolicy

TEMPLATE_NAME = "llava-v1+internvl-img"


class InternVLPreprocessor(LlavaPreprocessor):
    """An InternVL directory's tokenizer and image processor, the LLaVA-v1 template with InternVL's
    image blocks, and the checkpoint's tiling rule (arguments as for
    :class:`~dflop_ds.models.hf.llava_onevision_data.OnevisionPreprocessor`)."""

    def __init__(
        self,
        tokenizer: Any,
        image_processor: Any,
        config: Any,
        *,
        system: str = DEFAULT_SYSTEM,
        max_length: int | None = None,
        truncation: str = "error",
        name: str = "internvl",
        video_max_frames: int = DEFAULT_VIDEO_MAX_FRAMES,
    ) -> None:
        if video_max_frames < 1:
            raise ValueError(f"{name}: video_max_frames must be >= 1, got {video_max_frames}")
        self.media = InternVLMedia(tokenizer, image_processor, config, name)
        self.image_processor = image_processor
        self.video_token_id = self.media.context_id  # a video's frames write the image tokens
        self.video_max_frames = int(video_max_frames)
        self._set_text(tokenizer, self.media.context_id, system, max_length, truncation, name)
        self.pixel_shape = self.media.tile_shape

    @classmethod
    def from_pretrained(cls, model_dir: PathArg, **kwargs: Any) -> InternVLPreprocessor:
        """Load the tokenizer, image processor and config of a ``save_pretrained`` directory (offline)."""
        kwargs.setdefault("name", f"internvl:{Path(model_dir).name}")
        return cls(*load_text_and_image_parts(model_dir), **kwargs)

    def _image_block(self, tokens: int) -> list[int]:
        return self.media.image_ids(tokens)

    def _video_block(self, video_id: int, tokens: int) -> list[int]:
        return self.media.video_ids(tokens)

    def _uncut_tokens(self) -> set[int]:
        """Tokens a truncation must keep whole: the image blocks."""
        return {self.media.context_id, self.media.start_id, self.media.end_id}

    def count(
        self, turns: Sequence[tuple[str, str]], image_tokens: Sequence[int], video_tokens: int | None = None
    ) -> tuple[int, int]:
        """``(text_tokens, label_tokens)`` exactly as :meth:`encode_media` produces them (the image
        blocks' ``<img>`` / ``</img>`` and frame labels count as text)."""
        return self._counted(self.encode_media(turns, image_tokens, video_tokens))

    def identity(self) -> str:
        """What fixes the token counts: template, system line, tokenizer contents, image token, length rule."""
        return counting_identity(
            TEMPLATE_NAME, self.system, self.tokenizer, self.image_token_id, self.max_length, self.truncation
        )

    def policy(self) -> ShapePolicy:
        """The :class:`ShapePolicy` of this model's data: each image's tiles by the tiling rule,
        ``min(frames, video_max_frames)`` one-tile frames per video, exact conversation token counts."""
        rule = self.media.rule
        return ShapePolicy(
            tile_size=rule.tile_size,
            max_tiles=1,
            add_thumbnail=False,
            tokens_per_tile=rule.tokens_per_tile,
            max_frames=self.video_max_frames,
            tokens_per_frame=rule.tokens_per_tile,
            tokenizer=self.count_text,
            name=self.name,
            tokenizer_id=self.identity(),
            conversation=self.count,
            sample_images=rule,
        )


class InternVLDataset(LlavaDataset):
    """The samples of ``shapes`` (made under ``preprocessor.policy()``) as InternVL contract tensors:
    :class:`~dflop_ds.models.hf.llava_data.LlavaItem` with every tile (arguments as for
    :class:`~dflop_ds.models.hf.llava_data.LlavaDataset`)."""

    preprocessor: InternVLPreprocessor
    supports_video = True
    size_sets_tokens = True

    def _item(self, shape: SampleShape, blank: bool) -> LlavaItem:
        """The sample of ``shape`` with its tiles loaded, or (``blank``) zero tiles of the same count."""
        media, rule = self.preprocessor.media, self.preprocessor.media.rule
        frames = min(shape.video_frames, self.preprocessor.video_max_frames)
        counts = rule(shape.image_sizes)
        if blank:
            tiles = torch.zeros((sum(t for t, _ in counts) + frames, *media.tile_shape))
        else:
            tiles = media.image_tiles(self._load_images(shape))
            if frames:
                tiles = torch.cat([tiles, media.frame_tiles(self._uniform_frames(shape, frames))])
        video_tokens = rule.video(frames)[1] if shape.video_frames else None
        turns = self._turns(shape)
        image_tokens = [tokens for _, tokens in counts]
        ids, targets = self._tensors(shape, lambda: self.preprocessor.encode_media(turns, image_tokens, video_tokens))
        return LlavaItem(shape.sample_id, tiles, ids, targets, self.preprocessor.pad_token_id)


__all__ = ["InternVLDataset", "InternVLPreprocessor"]
