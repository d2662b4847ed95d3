"""Contract microbatches of a patch-grid family built straight from (prompt, answer, images[, video
frames]), for checks and tests.

The directory's tokenizer and image processor do the work of the family's processor class (whose
video processor needs torchvision): every image token of the prompt (one per image, as the chat
template writes it between ``<|vision_start|>`` and ``<|vision_end|>``) is repeated as many times
as the image gives LLM tokens (its patch grid ``t*h*w / merge**2``), and the one video token of a
sample with video frames as many times as the video gives; the answer and eos are appended and
supervised. The microbatch is ``((pixel_values, input_ids, seq_lens, image_grid_thw[,
video_grid_thw]), (targets, loss_denominator))``: image patches, then video patches.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dflop_ds.models.hf.base.folder import load_tokenizer_and_image_processor
from dflop_ds.models.hf.base.layers import padding_mask
from dflop_ds.models.hf.base.patch_grid import no_grid
from dflop_ds.models.hf.base.synthetic import Sample, append_answer, pad_token_id, stack_rows

#: ``(prompt, answer, images)`` or ``(prompt, answer, images, video frames)`` (PIL images; a
#: multiple of the temporal patch size of frames of one size)
VideoSample = tuple[str, str, Sequence[Any], Sequence[Any]]


class PatchGridInputs:
    """Tokenizer + image processor of a patch-grid model directory, checked against the model config.

    ``takes_videos``: whether the family's microbatch carries videos (and its ``video_grid_thw``).
    """

    takes_videos = True

    def __init__(self, tokenizer: Any, image_processor: Any, config: Any, where: str = "model") -> None:
        vision = config.vision_config
        expected = {
            "patch_size": vision.patch_size,
            "merge_size": vision.spatial_merge_size,
            "temporal_patch_size": vision.temporal_patch_size,
        }
        for key, value in expected.items():
            if int(getattr(image_processor, key)) != int(value):
                raise ValueError(
                    f"{where}: the image processor's {key}={getattr(image_processor, key)} but the "
                    f"model's vision config has {value}"
                )
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.image_token_id = int(config.image_token_id)
        self.video_token_id = int(config.video_token_id)
        self.merge_size = int(vision.spatial_merge_size)
        self.patch_size, self.temporal_patch_size = int(vision.patch_size), int(vision.temporal_patch_size)
        self.patch_dim = int(vision.in_channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2

    @classmethod
    def from_dir(cls, model_dir: str | Path, config: Any) -> PatchGridInputs:
        """Load the directory's tokenizer and image processor (offline)."""
        return cls(*load_tokenizer_and_image_processor(model_dir), config, str(model_dir))

    def no_pixels(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``([0, C*T*p*p], [0, 3])``: the pixels and grids of no images."""
        return torch.zeros(0, self.patch_dim), no_grid()

    def pixel_values(self, images: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pixel_values [P, C*T*p*p], image_grid_thw [n, 3])`` of PIL ``images`` (none: empty)."""
        if not images:
            return self.no_pixels()
        encoded = self.image_processor(images=list(images), return_tensors="pt")
        return encoded["pixel_values"].float(), encoded["image_grid_thw"].long()

    def video_pixel_values(self, frames: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pixel_values_videos [P, C*T*p*p], video_grid_thw [1, 3])`` of one video's frames (a
        positive multiple of the temporal patch size of RGB images of one size): each frame resized
        and normalized by the image processor, consecutive frames stacked on the temporal axis of
        every patch (the layout of the family's video processor, which needs torchvision)."""
        temporal, patch = self.temporal_patch_size, self.patch_size
        if not frames or len(frames) % temporal:
            raise ValueError(f"{len(frames)} video frame(s): not a positive multiple of {temporal}")
        out = self.image_processor(images=list(frames), return_tensors="pt")
        grids = out["image_grid_thw"].long()
        if len({tuple(g) for g in grids.tolist()}) != 1:
            raise ValueError(f"video frames of different sizes give different grids {grids.unique(dim=0).tolist()}")
        _, grid_h, grid_w = grids[0].tolist()
        # each frame's patches repeat the frame over the temporal axis: keep one copy
        single = out["pixel_values"].float().view(len(frames), grid_h * grid_w, -1, temporal, patch, patch)[:, :, :, 0]
        groups = single.view(len(frames) // temporal, temporal, *single.shape[1:]).permute(0, 2, 3, 1, 4, 5)
        grid = torch.tensor([[len(frames) // temporal, grid_h, grid_w]], dtype=torch.long)
        return groups.reshape(int(grid.prod()), -1), grid

    def video_ids(self, grid: torch.Tensor) -> list[int]:
        """The ids a video of patch grid ``(t, h, w)`` writes in place of the prompt's video token:
        here its ``t*h*w / merge**2`` video tokens (a family whose processor writes more around each
        frame group says so)."""
        return [self.video_token_id] * (int(grid.prod()) // self.merge_size**2)

    def encode_sample(self, prompt: str, answer: str, images: Sequence[Any], video: Sequence[Any] = ()):
        """``(pixel_values [P, C*T*p*p], image_grid_thw [n, 3], pixel_values_videos [Pv, C*T*p*p],
        video_grid_thw [0 or 1, 3], input_ids [L], targets [L])`` of one sample (``video``: its frames)."""
        if video and not self.takes_videos:
            raise ValueError(f"{type(self).__name__}: videos are not supported for this family")
        prompt_ids = torch.tensor(self.tokenizer(prompt, add_special_tokens=False)["input_ids"], dtype=torch.long)
        for token, count, what in (
            (self.image_token_id, len(images), "image"),
            (self.video_token_id, int(bool(video)), "video"),
        ):
            marks = int((prompt_ids == token).sum())
            if marks != count:
                raise ValueError(
                    f"prompt {prompt[:60]!r} has {marks} {what} token(s) but {count} {what}(s) come with it"
                )
        pixel_values, grid = self.pixel_values(images)
        video_pixels, video_grid = self.video_pixel_values(video) if video else self.no_pixels()
        image_counts = iter((grid.prod(-1) // self.merge_size**2).tolist())
        pieces = [
            torch.full((next(image_counts),), token)
            if token == self.image_token_id
            else torch.tensor(self.video_ids(video_grid[0]) if token == self.video_token_id else [token])
            for token in prompt_ids.tolist()
        ]
        ids = torch.cat(pieces) if pieces else prompt_ids
        return (pixel_values, grid, video_pixels, video_grid, *append_answer(self.tokenizer, ids, answer))

    def microbatch(
        self, samples: Sequence[Sample | VideoSample], *, denominator: float | None = None, packed: bool = False
    ):
        """``((pixel_values, input_ids, seq_lens, image_grid_thw[, video_grid_thw]), (targets,
        loss_denominator))`` of ``samples`` (image patches, then video patches; the video grids
        where :attr:`takes_videos`); ``packed``: the samples in one row (:mod:`dflop_ds.models.packing`)
        instead of right-padded rows."""
        if not samples:
            raise ValueError(f"{type(self).__name__}.microbatch: no samples")
        encoded = [self.encode_sample(*sample) for sample in samples]
        input_ids, seq_lens, targets, count = stack_rows(
            [(row[4], row[5]) for row in encoded], pad_token_id(self.tokenizer), denominator, packed
        )
        pixel_values = torch.cat([row[0] for row in encoded] + [row[2] for row in encoded])
        grid = torch.cat([row[1] for row in encoded])
        if not self.takes_videos:
            return (pixel_values, input_ids, seq_lens, grid), (targets, count)
        video_grid = torch.cat([row[3] for row in encoded])
        return (pixel_values, input_ids, seq_lens, grid, video_grid), (targets, count)


def patch_grid_hf_kwargs(inputs: Sequence[torch.Tensor], config: Any) -> dict[str, Any]:
    """The HF model's keyword arguments for a patch-grid contract microbatch: ``pixel_values`` and
    ``pixel_values_videos`` split at the images' patch count, ``mm_token_type_ids`` marking image
    tokens 1 and video tokens 2; no pixels nor grids of a kind the microbatch has none of."""
    pixel_values, input_ids, seq_lens, grid, video_grid = inputs
    kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": padding_mask(seq_lens, input_ids.shape[1])}
    if grid.shape[0] or video_grid.shape[0]:
        kwargs["mm_token_type_ids"] = (input_ids == int(config.image_token_id)).int() + 2 * (
            input_ids == int(config.video_token_id)
        ).int()
    image_patches = int(grid.prod(-1).sum())
    if grid.shape[0]:
        kwargs.update(pixel_values=pixel_values[:image_patches], image_grid_thw=grid)
    if video_grid.shape[0]:
        kwargs.update(pixel_values_videos=pixel_values[image_patches:], video_grid_thw=video_grid)
    return kwargs


__all__ = ["PatchGridInputs", "VideoSample", "patch_grid_hf_kwargs"]
