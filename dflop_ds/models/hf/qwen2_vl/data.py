"""LLaVA JSON records -> the Qwen2-VL microbatch contract (``dflop_ds.models.hf.qwen2_vl.model``).

:class:`Qwen2VLPreprocessor` holds a model directory's tokenizer and ``Qwen2VLImageProcessor``
(no processor class needed: Qwen2-VL's wants torchvision for videos) and owns the conversation
format, so that the shapes the sampler sees and the tensors the dataset makes agree token for token:

* **Template**: the checkpoint's own ``chat_template`` when it ships one
  (:mod:`~dflop_ds.models.hf.base.chat_template`; its image marker ``<|image_pad|>`` and video marker
  ``<|video_pad|>`` expanded to the media's tokens, labels the assistant turns' tokens, the
  system message the template's own unless ``system`` is given); otherwise Qwen2-VL's ChatML::

      <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{human turn}<|im_end|>\\n
      <|im_start|>assistant\\n{gpt turn}<|im_end|>\\n ...

  Each piece is tokenized on its own and the ids concatenated. Supervised: every assistant
  answer and the ``<|im_end|>`` after it.
* **Images**: each ``<image>`` placeholder of a human turn becomes
  ``<|vision_start|>`` + the image's ``<|image_pad|>`` tokens + ``<|vision_end|>``; an image gives
  as many tokens as its own size allows (:class:`SmartResize`, the image processor's rule
  under ``min_pixels``/``max_pixels``). Placeholders are matched to images as for LLaVA
  (:class:`~dflop_ds.models.hf.base.template.TemplatePreprocessor`: missing ones are prepended).
* **Videos** (LLaVA-Video records: ``"video"``: a path under the video folder): frames are
  sampled at ``video_fps`` frames per second of video, at least 4 and at most
  ``video_max_frames``, their count rounded down to the temporal patch size (2), as Qwen2-VL's
  recipes sample (:class:`VideoFrames`); they are decoded with PyAV, resized by the image
  processor's rule (Qwen2-VL's video processor needs torchvision) and grouped in pairs into
  ``pixel_values_videos`` patches. The video's ``<video>`` placeholder (or, as LLaVA-Video's data
  writes it, the one ``<image>`` of a record with a video and no image; else one is prepended)
  becomes ``<|vision_start|>`` + its ``<|video_pad|>`` tokens + ``<|vision_end|>``. Qwen2.5-VL's
  videos (temporal positions scaled by seconds per frame group) are refused by name.
* **Shapes** (:meth:`Qwen2VLPreprocessor.policy`): an image's ``encoder_tiles`` are its patches
  and its ``visual_tokens`` its LLM tokens (patches / merge**2); a video's the same over its
  sampled frame pairs.

* **Length**: as for LLaVA (``max_length``, default the tokenizer's ``model_max_length``;
  ``truncation`` ``"error"`` or ``"truncate"``), images and videos expanded; a cut must keep every
  ``<|vision_start|>`` ... ``<|vision_end|>`` block whole, else the sample is a bad record.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from dflop_ds.data.errors import PathArg
from dflop_ds.data.video import (
    DEFAULT_VIDEO_FPS,
    DEFAULT_VIDEO_MAX_FRAMES,
    VIDEO_MIN_FRAMES,
    decode_frames,
    sample_frame_indices,
    sampled_frame_count,
)
from dflop_ds.models.hf.base.chat_template import ModelChatTemplate, encode_alike
from dflop_ds.models.hf.base.collate import collate_padded
from dflop_ds.models.hf.base.dataset import MediaDataset, MediaItem
from dflop_ds.models.hf.base.folder import from_model_dir
from dflop_ds.models.hf.base.template import (
    NO_LIMIT,
    TRUNCATION,
    Encoded,
    TemplatePreprocessor,
    chosen_template,
    counting_identity,
    mark_video,
    pad_token_id,
    text_ids,
)
from dflop_ds.models.hf.qwen2_vl.synthetic import Qwen2VLInputs
from dflop_ds.shapes import SampleShape, ShapePolicy

TEMPLATE_NAME = "qwen2-vl-chatml"
DEFAULT_SYSTEM = "You are a helpful assistant."
IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"


@dataclass(frozen=True)
class SmartResize:
    """Qwen2-VL's image size rule: an image is resized to multiples of ``patch_size * merge_size``
    keeping its aspect ratio, its area within ``min_pixels``..``max_pixels``; ``(width, height)
    -> (patches, LLM tokens)`` (a :data:`~dflop_ds.shapes.ImageRule`)."""

    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int

    def __post_init__(self) -> None:
        if self.patch_size < 1 or self.merge_size < 1:
            raise ValueError(f"patch_size {self.patch_size} and merge_size {self.merge_size} must be at least 1")
        factor = self.patch_size * self.merge_size
        if not factor**2 <= self.min_pixels <= self.max_pixels:
            raise ValueError(
                f"size {{'shortest_edge': {self.min_pixels}, 'longest_edge': {self.max_pixels}}} (min_pixels,"
                f" max_pixels): need {factor**2} (one merged patch, (patch_size x merge_size)^2) <= shortest_edge"
                " <= longest_edge"
            )

    @classmethod
    def from_image_processor(cls, image_processor: Any) -> SmartResize:
        """The rule of a ``Qwen2VLImageProcessor`` (its ``size`` edges are the pixel bounds)."""
        size = image_processor.size
        return cls(
            int(image_processor.patch_size),
            int(image_processor.merge_size),
            int(size["shortest_edge"]),
            int(size["longest_edge"]),
        )

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """``(grid_h, grid_w)`` patches of an image of ``width x height`` pixels after resizing."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        new_h, new_w = smart_resize(
            height, width, self.patch_size * self.merge_size, min_pixels=self.min_pixels, max_pixels=self.max_pixels
        )
        return new_h // self.patch_size, new_w // self.patch_size

    def __call__(self, width: int, height: int) -> tuple[int, int]:
        grid_h, grid_w = self.grid(width, height)
        return grid_h * grid_w, grid_h * grid_w // self.merge_size**2


