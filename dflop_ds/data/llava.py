"""LLaVA-style conversation datasets (JSON array or JSONL) -> sample shapes.

A record::

    {"id": "5", "image": "5/image.png",            # or a list of paths, or absent
     "video": "clips/v1.mp4",                        # optional
     "conversations": [{"from": "human", "value": "<image>\\nWhat is shown?"},
                       {"from": "gpt", "value": "A parachute."}]}

Text tokens are the tokens of every turn's value with the ``<image>``/``<video>`` placeholders
removed, counted turn by turn with the policy's tokenizer; label tokens are those of the
assistant turns (``from`` = ``gpt`` or ``assistant``).

Image sizes are looked up, in this order: in the record (``width``/``height`` for a single
image, or ``image_sizes: [[w, h], ...]`` with one pair per image); in the ``image_sizes`` side
table (image path -> ``[w, h]``); then the ``fallback_size`` (a fixed size, default
:data:`~dflop_ds.data.sizes.DEFAULT_FALLBACK_SIZE` = 640x480, or a seeded
:class:`~dflop_ds.data.sizes.SizeDraw`; ``None`` makes a missing size an error). Video frame
counts come from the record (``video_frames`` or ``frame_count``), the ``video_frames`` side
table (video path -> frames), then ``fallback_frames`` (default ``None``: an error).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from dflop_ds.data.checks import MAX_VIDEO_FRAMES, FieldProblems, type_name
from dflop_ds.data.errors import PathArg
from dflop_ds.data.records import ReadResult, load_records, read_records
from dflop_ds.data.sizes import (DEFAULT_FALLBACK_SIZE, Fallback, fallback_size_for, load_frame_table,
                                 load_size_table)
from dflop_ds.shapes import SampleShape, ShapePolicy

ASSISTANT_ROLES = frozenset({"gpt", "assistant"})
#: Roles of LLaVA / ShareGPT conversations, compared case-insensitively ("Human", "GPT" too).
KNOWN_ROLES = frozenset({"human", "user", "system"}) | ASSISTANT_ROLES
PLACEHOLDERS = ("<image>", "<video>")
FRAME_KEYS = ("video_frames", "frame_count")


def strip_placeholders(text: str) -> str:
    """``text`` without ``<image>``/``<video>`` placeholders and surrounding whitespace."""
    for placeholder in PLACEHOLDERS:
        text = text.replace(placeholder, "")
    return text.strip()


def conversation_tokens(turns: Sequence[tuple[str, str]], policy: ShapePolicy) -> tuple[int, int]:
    """``(text_tokens, label_tokens)`` of ``(role, value)`` turns under ``policy``'s tokenizer."""
    text = labels = 0
    for role, value in turns:
        tokens = policy.count_tokens(strip_placeholders(value)) if value else 0
        text += tokens
        if role.lower() in ASSISTANT_ROLES:
            labels += tokens
    return text, labels


@dataclass(frozen=True)
class MediaLookup:
    """Side tables and fallbacks for media sizes a record does not carry."""

    image_sizes: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    video_frames: Mapping[str, int] = field(default_factory=dict)
    fallback_size: Fallback = DEFAULT_FALLBACK_SIZE
    fallback_frames: int | None = None

    def image_size(self, path: str) -> tuple[int, int] | None:
        """Size of image ``path`` from the side table, else the fallback, else None."""
        if path in self.image_sizes:
            return self.image_sizes[path]
        return fallback_size_for(self.fallback_size, path)

    def frames(self, path: str | None) -> int | None:
        """Frame count of video ``path`` from the side table, else the fallback, else None."""
        if path is not None and path in self.video_frames:
            return self.video_frames[path]
        return self.fallback_frames


def _parse_conversations(record: Mapping[str, Any], problems: FieldProblems) -> list[tuple[str, str]] | None:
    turns_value = record.get("conversations")
    if "conversations" not in record:
        problems.add("conversations", "is missing")
        return None
    if not isinstance(turns_value, list) or not turns_value:
        problems.add("conversations", f"must be a non-empty list of turns, got {type_name(turns_value)}")
        return None
    turns: list[tuple[str, str]] = []
    for i, turn in enumerate(turns_value):
        name = f"conversations[{i}]"
        if not isinstance(turn, Mapping):
            problems.add(name, f"must be an object with 'from' and 'value', got {type_name(turn)}")
            continue
        role = turn.get("from")
        value = turn.get("value")
        if not isinstance(role, str):
            problems.add(f"{name}.from", f"must be a string, got {type_name(role)}")
        if not isinstance(value, str):
            problems.add(f"{name}.value", f"must be a string, got {type_name(value)}")
        if isinstance(role, str) and role.lower() not in KNOWN_ROLES:
            problems.add(f"{name}.from", f"unknown role {role!r}: expected human/user, gpt/assistant or system"
                                         " (any case); answers of an unknown role would get no labels")
        elif isinstance(role, str) and isinstance(value, str):
            turns.append((role, value))
    return None if len(turns) != len(turns_value) else turns


