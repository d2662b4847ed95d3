"""LLaVA-OneVision's media as contract tensors, and contract microbatches built straight from
(prompt, answer, images[, video frames]) for checks and tests.

Images go through the directory's ``LlavaOnevisionImageProcessor`` (AnyRes tiles for a sample's
lone image, one square-padded tile for each of several); video frames, which its video processor
would take (it needs torchvision), are resized to one tile and normalized with the image
processor's mean and std. Token counts come from :class:`~dflop_ds.models.hf.llava_onevision_shapes.OnevisionTokenRule`,
which counts as the processor does. See :mod:`~dflop_ds.models.hf.llava_onevision` for the contract.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflop_ds.models.hf.common import padding_mask
from dflop_ds.models.hf.folder import load_tokenizer_and_image_processor
from dflop_ds.models.hf.llava_onevision import HEIGHT, IS_VIDEO, SAMPLE, TILES, WIDTH
from dflop_ds.models.hf.llava_onevision_shapes import OnevisionTokenRule
from dflop_ds.models.hf.llava_synthetic import append_answer, pad_token_id, stack_rows

IMAGE_MARK = "<image>"
VIDEO_MARK = "<video>"


def onevision_rule(config: Any, image_processor: Any, where: str = "model") -> OnevisionTokenRule:
    """The counting rule of a checkpoint: its config's tower and ``vision_aspect_ratio``, checked
    against the image processor's tile size and grid pinpoints (which must agree)."""
    vision = config.vision_config
    size = dict(image_processor.size)
    tile = int(size.get("height") or size["shortest_edge"])
    if tile != int(vision.image_size):
        raise ValueError(
            f"{where}: the image processor's tiles are {tile} px but the tower's image_size is {vision.image_size}"
        )
    pinpoints = [list(p) for p in image_processor.image_grid_pinpoints]
    if pinpoints != [list(p) for p in config.image_grid_pinpoints]:
        raise ValueError(f"{where}: the image processor's image_grid_pinpoints differ from the model config's")
    return OnevisionTokenRule(
        tile_size=tile,
        patch_size=int(vision.patch_size),
        pinpoints=tuple((int(p[0]), int(p[1])) for p in pinpoints),
        max_tiles=int(str(config.vision_aspect_ratio).removeprefix("anyres_max_")),
        drops_first_feature=config.vision_feature_select_strategy == "default",
    )


class OnevisionMedia:
    """A checkpoint's image processor and counting rule: a sample's media as tiles and ``media`` rows."""

    def __init__(self, image_processor: Any, config: Any, where: str = "model") -> None:
        self.image_processor = image_processor
        self.rule = onevision_rule(config, image_processor, where)
        self.channels = int(getattr(config.vision_config, "num_channels", 3))
        self.image_token_id, self.video_token_id = int(config.image_token_id), int(config.video_token_id)

    @property
    def tile_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of one tile."""
        return self.channels, self.rule.tile_size, self.rule.tile_size

    def image_tiles(self, images: Sequence[Any]) -> tuple[torch.Tensor, list[list[int]]]:
        """``(tiles [T, C, H, W], media rows)`` of one sample's images (PIL, RGB), sample index 0."""
        if not images:
            return torch.zeros((0, *self.tile_shape)), []
        pixels = self.image_processor(images=[list(images)], return_tensors="pt")["pixel_values"].float()
        counts = self.rule.images([image.size for image in images])
        tiles, rows = [], []
        for k, (image, (n_tiles, _)) in enumerate(zip(images, counts)):
            if n_tiles > pixels.shape[1] or (n_tiles < pixels.shape[1] and len(images) == 1):
                raise ValueError(f"image {k}: the processor made {pixels.shape[1]} tiles, the rule counts {n_tiles}")
            tiles.append(pixels[k, :n_tiles])
            rows.append([0, 0, image.size[1], image.size[0], n_tiles])
        return torch.cat(tiles), rows

    def frame_tiles(self, frames: Sequence[Any]) -> tuple[torch.Tensor, list[list[int]]]:
        """``(tiles [F, C, H, W], one media row)`` of a video's sampled frames: each resized to one
        tile (bicubic) and normalized as the image processor normalizes."""
        from PIL import Image

        side = self.rule.tile_size
        mean = torch.tensor(self.image_processor.image_mean, dtype=torch.float32)[:, None, None]
        std = torch.tensor(self.image_processor.image_std, dtype=torch.float32)[:, None, None]
        tiles = [
            (
                torch.from_numpy(
                    np.asarray(f.convert("RGB").resize((side, side), Image.Resampling.BICUBIC), dtype=np.float32)
                ).permute(2, 0, 1)
                / 255.0
                - mean
            )
            / std
            for f in frames
        ]
        return torch.stack(tiles), [[0, 1, 0, 0, len(frames)]]

    def tokens(self, rows: Sequence[Sequence[int]], n_images: int) -> list[int]:
        """LLM tokens of each media row (``n_images``: the sample's image count)."""
        counts = []
        for row in rows:
            if row[IS_VIDEO]:
                counts.append(self.rule.video(row[TILES])[1])
            else:
                counts.append(self.rule.image(row[WIDTH], row[HEIGHT], alone=n_images == 1)[1])
        return counts


