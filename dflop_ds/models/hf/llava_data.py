"""LLaVA JSON records -> the HF LLaVA microbatch contract (docs/architecture.md, "Microbatch tensor contract").

:class:`LlavaPreprocessor` wraps a model directory's ``LlavaProcessor`` (its image processor
and tokenizer) and owns the one conversation format, so that the shapes the sampler sees and
the tensors the dataset makes come from the same code and agree token for token:

* **Template**: the checkpoint's own ``chat_template`` (the processor's, else the tokenizer's)
  when it ships one (:mod:`~dflop_ds.models.hf.chat_template`: labels are the assistant turns'
  tokens; the system message is the template's own unless ``system`` is given). Otherwise the
  built-in LLaVA-v1 / Vicuna template::

      <bos>{system} USER: {human turn} ASSISTANT: {gpt turn}<eos>USER: ... ASSISTANT: ...<eos>

  Each piece is tokenized on its own (no special tokens added) and the pieces' ids are
  concatenated; ``<bos>`` is there when the tokenizer has one. Supervised (labels): every
  assistant answer and the ``<eos>`` after it. Roles: ``human``/``user`` and
  ``gpt``/``assistant`` (any case); any other role is a bad record.
* **Images**: each ``<image>`` placeholder in a human turn becomes ``image_seq_length`` copies of
  the image token (as ``LlavaProcessor`` expands it), so the features go where the prompt put
  them. A record with images but no placeholder gets ``<image>\\n`` per image prepended to its
  first human turn (as LLaVA does); other mismatches are bad records.
* **Length**: sequences longer than ``max_length`` (default: the tokenizer's
  ``model_max_length``) are bad records (``truncation="error"``, the default) or cut at
  ``max_length`` (``truncation="truncate"``, counted in ``truncated_samples``); a cut that
  would drop image tokens is always a bad record.

Only plain LLaVA (one tile per image) is handled here (LLaVA-OneVision has its own family,
:mod:`~dflop_ds.models.hf.llava_onevision_data`). transformers and PIL are imported lazily.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info

from dflop_ds.data.errors import DataError, PathArg
from dflop_ds.data.images import load_rgb
from dflop_ds.data.media import image_field, record_image_paths, recorded_size_source, size_mismatch
from dflop_ds.data.records import check_policy, load_records
from dflop_ds.data.video import decode_frames, sample_frame_indices
from dflop_ds.models.hf.chat_template import ModelChatTemplate, checkpoint_chat_template, encode_alike
from dflop_ds.models.hf.folder import check_model_folder
from dflop_ds.models.hf.llava_processor import load_processor
from dflop_ds.models.packing import join_rows
from dflop_ds.models.tiny_data import IGNORE_INDEX, microbatch_denominator
from dflop_ds.shapes import SampleShape, ShapePolicy, length_rule

logger = logging.getLogger(__name__)

TEMPLATE_NAME = "llava-v1"
DEFAULT_SYSTEM = (
    "A chat between a curious human and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the human's questions."
)
IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
USER_ROLES = frozenset({"human", "user"})
ASSISTANT_ROLES = frozenset({"gpt", "assistant"})
TRUNCATION = ("error", "truncate")
#: tokenizers without a real limit report a huge ``model_max_length``; above this it means none
NO_LIMIT = 10**8
#: processes whose stand-ins a dataset counts apart (the loading process and up to this many
#: minus one DataLoader workers; more workers share slots, and may then miss a count)
STAND_IN_SLOTS = 257


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


class LlavaPreprocessor:
    """A LLaVA processor's image processor and tokenizer plus the conversation template.

    Args:
        processor: a ``transformers.LlavaProcessor``.
        system: the system message (default: the checkpoint template's own; the built-in
            template's :data:`DEFAULT_SYSTEM`).
        max_length: longest sequence, image tokens included (default: ``model_max_length``).
        truncation: ``"error"`` (a longer sample is a bad record) or ``"truncate"``.
        name: the policy's name in messages (e.g. the model directory's name).
        chat_template: ``True``: the checkpoint's own template when it ships one, else the built-in
            one; ``False``: the built-in one; a string: that Jinja template.
    """

    #: the built-in template's name in the policy's identity
    template_name = TEMPLATE_NAME

    #: the video token (None: the family takes no videos)
    video_token_id: int | None = None

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
        builtin_system = DEFAULT_SYSTEM if self.system is None else self.system
        if self.chat_template is None:
            if self.eos_token_id is None:
                raise ValueError(f"{self.name}: the tokenizer has no eos token to end assistant turns with")
            self.system = builtin_system
        video_id = self.video_token_id
        #: whether the tokens are the built-in template's: none shipped, or one that tokenizes alike
        self.builtin_counts = self.chat_template is None or (
            self.eos_token_id is not None
            and encode_alike(
                partial(self.chat_template.encode, system=self.system),
                partial(self._llava_v1, system=builtin_system),
                self._image_block,
                None if video_id is None else partial(self._video_block, int(video_id)),
            )
        )
        self.counting_system = builtin_system if self.builtin_counts else self.system or ""

    @classmethod
    def from_pretrained(cls, model_dir: PathArg, **kwargs: Any) -> LlavaPreprocessor:
        """Load the processor of a ``save_pretrained`` directory (offline) and wrap it: its
        ``AutoProcessor``, else one built from its tokenizer and image processor, with the image
        token count checked against the model's config
        (:func:`dflop_ds.models.hf.llava_processor.load_processor`)."""
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

    # -- text ---------------------------------------------------------------------------
    def _ids(self, text: str) -> list[int]:
        return text_ids(self.tokenizer, text)

    def count_text(self, text: str) -> int:
        """Tokens of ``text`` alone (for shape manifests that carry raw text)."""
        return len(self._ids(text))

    def _normalize(
        self, turns: Sequence[tuple[str, str]], n_images: int, videos: bool = False
    ) -> list[tuple[str, str]]:
        """Turns with roles mapped to user/assistant and image placeholders matched to ``n_images``
        (``<video>`` placeholders are refused unless ``videos``: a family that takes videos places them)."""
        normalized, placeholders = [], 0
        for i, (role, value) in enumerate(turns):
            kind = "user" if role.lower() in USER_ROLES else "assistant" if role.lower() in ASSISTANT_ROLES else None
            if kind is None:
                raise ValueError(
                    f"conversations[{i}].from: unknown role {role!r} (expected human/user or gpt/assistant, any case)"
                )
            if VIDEO_PLACEHOLDER in value and not videos:
                raise ValueError(f"conversations[{i}].value: {VIDEO_PLACEHOLDER} is not supported by LLaVA models")
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
        return normalized

    def encode(self, turns: Sequence[tuple[str, str]], n_images: int) -> Encoded:
        """Token ids and supervision mask of a conversation of ``(role, value)`` turns with ``n_images``
        images of ``image_seq_length`` tokens each.

        Raises:
            ValueError: a bad role, placeholder mismatch or over-long sample, naming the field.
        """
        return self.encode_media(turns, [self.image_seq_length] * n_images)

    def encode_media(
        self, turns: Sequence[tuple[str, str]], image_tokens: Sequence[int], video_tokens: int | None = None
    ) -> Encoded:
        """Token ids and supervision mask of ``(role, value)`` turns under the template, whose
        images give ``image_tokens`` tokens each and whose one video (if any, placed by
        :func:`mark_video`) ``video_tokens``.

        Raises:
            ValueError: a bad role, placeholder mismatch or over-long sample, naming the field.
        """
        video_id = self.video_token_id
        if video_tokens is not None:
            if video_id is None:
                raise ValueError(f"{self.name}: the model takes no videos")
            turns = mark_video(turns, len(image_tokens))
        normalized = self._normalize(turns, len(image_tokens), videos=video_tokens is not None)
        images = [self._image_block(tokens) for tokens in image_tokens]
        video = None if video_tokens is None else self._video_block(int(video_id or 0), int(video_tokens))
        if self.chat_template is None:
            ids, supervised = self._llava_v1(normalized, images, video, system=self.system or "")
        else:
            ids, supervised = self.chat_template.encode(normalized, images, video, system=self.system)
        return self._fit(Encoded(ids, supervised, sum(image_tokens) + int(video_tokens or 0)))

    def _llava_v1(
        self, turns: Sequence[tuple[str, str]], images: Sequence[list[int]], video: list[int] | None, system: str
    ) -> tuple[list[int], list[bool]]:
        """``(input_ids, supervised)`` of normalized turns under the built-in LLaVA-v1 template with
        ``system``, each placeholder replaced by its image's (in order) or the video's block of ids."""
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

    # -- identity -----------------------------------------------------------------------
    def identity(self) -> str:
        """What fixes the token counts: template (the built-in one's name, also for a checkpoint's
        template that tokenizes alike; else the checkpoint's by digest), system message, tokenizer
        contents, image token, length rule."""
        template = self.template_name if self.builtin_counts else self.chat_template.identity  # type: ignore[union-attr]
        return counting_identity(
            template, self.counting_system, self.tokenizer, self.image_token_id, self.max_length, self.truncation
        )

    def policy(self) -> ShapePolicy:
        """The :class:`ShapePolicy` of this model's data: one tile per image of ``image_seq_length``
        tokens and exact conversation token counts (videos are not supported)."""
        _, height, width = self.pixel_shape
        return ShapePolicy(
            tile_size=max(height, width),
            max_tiles=1,
            add_thumbnail=False,
            tokens_per_tile=self.image_seq_length,
            max_frames=1,
            tokens_per_frame=1,
            tokenizer=self.count_text,
            name=self.name,
            tokenizer_id=self.identity(),
            conversation=self.count,
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


def _blank_image() -> Any:
    from PIL import Image

    return Image.new("RGB", (64, 48))


def llava_policy(model_dir: PathArg, *, max_length: int | None = None, truncation: str = "error") -> ShapePolicy:
    """The shape policy of a HuggingFace LLaVA ``save_pretrained`` directory's processor."""
    return LlavaPreprocessor.from_pretrained(model_dir, max_length=max_length, truncation=truncation).policy()


def supervised_targets(shape: SampleShape) -> int:
    """Targets (non -100 entries) :class:`LlavaDataset` makes for ``shape``: its ``label_tokens``
    (the sampler's ``label_tokens_fn`` for shapes of :meth:`LlavaPreprocessor.policy`)."""
    return shape.label_tokens


def load_llava_records(path: PathArg) -> dict[str, Mapping[str, Any]]:
    """The records of a LLaVA JSON/JSONL file by id (as a string); records without one are left out."""
    records = {}
    for raw in load_records(path):
        if isinstance(raw.value, Mapping) and isinstance(raw.value.get("id"), (str, int)):
            records[str(raw.value["id"])] = raw.value
    return records


@dataclass
class LlavaItem:
    """One sample: ``pixel_values [n_img, C, H, W]``, ``input_ids [L]``, shifted ``targets [L]``."""

    sample_id: str
    pixel_values: torch.Tensor
    input_ids: torch.Tensor
    targets: torch.Tensor
    pad_token_id: int
    loss_denominator: float | None = None


class LlavaDataset(Dataset):
    """The samples of ``shapes`` (made under ``preprocessor.policy()``) as contract tensors.

    A sample whose media cannot be loaded (a missing, truncated or corrupt file, an image over the
    pixel limit) is a :class:`~dflop_ds.data.errors.DataError` naming the record, the field and the
    file. With ``on_bad_sample="skip"`` it becomes a *stand-in* instead: the same tensor shapes,
    blank pixels, the same token ids and no targets, logged by name and counted
    (:attr:`stand_in_count`). The schedule was built before any file was decoded, so dropping the
    sample here would leave this rank a microbatch short of the others and desynchronise every
    collective; the stand-in keeps all ranks in lockstep and leaves every other sample trained
    exactly once. It has no loss term of its own, but its ``d`` label tokens stay in the loss
    denominator ``D`` the schedule fixed for its global batch, so that step's loss and gradient
    are those of the other samples scaled by ``(D - d) / D``.

    Args:
        shapes: one shape per sample, in dataset order (e.g. ``read_dataset(...)[:n]``).
        records: the raw records by id (:func:`load_llava_records`).
        preprocessor: the model directory's :class:`LlavaPreprocessor`.
        image_folder: folder the records' image paths are relative to.
        source: the data file, for messages.
        video_folder: folder the records' video paths are relative to (families that take videos).
        on_bad_sample: ``"error"`` (default): a sample whose media fail to load raises;
            ``"skip"``: it is trained as a stand-in (above) and counted in :attr:`stand_in_count`.
    """

    #: whether the family's model takes videos (LLaVA does not: such samples are refused by name)
    supports_video = False
    #: whether an image's size changes the sample's tokens, so a recorded size must match the file
    #: (plain LLaVA resizes every image to one tile: a wrong recorded size changes nothing)
    size_sets_tokens = False

    def __init__(
        self,
        shapes: Sequence[SampleShape],
        records: Mapping[str, Mapping[str, Any]],
        preprocessor: LlavaPreprocessor,
        image_folder: PathArg | None,
        *,
        source: PathArg | None = None,
        video_folder: PathArg | None = None,
        on_bad_sample: str = "error",
    ) -> None:
        check_policy(on_bad_sample)
        self.shapes = list(shapes)
        self.records = records
        self.preprocessor = preprocessor
        self.image_folder = None if image_folder is None else Path(image_folder)
        self.video_folder = None if video_folder is None else Path(video_folder)
        self.source = source
        self.on_bad_sample = on_bad_sample
        # stand-ins made per process, in shared memory so that the training process reads what its
        # DataLoader workers made: slot 0 for the process itself, slot 1 + k for worker k (one writer each)
        self._stand_ins = torch.zeros(STAND_IN_SLOTS, dtype=torch.long).share_memory_()
        for shape in self.shapes:
            if shape.sample_id not in records:
                raise self._error(shape.sample_id, None, "no record with this id in the records given")
            if shape.video_frames and not self.supports_video:
                raise self._error(shape.sample_id, "video", "videos are not supported by LLaVA models")
            if shape.image_sizes and self.image_folder is None:
                raise self._error(shape.sample_id, "image", "the sample has images but no image_folder was given")
            if shape.video_frames and self.video_folder is None:
                raise self._error(shape.sample_id, "video", "the sample has a video but no video_folder was given")

    @property
    def stand_in_count(self) -> int:
        """Stand-ins made so far by this dataset in this process and its DataLoader workers
        (prefetched ones not yet trained included)."""
        return int(self._stand_ins.sum())

    def _error(self, sample_id: str, field: str | None, reason: str) -> DataError:
        return DataError(reason, path=self.source, sample_id=sample_id, field=field)

    def _tensors(self, shape: SampleShape, encode: Callable[[], Encoded]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, targets)`` of the sample of ``shape`` as ``encode()`` encodes it; a failed
        encoding, or one that disagrees with the shape, raises naming the sample."""
        try:
            return item_tensors(encode(), shape, self.preprocessor.name)
        except ValueError as exc:
            raise self._error(shape.sample_id, None, str(exc)) from exc

    def __len__(self) -> int:
        return len(self.shapes)

    def _load_images(self, shape: SampleShape) -> list:
        """The sample's images, decoded as 8-bit RGB; one that cannot be loaded, or (when
        :attr:`size_sets_tokens`) whose size is not the one its shape was made with, raises naming
        the record, the field and the file."""
        record = self.records[shape.sample_id]
        images = []
        for i, path in enumerate(record_image_paths(record)):
            full = os.path.abspath(os.path.join(self.image_folder, path))  # type: ignore[arg-type]
            field = image_field(record, i)
            try:
                image = load_rgb(full)
            except (OSError, ValueError) as exc:
                raise self._error(shape.sample_id, field, f"cannot load image {full}: {exc}") from exc
            if self.size_sets_tokens and tuple(image.size) != tuple(shape.image_sizes[i]):
                size_field, given_by = recorded_size_source(record, i)  # the error names where the size came from
                reason = size_mismatch(given_by, shape.image_sizes[i], path, full, image.size)
                raise self._error(shape.sample_id, size_field, reason)
            images.append(image)
        return images

    def _uniform_frames(self, shape: SampleShape, count: int) -> list:
        """``count`` frames sampled uniformly from the sample's video, decoded (PyAV); a video that
        cannot be loaded raises naming the record and the file."""
        path = self.records[shape.sample_id]["video"]
        full = os.path.abspath(os.path.join(self.video_folder, path))  # type: ignore[arg-type]
        try:
            return decode_frames(full, sample_frame_indices(shape.video_frames, count))
        except (OSError, ValueError) as exc:
            raise self._error(shape.sample_id, "video", f"cannot load video {full}: {exc}") from exc

    def _turns(self, shape: SampleShape) -> list[tuple[str, str]]:
        return [(turn["from"], turn["value"]) for turn in self.records[shape.sample_id]["conversations"]]

    def _shape(self, idx: Any) -> SampleShape:
        i = int(idx)
        if not 0 <= i < len(self.shapes):
            raise IndexError(f"{type(self).__name__} index {i} out of range [0, {len(self.shapes)})")
        return self.shapes[i]

    def _item(self, shape: SampleShape, blank: bool) -> LlavaItem:
        """The sample of ``shape`` with its media loaded, or (``blank``) with blank pixels of the same shape."""
        n_images = len(shape.image_sizes)
        ids, targets = self._tensors(shape, lambda: self.preprocessor.encode(self._turns(shape), n_images))
        if blank:
            pixels = torch.zeros((n_images, *self.preprocessor.pixel_shape), dtype=torch.float32)
        else:
            pixels = self.preprocessor.pixel_values(self._load_images(shape))
        return LlavaItem(shape.sample_id, pixels, ids, targets, self.preprocessor.pad_token_id)

    def _stand_in(self, shape: SampleShape, error: DataError) -> LlavaItem:
        """The stand-in of a sample whose media failed with ``error`` (re-raised when the sample's
        text cannot be encoded either)."""
        try:
            item = self._item(shape, blank=True)
        except (DataError, ValueError):
            raise error from None
        item.targets = torch.full_like(item.targets, IGNORE_INDEX)
        worker = get_worker_info()
        self._stand_ins[0 if worker is None else 1 + worker.id % (STAND_IN_SLOTS - 1)] += 1
        logger.warning(
            "%s; on_bad_sample=skip: trained as a stand-in with blank media and no targets (its labels stay in"
            " the step's loss denominator)",
            error,
        )
        return item

    def __getitem__(self, idx: Any) -> LlavaItem:
        """The sample at ``idx`` (an ``int`` or a ``ScheduledIndex``, whose denominator is kept)."""
        shape = self._shape(idx)
        try:
            item = self._item(shape, blank=False)
        except DataError as error:
            if self.on_bad_sample != "skip":
                raise
            item = self._stand_in(shape, error)
        item.loss_denominator = scheduled_denominator(idx)
        return item


def scheduled_denominator(idx: Any) -> float | None:
    """The loss denominator a ``ScheduledIndex`` carries, or None for a plain index."""
    denominator = getattr(idx, "loss_denominator", None)
    return None if denominator is None else float(denominator)


def item_tensors(encoded: Encoded, shape: SampleShape, policy_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, targets)`` of an encoded sample, targets already shifted (-100 where nothing is
    predicted); raises ``ValueError`` when the encoding disagrees with the sample's shape (the
    shapes were made under another policy, so the sampler's loss denominator would be wrong)."""
    if len(encoded.input_ids) != shape.llm_tokens or encoded.label_count != shape.label_tokens:
        raise ValueError(
            f"encodes to {len(encoded.input_ids)} tokens with {encoded.label_count} targets, but its shape "
            f"says {shape.llm_tokens} and {shape.label_tokens}: the shapes were made under another policy "
            f"than {policy_name!r}"
        )
    ids = torch.tensor(encoded.input_ids, dtype=torch.long)
    targets = torch.full_like(ids, IGNORE_INDEX)
    supervised = torch.tensor(encoded.supervised[1:], dtype=torch.bool)
    targets[:-1][supervised] = ids[1:][supervised]
    return ids, targets


