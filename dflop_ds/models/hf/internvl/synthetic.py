"""InternVL's media as contract tiles, and contract microbatches built straight from (prompt,
answer, images[, video frames]) for checks and tests.

Images go through the directory's ``GotOcr2ImageProcessor`` (dynamic tiles and thumbnail); video
frames, which its video processor would take (it needs torchvision), are one tile each (the same
image processor without cropping). Each image writes ``<img>``, its tiles' ``<IMG_CONTEXT>`` tokens
and ``</img>``; a video writes ``Frame1: <img>...</img>`` lines, as InternVL's processor does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dflop_ds.models.hf.base.folder import load_tokenizer_and_image_processor
from dflop_ds.models.hf.base.synthetic import append_answer, pad_token_id, stack_rows
from dflop_ds.models.hf.internvl.model import side
from dflop_ds.models.hf.internvl.shapes import InternVLTileRule

IMAGE_MARK = "<image>"
VIDEO_MARK = "<video>"


def internvl_rule(config: Any, image_processor: Any, where: str = "model") -> InternVLTileRule:
    """The tiling rule of a checkpoint: the image processor's tiles and limits, the config's tokens per
    tile (its ``image_seq_length``, checked against the tower's patches after the pixel shuffle)."""
    vision = config.vision_config
    tile = int(dict(image_processor.size)["height"])
    size, patch = side(vision.image_size), side(vision.patch_size)
    if tile != size:
        raise ValueError(f"{where}: the image processor's tiles are {tile} px but the tower's image_size is {size}")
    tokens = int(round((size // patch) ** 2 * float(config.downsample_ratio) ** 2))
    if int(config.image_seq_length) != tokens:
        raise ValueError(f"{where}: image_seq_length {config.image_seq_length} but a tile gives {tokens} features")
    crop = bool(getattr(image_processor, "crop_to_patches", False))
    return InternVLTileRule(
        tile_size=tile,
        min_tiles=int(image_processor.min_patches) if crop else 1,
        max_tiles=int(image_processor.max_patches) if crop else 1,
        tokens_per_tile=tokens,
    )


class InternVLMedia:
    """A checkpoint's image processor, tiling rule and image tokens: a sample's media as tiles and
    the ids each writes into the prompt."""

    def __init__(self, tokenizer: Any, image_processor: Any, config: Any, where: str = "model") -> None:
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.rule = internvl_rule(config, image_processor, where)
        self.context_id = int(config.image_token_id)
        self.start_id = self._token(tokenizer, "start_image_token", where)
        self.end_id = self._token(tokenizer, "end_image_token", where)
        self.tile_shape = (int(config.vision_config.num_channels), self.rule.tile_size, self.rule.tile_size)

    @staticmethod
    def _token(tokenizer: Any, name: str, where: str) -> int:
        token = getattr(tokenizer, name, None)
        if token is None:
            raise ValueError(f"{where}: the tokenizer names no {name} (not an InternVL tokenizer?)")
        return int(tokenizer.convert_tokens_to_ids(token))

    def image_tiles(self, images: Sequence[Any]) -> torch.Tensor:
        """``[T, C, H, W]``: every image's tiles (thumbnail last), checked against the rule."""
        if not images:
            return torch.zeros((0, *self.tile_shape))
        out = self.image_processor(images=list(images), return_tensors="pt")
        counts = [int(n) for n in out["num_patches"]]
        expected = [tiles for tiles, _ in self.rule([image.size for image in images])]
        if counts != expected:
            raise ValueError(f"the image processor made {counts} tiles, the rule counts {expected}")
        return out["pixel_values"].float()

    def frame_tiles(self, frames: Sequence[Any]) -> torch.Tensor:
        """``[F, C, H, W]``: each frame resized to one tile."""
        return self.image_processor(images=list(frames), crop_to_patches=False, return_tensors="pt")[
            "pixel_values"
        ].float()

    def image_ids(self, tokens: int) -> list[int]:
        """``<img>``, ``tokens`` context tokens, ``</img>``."""
        return [self.start_id] + [self.context_id] * tokens + [self.end_id]

    def video_ids(self, tokens: int) -> list[int]:
        """One ``Frame<i>: <img>...</img>`` line per frame of a video of ``tokens`` context tokens."""
        lines = []
        for i in range(tokens // self.rule.tokens_per_tile):
            prefix = ([] if i == 0 else self.tokenizer("\n", add_special_tokens=False)["input_ids"]) + self.tokenizer(
                f"Frame{i + 1}: ", add_special_tokens=False
            )["input_ids"]
            lines += prefix + self.image_ids(self.rule.tokens_per_tile)
        return lines


class InternVLInputs(InternVLMedia):
    """Contract microbatches of (prompt, answer, images[, frames]) samples for check-model."""

    @classmethod
    def from_dir(cls, model_dir: str | Path, config: Any) -> InternVLInputs:
        """Load the directory's tokenizer and image processor (offline)."""
        return cls(*load_tokenizer_and_image_processor(model_dir), config, str(model_dir))

    def encode_sample(self, prompt: str, answer: str, images: Sequence[Any], video: Sequence[Any] = ()):
        """``(tiles, input_ids [L], targets [L])`` of one sample (images' tiles, then the video's)."""
        tiles = self.image_tiles(images)
        if video:
            tiles = torch.cat([tiles, self.frame_tiles(video)])
        image_tokens = iter(tokens for _, tokens in self.rule([image.size for image in images]))
        ids: list[int] = []
        for piece in re.split(f"({re.escape(IMAGE_MARK)}|{re.escape(VIDEO_MARK)})", prompt):
            if piece == IMAGE_MARK:
                ids += self.image_ids(next(image_tokens))
            elif piece == VIDEO_MARK:
                ids += self.video_ids(len(video) * self.rule.tokens_per_tile)
            else:
                ids += self.tokenizer(piece, add_special_tokens=False)["input_ids"]
        return (tiles, *append_answer(self.tokenizer, torch.tensor(ids, dtype=torch.long), answer))

    def microbatch(self, samples: Sequence[tuple], *, denominator: float | None = None, packed: bool = False):
        """``((pixel_values, input_ids, seq_lens), (targets, loss_denominator))`` of ``samples``;
        ``packed``: the samples in one row instead of right-padded rows."""
        if not samples:
            raise ValueError("InternVLInputs.microbatch: no samples")
        encoded = [self.encode_sample(*sample) for sample in samples]
        input_ids, seq_lens, targets, count = stack_rows(
            [(ids, tgt) for _, ids, tgt in encoded], pad_token_id(self.tokenizer), denominator, packed
        )
        return (torch.cat([tiles for tiles, _, _ in encoded]), input_ids, seq_lens), (targets, count)


__all__ = ["IMAGE_MARK", "VIDEO_MARK", "InternVLInputs", "InternVLMedia", "internvl_rule"]
