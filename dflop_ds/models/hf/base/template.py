"""Template tokenisation every HF family shares: chat records -> token ids and supervision.

:class:`TemplatePreprocessor` owns the one conversation format of a model directory, so that the
shapes the sampler sees and the tensors the dataset makes come from the same code and agree token
for token (a family subclass adds its processor, media blocks and shape policy):

* **Template**: the checkpoint's own ``chat_template`` (the processor's, else the tokenizer's)
  when it ships one (:mod:`~dflop_ds.models.hf.base.chat_template`: labels are the assistant turns'
  tokens; the system message is the template's own unless ``system`` is given). Otherwise the
  built-in LLaVA-v1 / Vicuna template::

      <bos>{system} USER: {human turn} ASSISTANT: {gpt turn}<eos>USER: ... ASSISTANT: ...<eos>

  Each piece is tokenized on its own (no special tokens added) and the pieces' ids are
  concatenated; ``<bos>`` is there when the tokenizer has one. Supervised (labels): every
  assistant answer and the ``<eos>`` after it. Roles: ``human``/``user`` and
  ``gpt``/``assistant`` (any case); any other role is a bad record.
* **Images**: each ``<image>`` placeholder in a human turn becomes the image's block of tokens, so
  the features go where the prompt put them. A record with images but no placeholder gets
  ``<image>\\n`` per image prepended to its first human turn (as LLaVA does); other mismatches
  are bad records. A video (families that take them) is placed by :func:`mark_video`.
* **Length**: sequences longer than ``max_length`` (default: the tokenizer's
  ``model_max_length``) are bad records (``truncation="error"``, the default) or cut at
  ``max_length`` (``truncation="truncate"``, counted in ``truncated_samples``); a cut that
  would drop image tokens is always a bad record.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from dflop_ds.data.llava import ASSISTANT_ROLES, SYSTEM_ROLE, USER_ROLES
from dflop_ds.models.hf.base.chat_template import ModelChatTemplate, checkpoint_chat_template, encode_alike
from dflop_ds.shapes import ShapePolicy, length_rule

logger = logging.getLogger(__name__)

TEMPLATE_NAME = "llava-v1"
DEFAULT_SYSTEM = (
    "A chat between a curious human and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the human's questions."
)
IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
TRUNCATION = ("error", "truncate")
#: tokenizers without a real limit report a huge ``model_max_length``; above this it means none
NO_LIMIT = 10**8


@dataclass(frozen=True)
class Encoded:
    """One conversation as token ids; ``supervised[t]`` marks tokens the loss predicts."""

    input_ids: list[int]
    supervised: list[bool]
    image_tokens: int
    truncated: int = 0

    @property
    def label_count(self) -> int:
        """Targets the sample gets: supervised tokens after position 0 (position 0 is never predicted)."""
        return sum(self.supervised[1:])


def _tokenizer_digest(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` alone (no special tokens added; none for empty text)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def counting_identity(
    template: str, system: str, tokenizer: Any, image_token_id: int, max_length: int | None, truncation: str
) -> str:
    """What fixes a preprocessor's token counts: its chat ``template``, ``system`` message (hashed),
    tokenizer (class and contents), image token and length rule."""
    digest = hashlib.sha256(system.encode("utf-8")).hexdigest()[:8]
    return (
        f"{template} system:{digest} tokenizer:{type(tokenizer).__name__}:"
        f"{_tokenizer_digest(tokenizer)} image_token:{image_token_id} {length_rule(max_length, truncation)}"
    )


def mark_video(turns: Sequence[tuple[str, str]], n_images: int) -> list[tuple[str, str]]:
    """``turns`` of a record with one video, its placeholder made the one ``<video>``: LLaVA-Video
    marks it with the one ``<image>`` of a record without images; a record without a mark gets
    ``<video>\n`` before its first human turn."""
    turns = list(turns)
    marks = sum(value.count(VIDEO_PLACEHOLDER) for _, value in turns)
    if marks > 1:
        raise ValueError(f"conversations: {marks} {VIDEO_PLACEHOLDER} placeholders for the record's one video")
    if marks == 1:
        return turns
    image_marks = [i for i, (_, value) in enumerate(turns) if IMAGE_PLACEHOLDER in value]
    if not n_images and len(image_marks) == 1 and turns[image_marks[0]][1].count(IMAGE_PLACEHOLDER) == 1:
        i = image_marks[0]
        return [*turns[:i], (turns[i][0], turns[i][1].replace(IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER)), *turns[i + 1 :]]
    for i, (role, value) in enumerate(turns):
        if role.lower() in USER_ROLES:
            return [*turns[:i], (role, f"{VIDEO_PLACEHOLDER}\n{value}"), *turns[i + 1 :]]
    raise ValueError("conversations: the record has a video but no human turn to put it in")


class TemplatePreprocessor:
    """A family's tokenizer plus the conversation template: what every family's preprocessor
    shares (the length rule, the checkpoint's chat template or the built-in LLaVA-v1 one, encoding
    and counting conversations with media blocks, the counting identity).

    A family subclass sets the tokenizer and template in its ``__init__`` (:meth:`_set_text`, then
    :meth:`_set_template`), its ``pixel_shape``, and gives ``policy()``.
    """

    #: the built-in template's name in the policy's identity
    template_name = TEMPLATE_NAME

    #: the built-in template's system message when ``system`` is not given
    default_system = DEFAULT_SYSTEM

    #: the video token (None: the family takes no videos)
    video_token_id: int | None = None

    #: ``(C, H, W)`` of one tile's pixel values, set by the family
    pixel_shape: tuple[int, ...]

    #: the image processor, set by the family
    image_processor: Any

    #: tokens of one image, for :meth:`encode` (set by a family whose images all give as many)
    image_seq_length: int

    def _set_text(
        self,
        tokenizer: Any,
        image_token_id: int,
        system: str | None,
        max_length: int | None,
        truncation: str,
        name: str,
    ) -> None:
        """The tokenizer's and length rule's settings (shared with the families built on this class);
        :meth:`_set_template` then picks the template."""
        if truncation not in TRUNCATION:
            raise ValueError(f"truncation must be one of {TRUNCATION}, got {truncation!r}")
        self.tokenizer = tokenizer
        self.system = system
        self.truncation = truncation
        self.name = name
        self.truncated_samples = 0
        self.image_token_id = image_token_id
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.pad_token_id = pad_token_id(tokenizer, name)
        limit = max_length if max_length is not None else tokenizer.model_max_length
        self.max_length = None if limit is None or limit > NO_LIMIT else int(limit)

    def _set_template(self, template: str | None, video_marker: int | None) -> None:
        """Use the Jinja ``template`` (whose video marker token is ``video_marker``), or (None) the
        built-in LLaVA-v1 template, which ends assistant turns with the eos token."""
        self.chat_template = (
            None
            if template is None
            else ModelChatTemplate(template, self.tokenizer, self.image_token_id, video_marker, self.name)
        )
        builtin_system = self.default_system if self.system is None else self.system
        refusal = self._builtin_refusal()
        if self.chat_template is None:
            if refusal is not None:
                raise ValueError(f"{self.name}: {refusal}")
            self.system = builtin_system
        video_id = self.video_token_id
        #: whether the tokens are the built-in template's: none shipped, or one that tokenizes alike
        self.builtin_counts = self.chat_template is None or (
            refusal is None
            and encode_alike(
                partial(self.chat_template.encode, system=self.system),
                partial(self._builtin, system=builtin_system),
                self._image_block,
                None if video_id is None else partial(self._video_block, int(video_id)),
            )
        )
        self.counting_system = builtin_system if self.builtin_counts else self.system or ""

    def _builtin_refusal(self) -> str | None:
        """Why the built-in template cannot write this tokenizer's conversations (None: it can)."""
        return None if self.eos_token_id is not None else "the tokenizer has no eos token to end assistant turns with"

    # -- text ---------------------------------------------------------------------------
    def _ids(self, text: str) -> list[int]:
        return text_ids(self.tokenizer, text)

    def count_text(self, text: str) -> int:
        """Tokens of ``text`` alone (for shape manifests that carry raw text)."""
        return len(self._ids(text))

    def _normalize(
        self, turns: Sequence[tuple[str, str]], n_images: int, videos: bool = False
    ) -> tuple[list[tuple[str, str]], str | None]:
        """``(turns, system)``: the turns with roles mapped to user/assistant and image placeholders
        matched to ``n_images`` (``<video>`` placeholders are refused unless ``videos``: a family
        that takes videos places them), and the system message to write them with: a first
        ``system`` turn's text (as chat templates and the frameworks take it), else the
        preprocessor's (None: the template's own)."""
        normalized, placeholders, system = [], 0, self.system
        for i, (role, value) in enumerate(turns):
            if role.lower() == SYSTEM_ROLE:
                if i:
                    raise ValueError(
                        f"conversations[{i}].from: a system turn after the first: only the first turn may be one"
                    )
                if IMAGE_PLACEHOLDER in value or VIDEO_PLACEHOLDER in value:
                    raise ValueError("conversations[0].value: an image or video placeholder in the system turn")
                system = value
                continue
            kind = "user" if role.lower() in USER_ROLES else "assistant" if role.lower() in ASSISTANT_ROLES else None
            if kind is None:
                raise ValueError(
                    f"conversations[{i}].from: unknown role {role!r} (expected system (first), human/user or"
                    " gpt/assistant, any case)"
                )
            if VIDEO_PLACEHOLDER in value and not videos:
                raise ValueError(f"conversations[{i}].value: {VIDEO_PLACEHOLDER} is not supported by this model family")
            if IMAGE_PLACEHOLDER in value and kind == "assistant":
                raise ValueError(f"conversations[{i}].value: {IMAGE_PLACEHOLDER} in an assistant turn")
            placeholders += value.count(IMAGE_PLACEHOLDER)
            normalized.append((kind, value))
        if n_images and not placeholders:
            first = next((i for i, (kind, _) in enumerate(normalized) if kind == "user"), None)
            if first is None:
                raise ValueError("conversations: the record has images but no human turn to put them in")
            normalized[first] = ("user", f"{IMAGE_PLACEHOLDER}\n" * n_images + normalized[first][1])
        elif placeholders != n_images:
            raise ValueError(
                f"conversations: {placeholders} {IMAGE_PLACEHOLDER} placeholder(s) for {n_images} image(s) in 'image'"
            )
        return normalized, system

    def encode(self, turns: Sequence[tuple[str, str]], n_images: int) -> Encoded:
        """Token ids and supervision mask of a conversation of ``(role, value)`` turns with ``n_images``
        images of ``image_seq_length`` tokens each.

        Raises:
            ValueError: a bad role, placeholder mismatch or over-long sample, naming the field.
        """
        return self.encode_media(turns, [self.image_seq_length] * n_images)

    def encode_media(
        self,
        turns: Sequence[tuple[str, str]],
        image_tokens: Sequence[int],
        video_tokens: int | Sequence[int] | None = None,
    ) -> Encoded:
        """Token ids and supervision mask of ``(role, value)`` turns under the template, whose
        images give ``image_tokens`` tokens each and whose one video (if any, placed by
        :func:`mark_video`) ``video_tokens`` (a count of video tokens, or the video's block of ids
        as the family writes it: all of it counts as visual).

        Raises:
            ValueError: a bad role, placeholder mismatch or over-long sample, naming the field.
        """
        video_id = self.video_token_id
        if video_tokens is None and video_id is not None and any(VIDEO_PLACEHOLDER in value for _, value in turns):
            raise ValueError(f"conversations: a {VIDEO_PLACEHOLDER} placeholder but the record has no video")
        if video_tokens is not None:
            if video_id is None:
                raise ValueError(f"{self.name}: the model takes no videos")
            turns = mark_video(turns, len(image_tokens))
        normalized, system = self._normalize(turns, len(image_tokens), videos=video_tokens is not None)
        images = [self._image_block(tokens) for tokens in image_tokens]
        video, video_visual = None, 0
        if isinstance(video_tokens, (list, tuple)):  # the block itself, all of it visual
            video = [int(token) for token in video_tokens]
            video_visual = len(video)
        elif video_tokens is not None:  # the family's block, of which video_tokens are visual
            video_visual = int(video_tokens)  # type: ignore[arg-type]  # a count (int or numpy/torch scalar)
            video = self._video_block(int(video_id or 0), video_visual)
        if self.chat_template is None:
            ids, supervised = self._builtin(normalized, images, video, system=system or "")
        else:
            ids, supervised = self.chat_template.encode(normalized, images, video, system=system)
        return self._fit(Encoded(ids, supervised, sum(image_tokens) + video_visual))

    def _builtin(
        self, turns: Sequence[tuple[str, str]], images: Sequence[list[int]], video: list[int] | None, system: str
    ) -> tuple[list[int], list[bool]]:
        """``(input_ids, supervised)`` of normalized turns under the built-in template (here LLaVA-v1;
        a family may give its own) with ``system``, each placeholder replaced by its image's (in
        order) or the video's block of ids."""
        ids: list[int] = []
        supervised: list[bool] = []

        def add(tokens: list[int], label: bool) -> None:
            ids.extend(tokens)
            supervised.extend([label] * len(tokens))

        blocks = iter(images)
        if self.bos_token_id is not None:
            add([int(self.bos_token_id)], False)
        if system:
            add(self._ids(system + " "), False)
        for kind, value in turns:
            if kind == "user":
                for part in re.split(f"({IMAGE_PLACEHOLDER}|{VIDEO_PLACEHOLDER})", f"USER: {value} "):
                    if part == IMAGE_PLACEHOLDER:
                        add(next(blocks), False)
                    elif part == VIDEO_PLACEHOLDER:
                        add(video or [], False)
                    else:
                        add(self._ids(part), False)
            else:
                add(self._ids("ASSISTANT: "), False)
                add(self._ids(value) + [int(self.eos_token_id)], True)
        return ids, supervised

    def _image_block(self, tokens: int) -> list[int]:
        """The ids an image of ``tokens`` visual tokens writes into the prompt."""
        return [self.image_token_id] * tokens

    def _video_block(self, video_id: int, tokens: int) -> list[int]:
        """The ids a video of ``tokens`` visual tokens writes into the prompt."""
        return [video_id] * tokens

    def _fit(self, encoded: Encoded) -> Encoded:
        length = len(encoded.input_ids)
        if self.max_length is None or length <= self.max_length:
            return encoded
        if self.truncation == "error":
            raise ValueError(
                f"conversations: {length} tokens (images expanded) exceed max_length {self.max_length}"
                " (the tokenizer's model_max_length unless set): raise dflop.data.max_length, or set"
                ' dflop.data.truncation = "truncate" to cut such samples (counted), or skip them with'
                ' "on_bad_sample": "skip"'
            )
        kept = self._uncut_tokens()
        last_image = max((t for t, token in enumerate(encoded.input_ids) if token in kept), default=-1)
        if last_image >= self.max_length:
            raise ValueError(
                f"conversations: cutting {length} tokens at max_length {self.max_length} would drop "
                "image tokens (or cut through an image's or video's tokens)"
            )
        keep = self.max_length
        return Encoded(encoded.input_ids[:keep], encoded.supervised[:keep], encoded.image_tokens, length - keep)

    def _uncut_tokens(self) -> set[int]:
        """Tokens a truncation must keep whole: the image tokens."""
        return {self.image_token_id}

    def count(
        self, turns: Sequence[tuple[str, str]], image_tokens: Sequence[int], video_tokens: int | None = None
    ) -> tuple[int, int]:
        """``(text_tokens, label_tokens)`` exactly as :meth:`encode` produces them for images of
        ``image_tokens`` tokens each (every image has ``image_seq_length``; image tokens excluded).
        A video is refused by the dataset, so ``video_tokens`` does not change the count."""
        return self._counted(self.encode(turns, len(image_tokens)))

    def _counted(self, encoded: Encoded) -> tuple[int, int]:
        """``(text_tokens, label_tokens)`` of an encoded sample (visual tokens excluded); a truncated
        one is counted in ``truncated_samples`` (and the first logged)."""
        if encoded.truncated:
            if not self.truncated_samples:
                logger.warning(
                    "%s: truncating samples longer than max_length %d (counted in truncated_samples)",
                    self.name,
                    self.max_length,
                )
            self.truncated_samples += 1
        return len(encoded.input_ids) - encoded.image_tokens, encoded.label_count

    # -- images -------------------------------------------------------------------------
    def _process(self, images: list) -> torch.Tensor:
        return self.image_processor(images=images, return_tensors="pt")["pixel_values"]

    def pixel_values(self, images: list) -> torch.Tensor:
        """``[len(images), C, H, W]`` float pixel values (``[0, C, H, W]`` for no images)."""
        if not images:
            return torch.zeros((0, *self.pixel_shape), dtype=torch.float32)
        return self._process(images).float()

    def _policy(self, tile_size: int, tokens_per_tile: int, **rule: Any) -> ShapePolicy:
        """The :class:`ShapePolicy` counting this preprocessor's conversations exactly, one tile of
        ``tile_size`` and ``tokens_per_tile`` per image unless ``rule`` (the family's image, video
        or sample rules and frame numbers, as :class:`ShapePolicy` takes them) says otherwise."""
        fields: dict[str, Any] = {"max_tiles": 1, "add_thumbnail": False, "max_frames": 1, "tokens_per_frame": 1}
        return ShapePolicy(
            tile_size=tile_size,
            tokens_per_tile=tokens_per_tile,
            tokenizer=self.count_text,
            name=self.name,
            tokenizer_id=self.identity(),
            conversation=self.count,
            **{**fields, **rule},
        )

    # -- identity -----------------------------------------------------------------------
    def identity(self) -> str:
        """What fixes the token counts: template (the built-in one's name, also for a checkpoint's
        template that tokenizes alike; else the checkpoint's by digest), system message, tokenizer
        contents, image token, length rule."""
        template = self.template_name if self.builtin_counts else self.chat_template.identity  # type: ignore[union-attr]
        return counting_identity(
            template, self.counting_system, self.tokenizer, self.image_token_id, self.max_length, self.truncation
        )


def chosen_template(choice: str | bool, *holders: Any) -> str | None:
    """The Jinja template a preprocessor uses: ``choice`` when a string; for ``True`` the first of
    ``holders`` (processor, tokenizer) that ships one; None (the built-in template) for ``False``
    or when none does."""
    if isinstance(choice, str):
        return choice
    return checkpoint_chat_template(*holders) if choice else None


def pad_token_id(tokenizer: Any, name: str) -> int:
    """The id padding uses: the tokenizer's pad token, else its eos token."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError(f"{name}: the tokenizer has neither a pad nor an eos token to pad batches with")
    return int(pad)


__all__ = [
    "ASSISTANT_ROLES",
    "DEFAULT_SYSTEM",
    "IMAGE_PLACEHOLDER",
    "NO_LIMIT",
    "TRUNCATION",
    "USER_ROLES",
    "VIDEO_PLACEHOLDER",
    "Encoded",
    "TemplatePreprocessor",
    "chosen_template",
    "counting_identity",
    "mark_video",
    "pad_token_id",
    "text_ids",
]