def collate_llava(
    items: Sequence[LlavaItem], packed: bool = False
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, torch.Tensor]]:
    """One microbatch as the contract's ``((pixel_values, input_ids, seq_lens), (targets, loss_denominator))``.

    ``input_ids`` are right-padded with the tokenizer's pad id, ``targets`` with -100; with
    ``packed`` both are one row ``[1, sum(seq_lens)]`` of the samples one after another
    (:mod:`dflop_ds.models.packing`). The denominator is the scheduled one, or the microbatch's
    own target count for plain indices.
    """
    if not items:
        raise ValueError("collate_llava: empty microbatch")
    pads = {item.pad_token_id for item in items}
    if len(pads) > 1:
        raise ValueError(f"collate_llava: items of different tokenizers (pad ids {sorted(pads)})")
    seq_lens = torch.tensor([item.input_ids.numel() for item in items], dtype=torch.long)
    input_ids = join_rows([item.input_ids for item in items], pads.pop(), packed)
    targets = join_rows([item.targets for item in items], IGNORE_INDEX, packed)
    pixel_values = torch.cat([item.pixel_values for item in items], dim=0)
    denominator = torch.tensor(microbatch_denominator(items), dtype=torch.float64)
    return (pixel_values, input_ids, seq_lens), (targets, denominator)


def collate_packed_llava(
    items: Sequence[LlavaItem],
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, torch.Tensor]]:
    """:func:`collate_llava` with ``packed=True`` (a picklable collate for DataLoader workers)."""
    return collate_llava(items, packed=True)


__all__ = [
    "DEFAULT_SYSTEM",
    "Encoded",
    "LlavaPreprocessor",
    "llava_policy",
    "supervised_targets",
    "load_llava_records",
    "LlavaItem",
    "LlavaDataset",
    "collate_llava",
    "collate_packed_llava",
]
