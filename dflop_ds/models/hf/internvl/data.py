"""InternVL's data pipeline: LLaVA JSON records as LLaVA-contract microbatches of tiles.

The conversation template is the checkpoint's own, else LLaVA-v1's
(:class:`~dflop_ds.models.hf.base.template.TemplatePreprocessor`);
each image writes ``<img>``, its tiles' ``<IMG_CONTEXT>`` tokens and ``</img>`` (tiles by
:class:`~dflop_ds.models.hf.internvl.shapes.InternVLTileRule`), a video one ``Frame<i>: <img>...</img>``
line per frame, ``min(frames, video_max_frames)`` frames sampled uniformly by the project's PyAV
path, one tile each. The shape policy counts the encoder by tiles.
"""

from __future__ import annotations

from typing import Any

import torch

from dflop_ds.models.hf.base.dataset import MediaDataset, MediaItem
from dflop_ds.models.hf.base.tiled_data import TiledPreprocessor
from dflop_ds.models.hf.internvl.synthetic import VIDEO_MARK, InternVLMedia
from dflop_ds.shapes import SampleShape, ShapePolicy


class InternVLPreprocessor(TiledPreprocessor):
    """An InternVL directory's tokenizer and image processor, the conversation template with InternVL's
    image blocks, and the checkpoint's tiling rule (arguments as for
    :class:`~dflop_ds.models.hf.base.tiled_data.TiledPreprocessor`)."""

    family_name = "internvl"
    template_name = "llava-v1+internvl-img"
    media: InternVLMedia

    def _media(self, tokenizer: Any, image_processor: Any, config: Any, name: str) -> InternVLMedia:
        return InternVLMedia(tokenizer, image_processor, config, name)

    def _media_tokens(self, tokenizer: Any) -> tuple[int, int, int | None]:
        """A video's frames write the image tokens; a chat template marks the video with ``<video>``."""
        video_marker = tokenizer.convert_tokens_to_ids(VIDEO_MARK)
        known = video_marker is not None and video_marker != tokenizer.unk_token_id
        return self.media.context_id, self.media.context_id, int(video_marker) if known else None

    def _image_block(self, tokens: int) -> list[int]:
        return self.media.image_ids(tokens)

    def _video_block(self, video_id: int, tokens: int) -> list[int]:
        return self.media.video_ids(tokens)

    def _uncut_tokens(self) -> set[int]:
        """Tokens a truncation must keep whole: the image blocks."""
        return {self.media.context_id, self.media.start_id, self.media.end_id}

    def policy(self) -> ShapePolicy:
        """The :class:`ShapePolicy` of this model's data: each image's tiles by the tiling rule,
        ``min(frames, video_max_frames)`` one-tile frames per video, exact conversation token counts."""
        rule = self.media.rule
        return self._policy(
            rule.tile_size,
            rule.tokens_per_tile,
            max_frames=self.video_max_frames,
            tokens_per_frame=rule.tokens_per_tile,
            sample_images=rule,
        )


class InternVLDataset(MediaDataset):
    """The samples of ``shapes`` (made under ``preprocessor.policy()``) as InternVL contract tensors:
    :class:`~dflop_ds.models.hf.base.template.MediaItem` with every tile (arguments as for
    :class:`~dflop_ds.models.hf.base.template.MediaDataset`)."""

    preprocessor: InternVLPreprocessor
    supports_video = True
    size_sets_tokens = True

    def _item(self, shape: SampleShape, blank: bool) -> MediaItem:
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
        return MediaItem(shape.sample_id, tiles, ids, targets, self.preprocessor.pad_token_id)


__all__ = ["InternVLDataset", "InternVLPreprocessor"]