@dataclass(frozen=True)
class VideoFrames:
    """Qwen2-VL's video rule: ``fps`` sampled frames per second of video (at least
    :data:`VIDEO_MIN_FRAMES`, at most ``max_frames``, rounded down to ``temporal_patch_size``), each
    resized by ``resize``; ``(frames, width, height, source fps) -> (patches, LLM tokens, patches per
    frame group)`` (a :data:`~dflop_ds.shapes.VideoRule`: the tower attends within each frame group)."""

    resize: SmartResize
    fps: float
    max_frames: int
    temporal_patch_size: int

    def sampled(self, frames: int, source_fps: float) -> int:
        """Frames sampled from a video of ``frames`` frames at ``source_fps``.

        Raises:
            ValueError: the video has fewer frames than one temporal patch.
        """
        count = sampled_frame_count(
            frames,
            source_fps,
            target_fps=self.fps,
            max_frames=self.max_frames,
            min_frames=VIDEO_MIN_FRAMES,
            multiple=self.temporal_patch_size,
        )
        if count < self.temporal_patch_size:
            raise ValueError(
                f"a video of {frames} frame(s) is shorter than one temporal patch ({self.temporal_patch_size} frames)"
            )
        return count

    def grid(self, frames: int, width: int, height: int, source_fps: float) -> tuple[int, int, int]:
        """``(t, h, w)``: the video's patch grid (``t`` frame pairs of ``h x w`` patches)."""
        grid_h, grid_w = self.resize.grid(width, height)
        return self.sampled(frames, source_fps) // self.temporal_patch_size, grid_h, grid_w

    def __call__(self, frames: int, width: int, height: int, source_fps: float) -> tuple[int, int, int]:
        t, h, w = self.grid(frames, width, height, source_fps)
        return t * h * w, t * h * w // self.resize.merge_size**2, h * w


