"""LLaVA JSON records -> the microbatch contract of a patch-grid family (the Qwen-VL families).

:class:`PatchGridPreprocessor` holds a model directory's tokenizer and image processor (the family's
processor class is not needed: its video processor wants torchvision) on the ChatML template
(:mod:`~dflop_ds.models.hf.base.chat_template` for a checkpoint's own, else
:class:`~dflop_ds.models.hf.base.chatml.ChatMLPreprocessor`), so that the shapes the sampler sees
and the tensors the dataset makes agree token for token:

* **Images** keep their own size within the image processor's pixel bounds
  (:class:`~dflop_ds.models.hf.base.patch_grid.SmartResize`): an image's ``encoder_tiles`` are its
  patches and its ``visual_tokens`` its LLM tokens (patches / merge**2).
* **Videos** (a family whose inputs take them; LLaVA-Video records: ``"video"``: a path under the
  video folder) are sampled at ``video_fps`` (:class:`~dflop_ds.models.hf.base.patch_grid.VideoFrames`),
  decoded with PyAV, resized by the image processor's rule and grouped into temporal patches;
  the video's placeholder (:func:`~dflop_ds.models.hf.base.template.mark_video`) becomes its
  vision block.
* **Length**: as for every family (``max_length``, ``truncation``); a cut keeps every visual block whole.

:class:`PatchGridDataset` makes the items (``pixel_values`` and ``image_grid_thw`` of the images,
``pixel_values_videos`` and ``video_grid_thw`` of the video) and :func:`collate_patch_grid` the
microbatch ``((pixel_values, input_ids, seq_lens, image_grid_thw[, video_grid_thw]), labels)``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from dflop_ds.data.errors import PathArg
from dflop_ds.data.video import DEFAULT_VIDEO_FPS, DEFAULT_VIDEO_MAX_FRAMES, decode_frames, sample_frame_indices
from dflop_ds.models.hf.base.chatml import ChatMLPreprocessor
from dflop_ds.models.hf.base.collate import collate_padded
from dflop_ds.models.hf.base.dataset import MediaDataset, MediaItem
from dflop_ds.models.hf.base.folder import from_model_dir
from dflop_ds.models.hf.base.patch_grid import SmartResize, VideoFrames, no_grid
from dflop_ds.models.hf.base.patch_inputs import PatchGridInputs
from dflop_ds.models.hf.base.template import Encoded, chosen_template
from dflop_ds.shapes import SampleShape, ShapePolicy

PatchGrid = TypeVar("PatchGrid", bound="PatchGridPreprocessor")


class PatchGridPreprocessor(ChatMLPreprocessor):
    """A patch-grid directory's tokenizer and image processor plus its conversation template.

    Args:
        tokenizer, image_processor, config: the model directory's (checked against each other by
            the family's :attr:`inputs_class`).
        system: the system message (default: the checkpoint template's own; the built-in ChatML's
            ``default_system``); name: the policy's name in messages (default :attr:`family_name`).
        chat_template, max_length, truncation: as for
            :class:`~dflop_ds.models.hf.base.template.TemplatePreprocessor` (visual tokens included).
        video_fps, video_max_frames: how videos are sampled (where the family takes them).
    """

    #: the family's name in messages and the default policy name
    family_name = "patch-grid"

    #: the family's synthetic inputs (its pixel layout; whether it takes videos)
    inputs_class: type[PatchGridInputs] = PatchGridInputs

    #: the ``model_type`` values whose videos the dataset loads (None: every one the family runs)
    video_model_types: tuple[str, ...] | None = None

    def __init__(
        self,
        tokenizer: Any,
        image_processor: Any,
        config: Any,
        *,
        system: str | None = None,
        name: str | None = None,
        video_fps: float = DEFAULT_VIDEO_FPS,
        video_max_frames: int = DEFAULT_VIDEO_MAX_FRAMES,
        max_length: int | None = None,
        truncation: str = "error",
        chat_template: str | bool = True,
    ) -> None:
        name = name or self.family_name
        self.inputs = self.inputs_class(tokenizer, image_processor, config, name)  # checks the processor vs config
        self.image_processor = image_processor
        self.model_type = str(config.model_type)
        self.rule = SmartResize.from_image_processor(image_processor)
        self.video_rule: VideoFrames | None = None
        template = chosen_template(chat_template, tokenizer)
        self._set_text(tokenizer, int(config.image_token_id), system, max_length, truncation, name)
        if self.inputs.takes_videos:
            self.video_token_id = int(config.video_token_id)
            temporal = self.inputs.temporal_patch_size
            if video_fps <= 0 or video_max_frames < temporal:
                raise ValueError(
                    f"{name}: video_fps must be > 0 and video_max_frames >= {temporal} (the temporal patch "
                    f"size), got {video_fps} and {video_max_frames}"
                )
            self.video_rule = self._video_rule(
                VideoFrames(self.rule, float(video_fps), int(video_max_frames), temporal)
            )
        self._set_template(template, self.video_token_id)

    def _video_rule(self, frames: VideoFrames) -> VideoFrames:
        """The video rule of the family (here the frames' own; a family whose processor writes more
        around each frame group than its tokens gives a rule that counts it)."""
        return frames

    def video_ids(self, shape: SampleShape, video_grid: torch.Tensor) -> int | list[int] | None:
        """What :meth:`encode` takes for the video of ``shape`` whose patch grid is ``video_grid``
        (``[0 or 1, 3]``): its token count (None: no video); a family whose processor writes more
        around each frame group gives the video's block of ids."""
        if not video_grid.shape[0]:
            return None
        return int(video_grid.prod(-1).sum()) // self.rule.merge_size**2

    @classmethod
    def from_pretrained(cls: type[PatchGrid], model_dir: PathArg, **kwargs: Any) -> PatchGrid:
        """Load the tokenizer, image processor and config of a ``save_pretrained`` directory (offline)."""
        return from_model_dir(cls, model_dir, cls.family_name, **kwargs)

    @property
    def trains_videos(self) -> bool:
        """Whether this model's videos can be loaded and trained."""
        kinds = self.video_model_types
        return self.video_rule is not None and (kinds is None or self.model_type in kinds)

    def encode(  # type: ignore[override]
        self,
        turns: Sequence[tuple[str, str]],
        image_tokens: Sequence[int],
        video_tokens: int | Sequence[int] | None = None,
    ) -> Encoded:
        """Token ids and supervision mask of ``(role, value)`` turns whose images give ``image_tokens``
        tokens each and whose video (if any) ``video_tokens``.

        Raises:
            ValueError: a bad role or placeholder mismatch or an over-long sample, naming the field.
        """
        return self.encode_media(turns, image_tokens, video_tokens)

    def count(
        self, turns: Sequence[tuple[str, str]], image_tokens: Sequence[int], video_tokens: int | None = None
    ) -> tuple[int, int]:
        """``(text_tokens, label_tokens)`` exactly as :meth:`encode` produces them (the length rule
        applied; image and video tokens excluded); a record has at most one video."""
        return self._counted(self.encode(turns, image_tokens, video_tokens))

    def pixel_values(self, images: list) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        """``(pixel_values [P, C*T*p*p], image_grid_thw [n, 3])`` (empty for no images)."""
        return self.inputs.pixel_values(images)

    def video_pixel_values(self, frames: list) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pixel_values_videos [P, C*T*p*p], video_grid_thw [1, 3])`` of one video's sampled frames."""
        return self.inputs.video_pixel_values(frames)

    def policy(self) -> ShapePolicy:
        """The :class:`ShapePolicy` of this model's data: per-image patches and tokens from
        :class:`SmartResize`, per-video ones from :class:`VideoFrames`, exact conversation token counts."""
        factor = self.rule.patch_size * self.rule.merge_size
        return self._policy(factor, 1, image_rule=self.rule, video_rule=self.video_rule)


