"""LLaVA JSON records -> the Qwen2-VL microbatch contract (``dflop_ds.models.hf.qwen2_vl``).

:class:`Qwen2VLPreprocessor` holds a model directory's tokenizer and ``Qwen2VLImageProcessor``
(no processor class needed: Qwen2-VL's wants torchvision for videos) and owns the conversation
format, so that the shapes the sampler sees and the tensors the dataset makes agree token for token:

* **Template** (Qwen2-VL's ChatML)::

      <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{human turn}<|im_end|>\\n
      <|im_start|>assistant\\n{gpt turn}<|im_end|>\\n ...

  Each piece is tokenized on its own and the ids concatenated. Supervised: every assistant
  answer and the ``<|im_end|>`` after it.
* **Images**: each ``<image>`` placeholder of a human turn becomes
  ``<|vision_start|>`` + the image's ``<|image_pad|>`` tokens + ``<|vision_end|>``; an image gives
  as many tokens as its own size allows (:class:`SmartResize`, the image processor's rule
  under ``min_pixels``/``max_pixels``). Placeholders are matched to images as for LLaVA
  (:class:`~dflop_ds.models.hf.data.LlavaPreprocessor`: missing ones are prepended).
* **Shapes** (:meth:`Qwen2VLPreprocessor.policy`): an image's ``encoder_tiles`` are its patches
  and its ``visual_tokens`` its LLM tokens (patches / merge**2).

Not yet: videos, and ``max_length`` (the counter cannot see image sizes; the dataset refuses a
sample longer than the tokenizer's ``model_max_length``, naming it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from dflop_ds.data.errors import PathArg
from dflop_ds.models.hf.data import (
    NO_LIMIT,
    Encoded,
    LlavaDataset,
    LlavaItem,
    LlavaPreprocessor,
    _tokenizer_digest,
    collate_llava,
    item_tensors,
)
from dflop_ds.models.hf.qwen2_vl_synthetic import Qwen2VLInputs
from dflop_ds.shapes import ShapePolicy

TEMPLATE_NAME = "qwen2-vl-chatml"
DEFAULT_SYSTEM = "You are a helpful assistant."
IMAGE_PLACEHOLDER = "<image>"


@dataclass(frozen=True)
class SmartResize:
    """Qwen2-VL's image size rule: an image is resized to multiples of ``patch_size * merge_size``
    keeping its aspect ratio, its area within ``min_pixels``..``max_pixels``; ``(width, height)
    -> (patches, LLM tokens)`` (a :data:`~dflop_ds.shapes.ImageRule`)."""

    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int

    @classmethod
    def from_image_processor(cls, image_processor: Any) -> "SmartResize":
        """The rule of a ``Qwen2VLImageProcessor`` (its ``size`` edges are the pixel bounds)."""
        size = image_processor.size
        return cls(int(image_processor.patch_size), int(image_processor.merge_size), int(size["shortest_edge"]),
                   int(size["longest_edge"]))

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """``(grid_h, grid_w)`` patches of an image of ``width x height`` pixels after resizing."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        new_h, new_w = smart_resize(height, width, self.patch_size * self.merge_size, min_pixels=self.min_pixels,
                                    max_pixels=self.max_pixels)
        return new_h // self.patch_size, new_w // self.patch_size

    def __call__(self, width: int, height: int) -> tuple[int, int]:
        grid_h, grid_w = self.grid(width, height)
        return grid_h * grid_w, grid_h * grid_w // self.merge_size ** 2


