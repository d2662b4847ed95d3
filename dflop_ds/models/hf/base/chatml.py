"""The ChatML conversation template with vision blocks, as a built-in template of
:class:`~dflop_ds.models.hf.base.template.TemplatePreprocessor` (the Qwen-VL families' format)::

    <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{human turn}<|im_end|>\\n
    <|im_start|>assistant\\n{gpt turn}<|im_end|>\\n ...

Each piece is tokenized on its own and the ids concatenated; every ``<image>`` (``<video>``) of a
human turn becomes ``<|vision_start|>`` + the image's (video's) tokens + ``<|vision_end|>``.
Supervised: every assistant answer and the ``<|im_end|>`` after it. A truncation keeps every
visual block whole, its ``<|vision_end|>`` included.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from dflop_ds.models.hf.base.template import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, TemplatePreprocessor

#: the special tokens the built-in ChatML writes: turn start and end, visual block start and end
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")


class ChatMLPreprocessor(TemplatePreprocessor):
    """A :class:`~dflop_ds.models.hf.base.template.TemplatePreprocessor` whose built-in template is
    ChatML with vision blocks (the family sets the tokenizer and template as for the base class)."""

    template_name = "chatml"
    default_system = "You are a helpful assistant."

    def _token(self, token: str) -> int | None:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        return None if token_id is None or token_id == self.tokenizer.unk_token_id else int(token_id)

    def _builtin_refusal(self) -> str | None:
        """The first of :data:`CHATML_TOKENS` the tokenizer lacks, named (None: it has them all)."""
        missing = next((token for token in CHATML_TOKENS if self._token(token) is None), None)
        return None if missing is None else f"the tokenizer has no {missing} token (not a ChatML tokenizer?)"

    def _chatml_tokens(self) -> list[int]:
        """The ids of :data:`CHATML_TOKENS` (``ValueError`` naming the first one the tokenizer lacks)."""
        refusal = self._builtin_refusal()
        if refusal is not None:
            raise ValueError(f"{self.name}: {refusal}")
        return [int(self._token(token)) for token in CHATML_TOKENS]  # type: ignore[arg-type]

    def _builtin(
        self, turns: Sequence[tuple[str, str]], images: Sequence[list[int]], video: list[int] | None, system: str
    ) -> tuple[list[int], list[bool]]:
        """``(input_ids, supervised)`` of normalized turns under ChatML with ``system``, each
        placeholder written as ``<|vision_start|>``, its image's (in order) or the video's tokens
        and ``<|vision_end|>``."""
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
        """Tokens a truncation must keep: every image and video token and the ``<|vision_end|>``
        closing their blocks (under either template; absent when a checkpoint template's tokenizer lacks it)."""
        kept = {self.image_token_id} | ({int(self.video_token_id)} if self.video_token_id is not None else set())
        vision_end = self._token("<|vision_end|>")
        return kept if vision_end is None else kept | {vision_end}


__all__ = ["CHATML_TOKENS", "ChatMLPreprocessor"]