@dataclass
class PatchGridItem(MediaItem):
    """One sample: ``pixel_values [P, C*T*p*p]``, its images' ``image_grid_thw [n, 3]``, ids and shifted
    targets, and its video's ``pixel_values_videos [Pv, C*T*p*p]`` and ``video_grid_thw [0 or 1, 3]``."""

    image_grid_thw: torch.Tensor = field(default_factory=no_grid)
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor = field(default_factory=no_grid)


class PatchGridDataset(MediaDataset):
    """The samples of ``shapes`` (made under ``preprocessor.policy()``) as patch-grid contract tensors
    (arguments as :class:`~dflop_ds.models.hf.base.dataset.MediaDataset`); videos where the
    preprocessor has a video rule."""

    preprocessor: PatchGridPreprocessor
    supports_video = True
    size_sets_tokens = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.preprocessor.trains_videos:
            for shape in self.shapes:
                if shape.video_frames:
                    raise self._error(
                        shape.sample_id, "video", f"videos are not supported for {self.preprocessor.model_type} yet"
                    )

    def _video(self, shape: SampleShape) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pixel_values_videos, video_grid_thw)`` of the sample's video, its sampled frames decoded."""
        rule = self.preprocessor.video_rule
        if not shape.video_frames or rule is None:
            return self.preprocessor.inputs.no_pixels()
        path = self.records[shape.sample_id]["video"]
        full = os.path.abspath(os.path.join(self.video_folder, path))  # type: ignore[arg-type]
        try:
            if shape.video_fps is None:
                raise ValueError("its shape has no frame rate (read the data with a video_folder)")
            count = rule.sampled(shape.video_frames, shape.video_fps)
            frames = decode_frames(full, sample_frame_indices(shape.video_frames, count))
            return self.preprocessor.video_pixel_values(frames)
        except (OSError, ValueError) as exc:
            raise self._error(shape.sample_id, "video", f"cannot load video {full}: {exc}") from exc

    def _blank_media(
        self, shape: SampleShape
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """Zero pixels and the patch grids of the sample's images and video as its shape sizes them
        (what :meth:`_item` loads, for a stand-in)."""
        patch_dim = self.preprocessor.inputs.patch_dim
        grid = torch.tensor([(1, *self.preprocessor.rule.grid(w, h)) for w, h in shape.image_sizes], dtype=torch.long)
        video_grid = no_grid()
        rule = self.preprocessor.video_rule
        if shape.video_frames and rule is not None:
            if shape.video_size is None or shape.video_fps is None:
                raise ValueError("its shape has no frame size or rate (read the data with a video_folder)")
            video_grid = torch.tensor([rule.grid(shape.video_frames, *shape.video_size, shape.video_fps)])
        grid = grid.reshape(-1, 3)
        images = torch.zeros(int(grid.prod(-1).sum()), patch_dim), grid
        return images, (torch.zeros(int(video_grid.prod(-1).sum()), patch_dim), video_grid)

    def _item(self, shape: SampleShape, blank: bool) -> PatchGridItem:
        """The sample of ``shape`` with its media loaded, or (``blank``) zero pixels of the same grids."""
        if blank:
            (pixel_values, grid), (video_pixels, video_grid) = self._blank_media(shape)
        else:
            pixel_values, grid = self.preprocessor.pixel_values(self._load_images(shape))
            video_pixels, video_grid = self._video(shape)
        video_tokens = self.preprocessor.video_ids(shape, video_grid)
        image_tokens = (grid.prod(-1) // self.preprocessor.rule.merge_size**2).tolist()
        turns = self._turns(shape)
        ids, targets = self._tensors(shape, lambda: self.preprocessor.encode(turns, image_tokens, video_tokens))
        pad = self.preprocessor.pad_token_id
        return PatchGridItem(shape.sample_id, pixel_values, ids, targets, pad, None, grid, video_pixels, video_grid)

    def __getitem__(self, idx: Any) -> PatchGridItem:
        """The sample at ``idx`` (an ``int`` or a ``ScheduledIndex``, whose denominator is kept)."""
        return super().__getitem__(idx)  # type: ignore[return-value]


def collate_patch_grid(items: Sequence[PatchGridItem], packed: bool = False):
    """One microbatch ``((pixel_values, input_ids, seq_lens, image_grid_thw, video_grid_thw), (targets,
    loss_denominator))``: ``pixel_values`` holds every image's patches, then every video's, samples in
    order (padding or packing, ``packed``, and denominator as
    :func:`~dflop_ds.models.hf.base.collate.collate_padded`; the projector computes each sample's
    M-RoPE positions), the image grids and the video grids (``[0, 3]`` when no sample has a video)."""
    (pixel_values, input_ids, seq_lens), labels = collate_padded(items, packed)
    grid = torch.cat([item.image_grid_thw for item in items])
    pixels = [item.pixel_values_videos for item in items if item.pixel_values_videos is not None]
    video_grid = torch.cat([item.video_grid_thw for item in items])
    return (torch.cat([pixel_values, *pixels]), input_ids, seq_lens, grid, video_grid), labels


__all__ = ["PatchGridDataset", "PatchGridItem", "PatchGridPreprocessor", "collate_patch_grid"]
