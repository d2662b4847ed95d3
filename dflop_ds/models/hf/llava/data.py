"""LLaVA's data pipeline: its processor (one tile per image) on the shared template, and its shape policy.

:class:`LlavaPreprocessor` wraps a model directory's ``LlavaProcessor`` (its image processor and
tokenizer) around :class:`~dflop_ds.models.hf.base.template.TemplatePreprocessor`: each ``<image>``
placeholder becomes ``image_seq_length`` copies of the image token (as ``LlavaProcessor`` expands
it). Only plain LLaVA (one tile per image) is handled here (LLaVA-OneVision has its own family).
transformers and PIL are imported lazily.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflop_ds.data.errors import PathArg
from dflop_ds.models.hf.base.chat_template import checkpoint_chat_template
from dflop_ds.models.hf.base.folder import check_model_folder
from dflop_ds.models.hf.base.template import TemplatePreprocessor, chosen_template
from dflop_ds.models.hf.llava.processor import load_processor
from dflop_ds.shapes import ShapePolicy


class LlavaPreprocessor(TemplatePreprocessor):
    """A LLaVA processor's image processor and tokenizer plus the conversation template.

    Args:
        processor: a ``transformers.LlavaProcessor``.
        system: the system message (default: the checkpoint template's own; the built-in
            template's :data:`~dflop_ds.models.hf.base.template.DEFAULT_SYSTEM`).
        max_length: longest sequence, image tokens included (default: ``model_max_length``).
        truncation: ``"error"`` (a longer sample is a bad record) or ``"truncate"``.
        name: the policy's name in messages (e.g. the model directory's name).
        chat_template: ``True``: the checkpoint's own template when it ships one, else the built-in
            one; ``False``: the built-in one; a string: that Jinja template.
    """

    def __init__(
        self,
        processor: Any,
        *,
        system: str | None = None,
        max_length: int | None = None,
        truncation: str = "error",
        name: str = "llava",
        chat_template: str | bool = True,
    ) -> None:
        kind = type(processor).__name__
        image_processor = getattr(processor, "image_processor", None)
        if kind != "LlavaProcessor" or getattr(image_processor, "image_grid_pinpoints", None):
            raise ValueError(
                f"processor {kind} is not supported: only plain LLaVA (LlavaProcessor, one tile "
                "per image); LLaVA-OneVision directories load as their own family, LLaVA-NeXT is not supported"
            )
        self.processor = processor
        self.image_processor: Any = image_processor  # the LlavaProcessor's, checked above
        template = chosen_template(chat_template, processor, processor.tokenizer)
        self._set_text(processor.tokenizer, int(processor.image_token_id), system, max_length, truncation, name)
        self._set_template(template, None)
        self.pixel_shape = tuple(self._process([_blank_image()]).shape[1:])
        self.image_seq_length = self._tokens_per_image()

    @classmethod
    def from_pretrained(cls, model_dir: PathArg, **kwargs: Any) -> LlavaPreprocessor:
        """Load the processor of a ``save_pretrained`` directory (offline) and wrap it: its
        ``AutoProcessor``, else one built from its tokenizer and image processor, with the image
        token count checked against the model's config
        (:func:`dflop_ds.models.hf.llava.processor.load_processor`)."""
        from transformers import AutoConfig

        check_model_folder(model_dir, weights=False)
        config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        processor = load_processor(Path(model_dir), config)
        kwargs.setdefault("name", f"llava:{Path(model_dir).name}")
        if kwargs.get("chat_template", True) is True:  # the checkpoint's, its legacy template file included
            kwargs["chat_template"] = (
                checkpoint_chat_template(processor, processor.tokenizer, model_dir=model_dir) or False
            )
        return cls(processor, **kwargs)

    def _tokens_per_image(self) -> int:
        patch = getattr(self.processor, "patch_size", None)
        if not patch:
            raise ValueError(
                f"{self.name}: the processor has no patch_size, so the image tokens per image are "
                "unknown (save the processor with patch_size and vision_feature_select_strategy)"
            )
        _, height, width = self.pixel_shape
        tokens = (height // patch) * (width // patch) + int(getattr(self.processor, "num_additional_image_tokens", 0))
        if getattr(self.processor, "vision_feature_select_strategy", None) == "default":
            tokens -= 1
        if tokens < 1:
            raise ValueError(f"{self.name}: {tokens} image tokens per image for {height}x{width} pixels, patch {patch}")
        return tokens

    def policy(self) -> ShapePolicy:
        """The :class:`ShapePolicy` of this model's data: one tile per image of ``image_seq_length``
        tokens and exact conversation token counts (videos are not supported)."""
        _, height, width = self.pixel_shape
        return self._policy(max(height, width), self.image_seq_length)


def _blank_image() -> Any:
    from PIL import Image

    return Image.new("RGB", (64, 48))


def llava_policy(model_dir: PathArg, *, max_length: int | None = None, truncation: str = "error") -> ShapePolicy:
    """The shape policy of a HuggingFace LLaVA ``save_pretrained`` directory's processor."""
    return LlavaPreprocessor.from_pretrained(model_dir, max_length=max_length, truncation=truncation).policy()


__all__ = ["LlavaPreprocessor", "llava_policy"]