class Qwen2VLPreprocessor:
    """A Qwen2-VL directory's tokenizer and image processor plus the ChatML conversation template.

    Args:
        tokenizer, image_processor: the model directory's (``AutoTokenizer``, ``AutoImageProcessor``).
        config: the model config (image token, vision patch and merge sizes, checked against the
            image processor).
        system: the system message; name: the policy's name in messages.
    """

    def __init__(self, tokenizer: Any, image_processor: Any, config: Any, *, system: str = DEFAULT_SYSTEM,
                 name: str = "qwen2_vl") -> None:
        self.inputs = Qwen2VLInputs(tokenizer, image_processor, config, name)  # checks the processor vs config
        self.tokenizer, self.image_processor, self.system, self.name = tokenizer, image_processor, system, name
        self.rule = SmartResize.from_image_processor(image_processor)
        self.image_token_id = int(config.image_token_id)
        self.end_of_turn = self._special("<|im_end|>")
        self.vision_start, self.vision_end = self._special("<|vision_start|>"), self._special("<|vision_end|>")
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(tokenizer.eos_token_id if pad is None else pad)
        limit = tokenizer.model_max_length
        self.max_length = None if limit is None or limit > NO_LIMIT else int(limit)

    def _special(self, token: str) -> int:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == self.tokenizer.unk_token_id:
            raise ValueError(f"{self.name}: the tokenizer has no {token} token (not a Qwen2-VL tokenizer?)")
        return int(token_id)

    @classmethod
    def from_pretrained(cls, model_dir: PathArg, **kwargs: Any) -> "Qwen2VLPreprocessor":
        """Load the tokenizer, image processor and config of a ``save_pretrained`` directory (offline)."""
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        path = str(model_dir)
        kwargs.setdefault("name", f"qwen2_vl:{Path(model_dir).name}")
        return cls(AutoTokenizer.from_pretrained(path, local_files_only=True),
                   AutoImageProcessor.from_pretrained(path, local_files_only=True),
                   AutoConfig.from_pretrained(path, local_files_only=True), **kwargs)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def count_text(self, text: str) -> int:
        """Tokens of ``text`` alone."""
        return len(self._ids(text))

    def encode(self, turns: Sequence[tuple[str, str]], image_tokens: Sequence[int]) -> Encoded:
        """Token ids and supervision mask of ``(role, value)`` turns whose images give ``image_tokens`` tokens each.

        Raises:
            ValueError: a bad role or placeholder mismatch, naming the field.
        """
        ids: list[int] = []
        supervised: list[bool] = []

        def add(tokens: list[int], label: bool = False) -> None:
            ids.extend(tokens)
            supervised.extend([label] * len(tokens))

        start, end = self._special("<|im_start|>"), self.end_of_turn
        if self.system:
            add([start] + self._ids(f"system\n{self.system}") + [end] + self._ids("\n"))
        images = iter(image_tokens)
        # the roles and placeholders are checked (and missing placeholders added) as for LLaVA
        for kind, value in LlavaPreprocessor._normalize(self, turns, len(image_tokens)):  # type: ignore[arg-type]
            if kind == "user":
                add([start] + self._ids("user\n"))
                for k, part in enumerate(value.split(IMAGE_PLACEHOLDER)):
                    if k:
                        add([self.vision_start] + [self.image_token_id] * next(images) + [self.vision_end])
                    add(self._ids(part))
                add([end] + self._ids("\n"))
            else:
                add([start] + self._ids("assistant\n"))
                add(self._ids(value) + [end], True)
                add(self._ids("\n"))
        return Encoded(ids, supervised, sum(image_tokens))

    def count(self, turns: Sequence[tuple[str, str]], n_images: int) -> tuple[int, int]:
        """``(text_tokens, label_tokens)`` exactly as :meth:`encode` produces them (image tokens excluded)."""
        encoded = self.encode(turns, [0] * n_images)
        return len(encoded.input_ids), encoded.label_count

    def pixel_values(self, images: list) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pixel_values [P, C*T*p*p], image_grid_thw [n, 3])`` (empty for no images)."""
        if not images:
            return torch.zeros(0, self.inputs.patch_dim), torch.zeros(0, 3, dtype=torch.long)
        out = self.image_processor(images=images, return_tensors="pt")
        return out["pixel_values"].float(), out["image_grid_thw"].long()

    def identity(self) -> str:
        """What fixes the token counts: template, system message, tokenizer contents, image token."""
        import hashlib

        system = hashlib.sha256(self.system.encode("utf-8")).hexdigest()[:8]
        return (f"{TEMPLATE_NAME} system:{system} tokenizer:{type(self.tokenizer).__name__}:"
                f"{_tokenizer_digest(self.tokenizer)} image_token:{self.image_token_id}")

    def policy(self) -> ShapePolicy:
        """The :class:`ShapePolicy` of this model's data: per-image patches and tokens from
        :class:`SmartResize`, exact conversation token counts (videos are not supported)."""
        factor = self.rule.patch_size * self.rule.merge_size
        return ShapePolicy(tile_size=factor, max_tiles=1, add_thumbnail=False, tokens_per_tile=1, max_frames=1,
                           tokens_per_frame=1, tokenizer=self.count_text, name=self.name,
                           tokenizer_id=self.identity(), conversation=self.count, image_rule=self.rule)


@dataclass
class Qwen2VLItem(LlavaItem):
    """One sample: ``pixel_values [P, C*T*p*p]``, its images' ``image_grid_thw [n, 3]``, ids and shifted targets."""

    image_grid_thw: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 3, dtype=torch.long))


class Qwen2VLDataset(LlavaDataset):
    """The samples of ``shapes`` (made under ``preprocessor.policy()``) as Qwen2-VL contract tensors
    (arguments as :class:`~dflop_ds.models.hf.data.LlavaDataset`)."""

    preprocessor: Qwen2VLPreprocessor  # type: ignore[assignment]

    def __getitem__(self, idx: int) -> Qwen2VLItem:
        """The sample at ``idx`` (an ``int`` or a ``ScheduledIndex``, whose denominator is kept)."""
        shape, images, turns = self._sample(idx)
        pixel_values, grid = self.preprocessor.pixel_values(images)
        merge = self.preprocessor.rule.merge_size
        try:
            encoded = self.preprocessor.encode(turns, (grid.prod(-1) // merge ** 2).tolist())
        except ValueError as exc:
            raise self._error(shape.sample_id, None, str(exc)) from exc
        length, limit = len(encoded.input_ids), self.preprocessor.max_length
        if limit is not None and length > limit:
            raise self._error(shape.sample_id, None, f"{length} tokens (images expanded) exceed max_length {limit}")
        try:
            ids, targets = item_tensors(encoded, shape, self.preprocessor.name)
        except ValueError as exc:
            raise self._error(shape.sample_id, None, str(exc)) from exc
        denominator = getattr(idx, "loss_denominator", None)
        return Qwen2VLItem(shape.sample_id, pixel_values, ids, targets, self.preprocessor.pad_token_id,
                           None if denominator is None else float(denominator), grid)


def collate_qwen2_vl(items: Sequence[Qwen2VLItem]):
    """One microbatch ``((pixel_values, input_ids, seq_lens, image_grid_thw), (targets, loss_denominator))``
    (padding and denominator as :func:`~dflop_ds.models.hf.data.collate_llava`)."""
    (pixel_values, input_ids, seq_lens), labels = collate_llava(items)
    grid = torch.cat([item.image_grid_thw for item in items])
    return (pixel_values, input_ids, seq_lens, grid), labels


__all__ = ["DEFAULT_SYSTEM", "Qwen2VLDataset", "Qwen2VLItem", "Qwen2VLPreprocessor", "SmartResize",
           "collate_qwen2_vl"]
