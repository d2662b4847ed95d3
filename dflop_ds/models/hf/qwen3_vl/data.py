"""LLaVA JSON records -> the Qwen3-VL microbatch contract (:mod:`dflop_ds.models.hf.qwen3_vl.model`).

:class:`Qwen3VLPreprocessor` holds a model directory's tokenizer and image processor (the one
Qwen3-VL's processor class uses; the class itself is not needed: its video processor wants
torchvision) on the family-neutral :class:`~dflop_ds.models.hf.base.template.TemplatePreprocessor`,
so the shapes the sampler sees and the tensors the dataset makes agree token for token:

* **Template**: the checkpoint's own ``chat_template`` when it ships one (its ``<|image_pad|>``
  expanded to the image's tokens); otherwise Qwen's ChatML::

      <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{human turn}<|im_end|>\\n
      <|im_start|>assistant\\n{gpt turn}<|im_end|>\\n ...

  each ``<image>`` written as ``<|vision_start|>`` + the image's ``<|image_pad|>`` tokens +
  ``<|vision_end|>``. Supervised: every assistant answer and the ``<|im_end|>`` after it.
* **Images** keep their own size within the image processor's pixel bounds, resized to multiples
  of ``patch * merge`` (32 px on the released checkpoints: patch 16, merge 2, temporal patch 2):
  :class:`SmartResize` gives an image's patches (its ``encoder_tiles``) and LLM tokens
  (patches / merge**2, its ``visual_tokens``), exactly as the processor counts them.
* **Videos** are refused by name (Qwen3-VL's video processor, which writes the per-frame
  timestamps, needs torchvision, which does not load here).
* **Length**: as for every family (``max_length``, ``truncation``); a cut keeps every image block whole.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dflop_ds.data.errors import PathArg
from dflop_ds.models.hf.base.collate import collate_padded
from dflop_ds.models.hf.base.dataset import MediaDataset, MediaItem
from dflop_ds.models.hf.base.folder import from_model_dir
from dflop_ds.models.hf.base.template import (
    IMAGE_PLACEHOLDER,
    VIDEO_PLACEHOLDER,
    Encoded,
    TemplatePreprocessor,
    chosen_template,
)
from dflop_ds.models.hf.qwen3_vl.synthetic import Qwen3VLInputs
from dflop_ds.shapes import SampleShape, ShapePolicy

DEFAULT_SYSTEM = "You are a helpful assistant."
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")


@dataclass(frozen=True)
class SmartResize:
    """The Qwen image size rule: an image is resized to multiples of ``patch_size * merge_size``
    keeping its aspect ratio, its area within ``min_pixels``..``max_pixels``; ``(width, height)
    -> (patches, LLM tokens)`` (a :data:`~dflop_ds.shapes.ImageRule`)."""

    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int

    @classmethod
    def from_image_processor(cls, image_processor: Any) -> SmartResize:
        """The rule of the image processor (its ``size`` edges are the pixel bounds)."""
        size = image_processor.size
        patch, merge = int(image_processor.patch_size), int(image_processor.merge_size)
        return cls(patch, merge, int(size["shortest_edge"]), int(size["longest_edge"]))

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """``(grid_h, grid_w)`` patches of an image of ``width x height`` pixels after resizing."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = self.patch_size * self.merge_size
        new_h, new_w = smart_resize(height, width, factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        return new_h // self.patch_size, new_w // self.patch_size

    def __call__(self, width: int, height: int) -> tuple[int, int]:
        grid_h, grid_w = self.grid(width, height)
        return grid_h * grid_w, grid_h * grid_w // self.merge_size**2


class Qwen3VLPreprocessor(TemplatePreprocessor):
    """A Qwen3-VL directory's tokenizer and image processor plus its conversation template.

    Args:
        tokenizer, image_processor, config: the model directory's (checked against each other).
        system: the system message (default: the checkpoint template's own; the built-in ChatML's
            :data:`DEFAULT_SYSTEM`); name: the policy's name in messages.
        chat_template, max_length, truncation: as for
            :class:`~dflop_ds.models.hf.base.template.TemplatePreprocessor`.
        video_fps, video_max_frames: accepted for the family interface; videos are refused.
    """

    template_name = "qwen3-vl-chatml"

    def __init__(
        self,
        tokenizer: Any,
        image_processor: Any,
        config: Any,
        *,
        system: str | None = None,
        name: str = "qwen3_vl",
        video_fps: float = 1.0,
        video_max_frames: int = 2,
        max_length: int | None = None,
        truncation: str = "error",
        chat_template: str | bool = True,
    ) -> None:
        self.inputs = Qwen3VLInputs(tokenizer, image_processor, config, name)  # checks the processor vs config
        self.image_processor = image_processor
        self.rule = SmartResize.from_image_processor(image_processor)
        template = chosen_template(chat_template, tokenizer)
        builtin_system = DEFAULT_SYSTEM if system is None and template is None else system
        self._set_text(tokenizer, int(config.image_token_id), builtin_system, max_length, truncation, name)
        if template is None:
            self._chatml_tokens()  # the built-in ChatML writes them: refused here, naming the one missing
        self._set_template(template, None)

    def _chatml_tokens(self) -> list[int]:
        """The ids of :data:`CHATML_TOKENS`, which the built-in ChatML writes."""
        ids = []
        for token in CHATML_TOKENS:
            token_id = self.tokenizer.convert_tokens_to_ids(token)
            if token_id is None or token_id == self.tokenizer.unk_token_id:
                raise ValueError(f"{self.name}: the tokenizer has no {token} token (not a Qwen3-VL tokenizer?)")
            ids.append(int(token_id))
        return ids

    @classmethod
    def from_pretrained(cls, model_dir: PathArg, **kwargs: Any) -> Qwen3VLPreprocessor:
        """Load the tokenizer, image processor and config of a ``save_pretrained`` directory (offline)."""
        return from_model_dir(cls, model_dir, "qwen3_vl", **kwargs)

    def _llava_v1(
        self, turns: Sequence[tuple[str, str]], images: Sequence[list[int]], video: list[int] | None, system: str
    ) -> tuple[list[int], list[bool]]:
        """The built-in template (the base class's hook): ``(input_ids, supervised)`` of normalized
        turns under ChatML with ``system``, each ``<image>`` written as its vision block."""
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
                    add([vision_start] + next(blocks) + [vision_end] if part == IMAGE_PLACEHOLDER else self._ids(part))
                add([end] + self._ids("\n"))
            else:
                add([start] + self._ids("assistant\n"))
                add(self._ids(value) + [end], True)
                add(self._ids("\n"))
        return ids, supervised

    def _uncut_tokens(self) -> set[int]:
        """Tokens a truncation must keep: every image token and the ``<|vision_end|>`` closing its block."""
        token = self.tokenizer.convert_tokens_to_ids("<|vision_end|>")
        ends = set() if token is None or token == self.tokenizer.unk_token_id else {int(token)}
        return {self.image_token_id} | ends

    def encode_images(self, turns: Sequence[tuple[str, str]], image_tokens: Sequence[int]) -> Encoded:
        """Token ids and supervision mask of ``(role, value)`` turns whose images give ``image_tokens`` each."""
        return self.encode_media(turns, image_tokens)

    def count(
        self, turns: Sequence[tuple[str, str]], image_tokens: Sequence[int], video_tokens: int | None = None
    ) -> tuple[int, int]:
        """``(text_tokens, label_tokens)`` exactly as :meth:`encode_images` produces them (image
        tokens excluded).

        Raises:
            ValueError: the record has a video (named: Qwen3-VL's videos are not supported yet).
        """
        if video_tokens is not None:
            raise ValueError(
                f"{self.name}: videos are not supported for Qwen3-VL yet (its video processor, which "
                "writes each frame's timestamp, needs torchvision)"
            )
        return self._counted(self.encode_images(turns, image_tokens))

    def pixel_values(self, images: list) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        """``(pixel_values [P, C*T*p*p], image_grid_thw [n, 3])`` (empty for no images)."""
        return self.inputs.pixel_values(images)

    def policy(self) -> ShapePolicy:
        """The :class:`ShapePolicy` of this model's data: per-image patches and tokens from
        :class:`SmartResize`, exact conversation token counts."""
        return ShapePolicy(
            tile_size=self.rule.patch_size * self.rule.merge_size,
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
        )


def _no_grid() -> torch.Tensor:
    return torch.zeros(0, 3, dtype=torch.long)


@dataclass
class Qwen3VLItem(MediaItem):
    """One sample: ``pixel_values [P, C*T*p*p]``, its images' ``image_grid_thw [n, 3]``, ids and shifted targets."""

    image_grid_thw: torch.Tensor = field(default_factory=_no_grid)


class Qwen3VLDataset(MediaDataset):
    """The samples of ``shapes`` (made under ``preprocessor.policy()``) as Qwen3-VL contract tensors
    (arguments as :class:`~dflop_ds.models.hf.base.dataset.MediaDataset`; a sample with a video is
    refused by name)."""

    preprocessor: Qwen3VLPreprocessor
    size_sets_tokens = True

    def _item(self, shape: SampleShape, blank: bool) -> Qwen3VLItem:
        """The sample of ``shape`` with its images loaded, or (``blank``) zero pixels of the same grids."""
        preprocessor = self.preprocessor
        if blank:
            grid = torch.tensor([(1, *preprocessor.rule.grid(w, h)) for w, h in shape.image_sizes], dtype=torch.long)
            grid = grid.reshape(-1, 3)
            pixel_values = torch.zeros(int(grid.prod(-1).sum()), preprocessor.inputs.patch_dim)
        else:
            pixel_values, grid = preprocessor.pixel_values(self._load_images(shape))
        image_tokens = (grid.prod(-1) // preprocessor.rule.merge_size**2).tolist()
        turns = self._turns(shape)
        ids, targets = self._tensors(shape, lambda: preprocessor.encode_images(turns, image_tokens))
        return Qwen3VLItem(shape.sample_id, pixel_values, ids, targets, preprocessor.pad_token_id, None, grid)


def collate_qwen3_vl(items: Sequence[Qwen3VLItem], packed: bool = False):
    """One microbatch ``((pixel_values, input_ids, seq_lens, image_grid_thw), (targets, loss_denominator))``
    (padding or packing, ``packed``, and denominator as :func:`~dflop_ds.models.hf.base.collate.collate_padded`;
    the projector computes each sample's M-RoPE positions)."""
    (pixel_values, input_ids, seq_lens), labels = collate_padded(items, packed)
    return (pixel_values, input_ids, seq_lens, torch.cat([item.image_grid_thw for item in items])), labels


def collate_packed_qwen3_vl(items: Sequence[Qwen3VLItem]):
    """:func:`collate_qwen3_vl` with ``packed=True`` (a picklable collate for DataLoader workers)."""
    return collate_qwen3_vl(items, packed=True)


__all__ = [
    "DEFAULT_SYSTEM",
    "Qwen3VLDataset",
    "Qwen3VLItem",
    "Qwen3VLPreprocessor",
    "SmartResize",
    "collate_packed_qwen3_vl",
    "collate_qwen3_vl",
]