class Qwen2VLPreprocessor:
    """A Qwen2-VL directory's tokenizer and image processor plus the ChatML conversation template.

    Args:
        tokenizer, image_processor: the model directory's (``AutoTokenizer``, ``AutoImageProcessor``).
        config: the model config (image token, vision patch and merge sizes, checked against the
            image processor).
        system: the system message (default: the checkpoint template's own; the built-in
            ChatML's :data:`DEFAULT_SYSTEM`); name: the policy's name in messages.
        chat_template: as for :class:`~dflop_ds.models.hf.base.template.TemplatePreprocessor`.
        video_fps, video_max_frames: how videos are sampled (:class:`VideoFrames`).
        max_length, truncation: the length rule, as for
            :class:`~dflop_ds.models.hf.base.template.TemplatePreprocessor` (visual tokens included).
    """

    def __init__(
        self,
        tokenizer: Any,
        image_processor: Any,
        config: Any,
        *,
        system: str | None = None,
        name: str = "qwen2_vl",
        video_fps: float = DEFAULT_VIDEO_FPS,
        video_max_frames: int = DEFAULT_VIDEO_MAX_FRAMES,
        max_length: int | None = None,
        truncation: str = "error",
        chat_template: str | bool = True,
    ) -> None:
        self.inputs = Qwen2VLInputs(tokenizer, image_processor, config, name)  # checks the processor vs config
        self.tokenizer, self.image_processor, self.system, self.name = tokenizer, image_processor, system, name
        self.rule = SmartResize.from_image_processor(image_processor)
        self.image_token_id = int(config.image_token_id)
        self.video_token_id = int(config.video_token_id)
        self.model_type = str(config.model_type)
        temporal = int(config.vision_config.temporal_patch_size)
        if video_fps <= 0 or video_max_frames < temporal:
            raise ValueError(
                f"{name}: video_fps must be > 0 and video_max_frames >= {temporal} (the temporal patch "
                f"size), got {video_fps} and {video_max_frames}"
            )
        self.video_rule = VideoFrames(self.rule, float(video_fps), int(video_max_frames), temporal)
        template = chosen_template(chat_template, tokenizer)
        self.chat_template = (
            None
            if template is None
            else ModelChatTemplate(template, tokenizer, self.image_token_id, self.video_token_id, name)
        )
        builtin_system = DEFAULT_SYSTEM if system is None else system
        if self.chat_template is None:
            self.system = builtin_system
            self._chatml_tokens()  # the built-in ChatML writes them: refused here, naming the one missing
        #: the token that closes a visual block (None: a checkpoint template's tokenizer has none)
        self.vision_end = next(iter(self._vision_ends()), None)
        #: whether the tokens are the built-in ChatML's: no template shipped, or one that tokenizes alike
        self.builtin_counts = self.chat_template is None or encode_alike(
            partial(self.chat_template.encode, system=self.system),
            partial(self._chatml, system=builtin_system),
            lambda tokens: [self.image_token_id] * tokens,
            lambda tokens: [self.video_token_id] * tokens,
        )
        self.counting_system = builtin_system if self.builtin_counts else self.system or ""
        self.pad_token_id = pad_token_id(tokenizer, name)
        if truncation not in TRUNCATION:
            raise ValueError(f"truncation must be one of {TRUNCATION}, got {truncation!r}")
        self.truncation, self.truncated_samples = truncation, 0
        limit = max_length if max_length is not None else tokenizer.model_max_length
        self.max_length = None if limit is None or limit > NO_LIMIT else int(limit)

    def _chatml_tokens(self) -> tuple[int, int, int, int]:
        """``(<|im_start|>, <|im_end|>, <|vision_start|>, <|vision_end|>)``, which the built-in ChatML writes."""
        names = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")
        start, end, vision_start, vision_end = (self._special(name) for name in names)
        return start, end, vision_start, vision_end

    def _special(self, token: str) -> int:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == self.tokenizer.unk_token_id:
            raise ValueError(f"{self.name}: the tokenizer has no {token} token (not a Qwen2-VL tokenizer?)")
        return int(token_id)

    @classmethod
    def from_pretrained(cls, model_dir: PathArg, **kwargs: Any) -> Qwen2VLPreprocessor:
        """Load the tokenizer, image processor and config of a ``save_pretrained`` directory (offline)."""
        return from_model_dir(cls, model_dir, "qwen2_vl", **kwargs)

    def _ids(self, text: str) -> list[int]:
        return text_ids(self.tokenizer, text)

    def count_text(self, text: str) -> int:
        """Tokens of ``text`` alone."""
        return len(self._ids(text))

    def encode(
        self, turns: Sequence[tuple[str, str]], image_tokens: Sequence[int], video_tokens: int | None = None
    ) -> Encoded:
        """Token ids and supervision mask of ``(role, value)`` turns whose images give ``image_tokens``
        tokens each and whose video (if any) ``video_tokens``.

        Raises:
            ValueError: a bad role or placeholder mismatch, naming the field.
        """
        if video_tokens is None:
            if any(VIDEO_PLACEHOLDER in value for _, value in turns):
                raise ValueError(f"conversations: a {VIDEO_PLACEHOLDER} placeholder but the record has no video")
        else:
            turns = mark_video(turns, len(image_tokens))
        # the roles and placeholders are checked (and missing placeholders added) as for LLaVA
        normalized = TemplatePreprocessor._normalize(self, turns, len(image_tokens), videos=True)  # type: ignore[arg-type]
        images = [[self.image_token_id] * tokens for tokens in image_tokens]
        video = None if video_tokens is None else [self.video_token_id] * int(video_tokens)
        if self.chat_template is None:
            ids, supervised = self._chatml(normalized, images, video, system=self.system or "")
        else:
            ids, supervised = self.chat_template.encode(normalized, images, video, system=self.system)
        encoded = Encoded(ids, supervised, sum(image_tokens) + int(video_tokens or 0))
        return TemplatePreprocessor._fit(self, encoded)  # type: ignore[arg-type]

    def _chatml(
        self, turns: Sequence[tuple[str, str]], images: Sequence[list[int]], video: list[int] | None, system: str
    ) -> tuple[list[int], list[bool]]:
        """``(input_ids, supervised)`` of normalized turns under the built-in ChatML with ``system``, each
        placeholder replaced by ``<|vision_start|>``, its image's (in order) or the video's tokens and
        ``<|vision_end|>``."""
        ids: list[int] = []
        supervised: list[bool] = []

        def add(tokens: list[int], label: bool = False) -> None:
            ids.extend(tokens)
            supervised.extend([label] * len(tokens))

        start, end, vision_start, vision_end = self._chatml_tokens()
        if system:
            add([start] + self._ids(f"system\n{system}") + [end] + self._ids("\n"))
        blocks = iter(images)
        for kind, value in turns:
            if kind == "user":
                add([start] + self._ids("user\n"))
                for part in re.split(f"({IMAGE_PLACEHOLDER}|{VIDEO_PLACEHOLDER})", value):
                    if part == IMAGE_PLACEHOLDER:
                        add([vision_start] + next(blocks) + [vision_end])
                    elif part == VIDEO_PLACEHOLDER:
                        add([vision_start] + (video or []) + [vision_end])
                    else:
                        add(self._ids(part))
                add([end] + self._ids("\n"))
            else:
                add([start] + self._ids("assistant\n"))
                add(self._ids(value) + [end], True)
                add(self._ids("\n"))
        return ids, supervised

    def _uncut_tokens(self) -> set[int]:
        """Tokens a truncation must keep: every image and video token and the ends of their blocks."""
        return {self.image_token_id, self.video_token_id} | self._vision_ends()

    def _vision_ends(self) -> set[int]:
        """The ``<|vision_end|>`` token, which closes a visual block under either template (none when
        a checkpoint template's tokenizer lacks it)."""
        token = self.tokenizer.convert_tokens_to_ids("<|vision_end|>")
        return set() if token is None or token == self.tokenizer.unk_token_id else {int(token)}

    def count(
        self, turns: Sequence[tuple[str, str]], image_tokens: Sequence[int], video_tokens: int | None = None
    ) -> tuple[int, int]:
        """``(text_tokens, label_tokens)`` exactly as :meth:`encode` produces them (the length rule
        applied; image and video tokens excluded); a record has at most one video."""
        return TemplatePreprocessor._counted(self, self.encode(turns, image_tokens, video_tokens))  # type: ignore[arg-type]

    def pixel_values(self, images: list) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pixel_values [P, C*T*p*p], image_grid_thw [n, 3])`` (empty for no images)."""
        if not images:
            return torch.zeros(0, self.inputs.patch_dim), torch.zeros(0, 3, dtype=torch.long)
        out = self.image_processor(images=images, return_tensors="pt")
        return out["pixel_values"].float(), out["image_grid_thw"].long()

    def video_pixel_values(self, frames: list) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pixel_values_videos [P, C*T*p*p], video_grid_thw [1, 3])`` of one video's sampled frames
        (:meth:`~dflop_ds.models.hf.qwen2_vl.synthetic.Qwen2VLInputs.video_pixel_values`)."""
        return self.inputs.video_pixel_values(frames)

    def identity(self) -> str:
        """What fixes the token counts: template, system message, tokenizer contents, image token."""
        template = TEMPLATE_NAME if self.builtin_counts else self.chat_template.identity  # type: ignore[union-attr]
        return counting_identity(
            template, self.counting_system, self.tokenizer, self.image_token_id, self.max_length, self.truncation
        )

    def policy(self) -> ShapePolicy:
        """The :class:`ShapePolicy` of this model's data: per-image patches and tokens from
        :class:`SmartResize`, per-video ones from :class:`VideoFrames`, exact conversation token counts."""
        factor = self.rule.patch_size * self.rule.merge_size
        return ShapePolicy(
            tile_size=factor,
            max_tiles=1,
            add_thumbnail=False,
            tokens_per_tile=1,
            max_frames=1,
            tokens_per_frame=1,
            tokenizer=self.count_text,
            name=self.name,
            tokenizer_id=self.identity(),
            conversation=self.count,
            image_rule=self.rule,
            video_rule=self.video_rule,
        )