def stack_media(per_sample: Sequence[tuple[torch.Tensor, list[list[int]]]], tile_shape: tuple) -> tuple:
    """``(pixel_values [T, C, H, W], media [M, 5])`` of a microbatch from each sample's
    ``(tiles, media rows)``, the rows' sample column set to the sample's index."""
    tiles = [t for t, _ in per_sample if t.shape[0]]
    rows = [[index, *row[SAMPLE + 1 :]] for index, (_, sample_rows) in enumerate(per_sample) for row in sample_rows]
    pixel_values = torch.cat(tiles) if tiles else torch.zeros((0, *tile_shape))
    return pixel_values, torch.tensor(rows, dtype=torch.long).reshape(-1, 5)


class OnevisionInputs(OnevisionMedia):
    """Contract microbatches of (prompt, answer, images[, frames]) samples for check-model."""

    def __init__(self, tokenizer: Any, image_processor: Any, config: Any, where: str = "model") -> None:
        super().__init__(image_processor, config, where)
        self.tokenizer = tokenizer

    @classmethod
    def from_dir(cls, model_dir: str | Path, config: Any) -> OnevisionInputs:
        """Load the directory's tokenizer and image processor (offline)."""
        return cls(*load_tokenizer_and_image_processor(model_dir), config, str(model_dir))

    def encode_sample(self, prompt: str, answer: str, images: Sequence[Any], video: Sequence[Any] = ()):
        """``(tiles, media rows, input_ids [L], targets [L])`` of one sample (images, then the video)."""
        tiles, rows = self.image_tiles(images)
        if video:
            frame_tiles, video_rows = self.frame_tiles(video)
            tiles, rows = torch.cat([tiles, frame_tiles]), rows + video_rows
        counts = self.tokens(rows, len(images))
        pending = {
            IMAGE_MARK: iter(c for c, row in zip(counts, rows) if not row[IS_VIDEO]),
            VIDEO_MARK: iter(c for c, row in zip(counts, rows) if row[IS_VIDEO]),
        }
        token_of = {IMAGE_MARK: self.image_token_id, VIDEO_MARK: self.video_token_id}
        ids: list[int] = []
        for piece in re.split(f"({re.escape(IMAGE_MARK)}|{re.escape(VIDEO_MARK)})", prompt):
            if piece in token_of:
                count = next(pending[piece], None)
                if count is None:
                    raise ValueError(f"prompt {prompt[:60]!r} marks more {piece} than come with it")
                ids += [token_of[piece]] * count
            else:
                ids += self.tokenizer(piece, add_special_tokens=False)["input_ids"]
        if any(next(left, None) is not None for left in pending.values()):
            raise ValueError(f"prompt {prompt[:60]!r} marks fewer media than come with it")
        return (tiles, rows, *append_answer(self.tokenizer, torch.tensor(ids, dtype=torch.long), answer))

    def microbatch(self, samples: Sequence[tuple], *, denominator: float | None = None, packed: bool = False):
        """``((pixel_values, input_ids, seq_lens, media), (targets, loss_denominator))`` of ``samples``;
        ``packed``: the samples in one row instead of right-padded rows."""
        if not samples:
            raise ValueError("OnevisionInputs.microbatch: no samples")
        encoded = [self.encode_sample(*sample) for sample in samples]
        input_ids, seq_lens, targets, count = stack_rows(
            [(ids, tgt) for _, _, ids, tgt in encoded], pad_token_id(self.tokenizer), denominator, packed
        )
        pixel_values, media = stack_media([(tiles, rows) for tiles, rows, _, _ in encoded], self.tile_shape)
        return (pixel_values, input_ids, seq_lens, media), (targets, count)


def onevision_hf_kwargs(inputs: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The HF model's keyword arguments for a right-padded contract microbatch: the images' tiles
    with their sizes and per-sample counts, the videos' frames ``[V, F, C, H, W]`` (videos of one
    frame count), the padding mask."""
    pixel_values, input_ids, seq_lens, media = inputs
    kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": padding_mask(seq_lens, input_ids.shape[1])}
    rows = media.tolist()
    starts = np.cumsum([0] + [row[TILES] for row in rows]).tolist()
    image_tiles = [pixel_values[starts[i] : starts[i + 1]] for i, row in enumerate(rows) if not row[IS_VIDEO]]
    videos = [pixel_values[starts[i] : starts[i + 1]] for i, row in enumerate(rows) if row[IS_VIDEO]]
    if image_tiles:
        kwargs["pixel_values"] = torch.cat(image_tiles)
        kwargs["image_sizes"] = torch.tensor([[r[HEIGHT], r[WIDTH]] for r in rows if not r[IS_VIDEO]])
        kwargs["batch_num_images"] = torch.tensor(
            [sum(1 for r in rows if r[SAMPLE] == b and not r[IS_VIDEO]) for b in range(input_ids.shape[0])]
        )
    if videos:
        kwargs["pixel_values_videos"] = torch.stack(videos)
    return kwargs


__all__ = [
    "IMAGE_MARK",
    "VIDEO_MARK",
    "OnevisionInputs",
    "OnevisionMedia",
    "onevision_hf_kwargs",
    "onevision_rule",
    "stack_media",
]
