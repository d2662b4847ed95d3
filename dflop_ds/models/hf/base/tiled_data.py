"""What the families that cut images into tiles share in their preprocessors: a ``media`` helper
(tiles and token counts) built from the directory's tokenizer, image processor and config,
videos of at most ``video_max_frames`` uniformly sampled frames, and the template of
:class:`~dflop_ds.models.hf.base.template.TemplatePreprocessor` (the checkpoint's own, else LLaVA-v1).
A family subclass says how its media helper is built and which token ids it writes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from dflop_ds.data.errors import PathArg
from dflop_ds.data.video import DEFAULT_VIDEO_MAX_FRAMES
from dflop_ds.models.hf.base.folder import from_model_dir
from dflop_ds.models.hf.base.template import TemplatePreprocessor, chosen_template

Tiled = TypeVar("Tiled", bound="TiledPreprocessor")


class TiledPreprocessor(TemplatePreprocessor):
    """A tiling family's tokenizer, image processor and media helper plus the conversation template.

    Args:
        tokenizer, image_processor, config: the directory's (``AutoTokenizer``, ``AutoImageProcessor``, config).
        video_max_frames: frames sampled uniformly from a video (at most).
        system, max_length, truncation, name, chat_template: as for
            :class:`~dflop_ds.models.hf.base.template.TemplatePreprocessor` (``name`` defaults to
            :attr:`family_name`).
    """

    #: the family's name in messages and the default policy name
    family_name = "tiled"

    def __init__(
        self,
        tokenizer: Any,
        image_processor: Any,
        config: Any,
        *,
        system: str | None = None,
        max_length: int | None = None,
        truncation: str = "error",
        name: str | None = None,
        video_max_frames: int = DEFAULT_VIDEO_MAX_FRAMES,
        chat_template: str | bool = True,
    ) -> None:
        name = name or self.family_name
        if video_max_frames < 1:
            raise ValueError(f"{name}: video_max_frames must be >= 1, got {video_max_frames}")
        self.media = self._media(tokenizer, image_processor, config, name)
        self.image_processor = image_processor
        self.video_max_frames = int(video_max_frames)
        image_token_id, self.video_token_id, video_marker = self._media_tokens(tokenizer)
        self._set_text(tokenizer, image_token_id, system, max_length, truncation, name)
        self._set_template(chosen_template(chat_template, tokenizer), video_marker)
        self.pixel_shape = self.media.tile_shape

    @classmethod
    def from_pretrained(cls: type[Tiled], model_dir: PathArg, **kwargs: Any) -> Tiled:
        """Load the tokenizer, image processor and config of a ``save_pretrained`` directory (offline)."""
        return from_model_dir(cls, model_dir, cls.family_name, **kwargs)

    def _media(self, tokenizer: Any, image_processor: Any, config: Any, name: str) -> Any:
        """The family's media helper (tiles, token counts, ``tile_shape``)."""
        raise NotImplementedError

    def _media_tokens(self, tokenizer: Any) -> tuple[int, int, int | None]:
        """``(image token, video token, video marker)``: the ids an image's and a video's blocks are
        made of, and the one token a chat template writes for a video (None: none)."""
        raise NotImplementedError

    def count(
        self, turns: Sequence[tuple[str, str]], image_tokens: Sequence[int], video_tokens: int | None = None
    ) -> tuple[int, int]:
        """``(text_tokens, label_tokens)`` exactly as :meth:`encode_media` produces them (visual
        tokens excluded; whatever else an image's block writes counts as text)."""
        return self._counted(self.encode_media(turns, image_tokens, video_tokens))


def tiled_preprocessor_loader(cls: type[Tiled]) -> Callable[..., Tiled]:
    """The family's ``preprocessor`` entry: ``(model_dir, *, max_length, truncation, video_max_frames,
    **video) ->`` ``cls.from_pretrained(...)`` (frames are sampled uniformly, so the frame rate in
    ``video`` does not apply)."""

    def load(
        model_dir: str,
        *,
        max_length: int | None = None,
        truncation: str = "error",
        video_max_frames: int = DEFAULT_VIDEO_MAX_FRAMES,
        **video: Any,
    ) -> Tiled:
        return cls.from_pretrained(
            model_dir, max_length=max_length, truncation=truncation, video_max_frames=video_max_frames
        )

    return load


__all__ = ["TiledPreprocessor", "tiled_preprocessor_loader"]