def _no_grid() -> torch.Tensor:
    return torch.zeros(0, 3, dtype=torch.long)


@dataclass
class Qwen2VLItem(MediaItem):
    """One sample: ``pixel_values [P, C*T*p*p]``, its images' ``image_grid_thw [n, 3]``, ids and shifted
    targets, and its video's ``pixel_values_videos [Pv, C*T*p*p]`` and ``video_grid_thw [0 or 1, 3]``."""

    image_grid_thw: torch.Tensor = field(default_factory=_no_grid)
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor = field(default_factory=_no_grid)


class Qwen2VLDataset(MediaDataset):
    """The samples of ``shapes`` (made under ``preprocessor.policy()``) as Qwen2-VL contract tensors
    (arguments as :class:`~dflop_ds.models.hf.base.template.MediaDataset`)."""

    preprocessor: Qwen2VLPreprocessor  # type: ignore[assignment]
    supports_video = True
    size_sets_tokens = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.preprocessor.model_type != "qwen2_vl":
            for shape in self.shapes:
                if shape.video_frames:
                    raise self._error(
                        shape.sample_id,
                        "video",
                        f"videos are not supported for {self.preprocessor.model_type} yet (only qwen2_vl)",
                    )

    def _video(self, shape: SampleShape) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pixel_values_videos, video_grid_thw)`` of the sample's video, its sampled frames decoded."""
        if not shape.video_frames:
            return torch.zeros(0, self.preprocessor.inputs.patch_dim), _no_grid()
        path = self.records[shape.sample_id]["video"]
        full = os.path.abspath(os.path.join(self.video_folder, path))  # type: ignore[arg-type]
        try:
            if shape.video_fps is None:
                raise ValueError("its shape has no frame rate (read the data with a video_folder)")
            count = self.preprocessor.video_rule.sampled(shape.video_frames, shape.video_fps)
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
        video_grid = _no_grid()
        if shape.video_frames:
            if shape.video_size is None or shape.video_fps is None:
                raise ValueError("its shape has no frame size or rate (read the data with a video_folder)")
            t_h_w = self.preprocessor.video_rule.grid(shape.video_frames, *shape.video_size, shape.video_fps)
            video_grid = torch.tensor([t_h_w], dtype=torch.long)
        grid = grid.reshape(-1, 3)
        images = torch.zeros(int(grid.prod(-1).sum()), patch_dim), grid
        return images, (torch.zeros(int(video_grid.prod(-1).sum()), patch_dim), video_grid)

    def _item(self, shape: SampleShape, blank: bool) -> Qwen2VLItem:
        """The sample of ``shape`` with its media loaded, or (``blank``) zero pixels of the same grids."""
        if blank:
            (pixel_values, grid), (video_pixels, video_grid) = self._blank_media(shape)
        else:
            pixel_values, grid = self.preprocessor.pixel_values(self._load_images(shape))
            video_pixels, video_grid = self._video(shape)
        merge = self.preprocessor.rule.merge_size
        video_tokens = int(video_grid.prod(-1).sum()) // merge**2 if video_grid.shape[0] else None
        image_tokens = (grid.prod(-1) // merge**2).tolist()
        turns = self._turns(shape)
        ids, targets = self._tensors(shape, lambda: self.preprocessor.encode(turns, image_tokens, video_tokens))
        return Qwen2VLItem(
            shape.sample_id,
            pixel_values,
            ids,
            targets,
            self.preprocessor.pad_token_id,
            None,
            grid,
            video_pixels,
            video_grid,
        )

    def __getitem__(self, idx: Any) -> Qwen2VLItem:
        """The sample at ``idx`` (an ``int`` or a ``ScheduledIndex``, whose denominator is kept)."""
        return super().__getitem__(idx)  # type: ignore[return-value]


def collate_qwen2_vl(items: Sequence[Qwen2VLItem], packed: bool = False):
    """One microbatch ``((pixel_values, input_ids, seq_lens, image_grid_thw, video_grid_thw), (targets,
    loss_denominator))``: ``pixel_values`` holds every image's patches, then every video's, samples in
    order (padding or packing, ``packed``, and denominator as :func:`~dflop_ds.models.hf.base.template.collate_padded`;
    the projector computes each sample's M-RoPE positions)."""
    (pixel_values, input_ids, seq_lens), labels = collate_padded(items, packed)
    videos = [item.pixel_values_videos for item in items if item.pixel_values_videos is not None]
    grid = torch.cat([item.image_grid_thw for item in items])
    video_grid = torch.cat([item.video_grid_thw for item in items])
    return (torch.cat([pixel_values, *videos]), input_ids, seq_lens, grid, video_grid), labels


def collate_packed_qwen2_vl(items: Sequence[Qwen2VLItem]):
    """:func:`collate_qwen2_vl` with ``packed=True`` (a picklable collate for DataLoader workers)."""
    return collate_qwen2_vl(items, packed=True)


__all__ = [
    "DEFAULT_SYSTEM",
    "DEFAULT_VIDEO_FPS",
    "DEFAULT_VIDEO_MAX_FRAMES",
    "Qwen2VLDataset",
    "Qwen2VLItem",
    "Qwen2VLPreprocessor",
    "SmartResize",
    "VideoFrames",
    "collate_packed_qwen2_vl",
    "collate_qwen2_vl",
    "mark_video",
]
