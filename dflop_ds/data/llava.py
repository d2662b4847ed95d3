"""LLaVA-style conversation datasets (JSON array or JSONL) -> sample shapes.

A record::

    {"id": "5", "image": "5/image.png",            # or a list of paths, or absent
     "video": "clips/v1.mp4",                        # optional
     "conversations": [{"from": "human", "value": "<image>\\nWhat is shown?"},
                       {"from": "gpt", "value": "A parachute."}]}

Text tokens are the tokens of every turn's value with the ``<image>``/``<video>`` placeholders
removed, counted turn by turn with the policy's tokenizer; label tokens are those of the
assistant turns (``from`` = ``gpt`` or ``assistant``). A record that counts no label token (no
answer turn, empty answers, or every answer cut by truncation) has nothing to learn: a bad record.

Image sizes are looked up, in this order: in the record (``width``/``height`` for a single
image, or ``image_sizes: [[w, h], ...]`` with one pair per image); in the ``image_sizes`` side
table (image path -> ``[w, h]``); in the image file's header under ``image_folder`` (cached
beside the data file); then, only without an ``image_folder`` and only when asked for, the
``fallback_size`` (a fixed size or a seeded :class:`~dflop_ds.data.sizes.SizeDraw`). A size
found nowhere is a bad record. Video frame counts come from the record (``video_frames`` or
``frame_count``), the ``video_frames`` side table (video path -> frames), then
the video file's container under ``video_folder``, then ``fallback_frames`` (default ``None``:
an error). See :mod:`dflop_ds.data.media`. As in LLaVA-Video's data, a record with a video and no
images may mark the video with one ``<image>`` placeholder instead of ``<video>``.

A policy with a ``conversation`` counter (a real model's chat template, see
:mod:`dflop_ds.models.hf.base.template`) counts the tokens of the templated conversation itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dflop_ds.data.fields import MAX_VIDEO_FRAMES, FieldProblems, type_name
from dflop_ds.data.media import MediaLookup
from dflop_ds.data.video import VideoInfo
from dflop_ds.shapes import SampleShape, ShapePolicy

#: Roles of LLaVA / ShareGPT conversations, compared case-insensitively ("Human", "GPT" too): the
#: user's, the assistant's, and the system message's (a conversation's first turn)
USER_ROLES = frozenset({"human", "user"})
ASSISTANT_ROLES = frozenset({"gpt", "assistant"})
SYSTEM_ROLE = "system"
KNOWN_ROLES = USER_ROLES | ASSISTANT_ROLES | {SYSTEM_ROLE}
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


def no_labels_reason(turns: Sequence[tuple[str, str]]) -> str:
    """Why a conversation that counts 0 label tokens has nothing to learn (for its bad-record message)."""
    answers = [value for role, value in turns if role.lower() in ASSISTANT_ROLES]
    if not answers:
        why = "has no assistant turn (from gpt/assistant)"
    elif not any(strip_placeholders(value) for value in answers):
        why = "has only empty assistant turns"
    else:
        why = "keeps no answer token (every one cut by truncation at max_length, or none counted)"
    return f"{why}: 0 label tokens, nothing to learn (the sample would train at loss 0)"


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
            problems.add(
                f"{name}.from",
                f"unknown role {role!r}: expected human/user, gpt/assistant or system"
                " (any case); answers of an unknown role would get no labels",
            )
        elif isinstance(role, str) and isinstance(value, str):
            turns.append((role, value))
    if len(turns) != len(turns_value):
        return None
    _check_answers(turns, problems)
    return turns


def _check_answers(turns: Sequence[tuple[str, str]], problems: FieldProblems) -> None:
    """Flag an assistant turn of whitespace only beside answers that have text (a chat template
    would supervise its end-of-turn token alone; a conversation whose every answer is empty is
    :func:`no_labels_reason`'s) and a conversation whose last turn is a question no answer follows."""
    answered = any(value.strip() for role, value in turns if role.lower() in ASSISTANT_ROLES)
    for i, (role, value) in enumerate(turns):
        if answered and role.lower() in ASSISTANT_ROLES and value and not value.strip():
            problems.add(
                f"conversations[{i}].value",
                "is an answer of whitespace only: its end-of-turn token would be its only label;"
                " give the answer or drop the turn",
            )
    last_role = turns[-1][0].lower()
    if last_role not in ASSISTANT_ROLES and any(role.lower() in ASSISTANT_ROLES for role, _ in turns):
        problems.add(
            f"conversations[{len(turns) - 1}]",
            f"the conversation ends with a {last_role} turn no answer follows: drop it or add the answer",
        )


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


def _resolve_images(
    record: Mapping[str, Any], problems: FieldProblems, media: MediaLookup
) -> list[tuple[int, int]] | None:
    before = len(problems.items)
    paths = _parse_image_paths(record, problems)
    if paths is None:
        return None
    given = _record_sizes(record, len(paths), problems)
    if given is None or len(problems.items) > before:
        return None
    sizes = []
    for i, (path, size) in enumerate(zip(paths, given)):
        found = media.image_size(path, size)
        if isinstance(found, str):
            problems.add("image" if isinstance(record["image"], str) else f"image[{i}]", found)
        else:
            sizes.append(found)
    return sizes if len(sizes) == len(paths) else None


def _resolve_video(
    record: Mapping[str, Any], problems: FieldProblems, media: MediaLookup, need_info: bool
) -> tuple[int, VideoInfo | None] | None:
    """``(frames, container facts or None)`` of the record's video (``(0, None)`` without one)."""
    video = record.get("video")
    if "video" in record and (not isinstance(video, str) or not video):
        problems.add("video", f"must be a non-empty path string, got {type_name(video)} {video!r}")
        return None
    given, given_by = None, "the record"
    for key in FRAME_KEYS:
        if key in record:
            given = problems.check_int(record[key], key, minimum=1, maximum=MAX_VIDEO_FRAMES)
            if given is None:
                return None
            given_by = f"the record's {key!r}"
            break
    if video is None:
        return given or 0, None
    found = media.video(video, given, need_info=need_info, given_by=given_by)
    if isinstance(found, str):
        problems.add("video", found)
        return None
    return found


def parse_llava_record(
    record: Mapping[str, Any], problems: FieldProblems, policy: ShapePolicy, media: MediaLookup
) -> SampleShape | None:
    """The :class:`SampleShape` of one LLaVA record; problems go to ``problems``."""
    sample_id = problems.sample_id(record, allow_int=True)
    turns = _parse_conversations(record, problems)
    sizes = _resolve_images(record, problems, media)
    video = _resolve_video(record, problems, media, policy.video_rule is not None)
    if turns is not None and sizes is not None:
        placeholders = sum(value.count("<image>") for _, value in turns)
        if placeholders > len(sizes) and not (video and video[0] and not sizes and placeholders == 1):
            problems.add(
                "conversations",
                f"has {placeholders} <image> placeholder(s) but the record has {len(sizes)} image(s) (field 'image')",
            )
    if problems or sample_id is None or turns is None or sizes is None or video is None:
        return None
    frames, info = video
    size, fps = (None, None) if info is None else ((info.width, info.height), info.fps)
    if policy.conversation is not None:
        image_tokens = [tokens for _, tokens in policy.images_units(sizes)]
        video_tokens = policy.video_units(sample_id, frames, size, fps)[1] if frames else None
        text_tokens, label_tokens = policy.conversation(turns, image_tokens, video_tokens)
    else:
        text_tokens, label_tokens = conversation_tokens(turns, policy)
    if label_tokens == 0:
        problems.add("conversations", no_labels_reason(turns))
        return None
    return policy.shape(
        sample_id,
        image_sizes=sizes,
        video_frames=frames,
        text_tokens=text_tokens,
        label_tokens=label_tokens,
        video_size=size,
        video_fps=fps,
    )