def _parse_image_paths(record: Mapping[str, Any], problems: FieldProblems) -> list[str] | None:
    if "image" not in record:
        return []
    value = record["image"]
    if isinstance(value, str) and value:
        return [value]
    if isinstance(value, list) and value:
        bad = [i for i, item in enumerate(value) if not isinstance(item, str) or not item]
        for i in bad:
            problems.add(f"image[{i}]", f"must be a non-empty path string, got {value[i]!r}")
        return None if bad else list(value)
    problems.add("image", f"must be a path or a non-empty list of paths, got {type_name(value)} {value!r}")
    return None


def _record_sizes(record: Mapping[str, Any], n_images: int, problems: FieldProblems) -> list | None:
    """Sizes the record gives for its images (None entries where it gives none)."""
    if "image_sizes" in record:
        value = record["image_sizes"]
        if not isinstance(value, list) or len(value) != n_images:
            problems.add("image_sizes", f"must list one [width, height] per image ({n_images}), got {value!r}")
            return [None] * n_images
        return [problems.check_size(size, f"image_sizes[{i}]") for i, size in enumerate(value)]
    if "width" in record or "height" in record:
        if n_images != 1:
            problems.add("width", f"'width'/'height' describe a single image, but the record has {n_images}")
            return [None] * n_images
        return [problems.check_size([record.get("width"), record.get("height")], "width/height")]
    return [None] * n_images


def _resolve_images(record: Mapping[str, Any], problems: FieldProblems,
                    media: MediaLookup) -> list[tuple[int, int]] | None:
    before = len(problems.items)
    paths = _parse_image_paths(record, problems)
    if paths is None:
        return None
    given = _record_sizes(record, len(paths), problems)
    if len(problems.items) > before:
        return None
    sizes = []
    for i, (path, size) in enumerate(zip(paths, given)):
        size = size or media.image_size(path)
        if size is None:
            name = "image" if isinstance(record["image"], str) else f"image[{i}]"
            problems.add(name, f"no size for image {path!r}: not in the record, not in the image_sizes "
                               "table, and no fallback_size")
        sizes.append(size)
    return None if None in sizes else sizes


def _resolve_frames(record: Mapping[str, Any], problems: FieldProblems, media: MediaLookup) -> int | None:
    video = record.get("video")
    if "video" in record and (not isinstance(video, str) or not video):
        problems.add("video", f"must be a non-empty path string, got {type_name(video)} {video!r}")
        return None
    for key in FRAME_KEYS:
        if key in record:
            return problems.check_int(record[key], key, minimum=1, maximum=MAX_VIDEO_FRAMES)
    if video is None:
        return 0
    frames = media.frames(video)
    if frames is None:
        problems.add("video", f"no frame count for video {video!r}: not in the record ('video_frames'/"
                              "'frame_count'), not in the video_frames table, and no fallback_frames")
    return frames


def parse_llava_record(record: Mapping[str, Any], problems: FieldProblems, policy: ShapePolicy,
                       media: MediaLookup) -> SampleShape | None:
    """The :class:`SampleShape` of one LLaVA record; problems go to ``problems``."""
    sample_id = problems.sample_id(record, allow_int=True)
    turns = _parse_conversations(record, problems)
    sizes = _resolve_images(record, problems, media)
    frames = _resolve_frames(record, problems, media)
    if turns is not None and sizes is not None:
        placeholders = sum(value.count("<image>") for _, value in turns)
        if placeholders > len(sizes):
            problems.add("conversations", f"has {placeholders} <image> placeholder(s) but the record has"
                                          f" {len(sizes)} image(s) (field 'image')")
    if problems or sample_id is None or turns is None or sizes is None or frames is None:
        return None
    text_tokens, label_tokens = conversation_tokens(turns, policy)
    return policy.shape(sample_id, image_sizes=sizes, video_frames=frames,
                        text_tokens=text_tokens, label_tokens=label_tokens)


def read_llava(
    path: PathArg,
    policy: ShapePolicy = ShapePolicy(),
    *,
    image_sizes: PathArg | Mapping[str, Sequence[int]] | None = None,
    video_frames: PathArg | Mapping[str, int] | None = None,
    fallback_size: Fallback = DEFAULT_FALLBACK_SIZE,
    fallback_frames: int | None = None,
    on_bad_sample: str = "error",
) -> ReadResult:
    """Read a LLaVA-style JSON array or JSONL file into sample shapes.

    Args:
        path: the dataset file.
        policy: tiling and token policy (its tokenizer counts the text).
        image_sizes: side table, a JSON file or a dict mapping image path -> ``[w, h]``.
        video_frames: side table, a JSON file or a dict mapping video path -> frame count.
        fallback_size: size of images found nowhere else: ``(w, h)``, a :class:`SizeDraw`,
            or ``None`` to treat a missing size as a bad record.
        fallback_frames: frame count of videos found nowhere else (``None``: bad record).
        on_bad_sample: ``"error"`` (raise :class:`DataError`) or ``"skip"`` (drop and report).

    Returns:
        A :class:`ReadResult`: the shapes in file order, with ``.report``.
    """
    media = MediaLookup(load_size_table(image_sizes), load_frame_table(video_frames),
                        fallback_size, fallback_frames)
    return read_records(path, load_records(path),
                        lambda record, problems: parse_llava_record(record, problems, policy, media),
                        on_bad_sample=on_bad_sample)
