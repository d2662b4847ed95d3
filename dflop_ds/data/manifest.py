"""The plain shape manifest: JSONL, one sample's numbers per line.

Each line is an object::

    {"id": "coco-397133-0", "images": [[640, 427]], "video_frames": 0,
     "text_tokens": 25, "label_tokens": 12, "source": "coco"}

``id`` and ``text_tokens`` are required; ``images`` (``[[width, height], ...]``),
``video_frames`` (frames of the source video), ``label_tokens`` (defaults to ``text_tokens``)
and ``source`` are optional. Instead of ``text_tokens`` a line may give ``"text": str``, counted
by the policy's tokenizer. Other keys are ignored.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dflop_ds.data.errors import DataError, PathArg
from dflop_ds.data.fields import MAX_TEXT_TOKENS, MAX_VIDEO_FRAMES, FieldProblems, type_name
from dflop_ds.data.records import ReadResult, load_records, read_records
from dflop_ds.shapes import DEFAULT_POLICY, SampleShape, ShapePolicy

MANIFEST_KEYS = ("id", "images", "video_frames", "text_tokens", "label_tokens", "source")


def is_manifest_record(record: Any) -> bool:
    """True when ``record`` looks like a manifest line (text counts, no conversations)."""
    return (
        isinstance(record, Mapping) and "conversations" not in record and ("text_tokens" in record or "text" in record)
    )


def parse_manifest_record(
    record: Mapping[str, Any], problems: FieldProblems, policy: ShapePolicy
) -> SampleShape | None:
    """The :class:`SampleShape` of one manifest record; problems go to ``problems``."""
    sample_id = problems.sample_id(record)
    sizes = _parse_images(record, problems)
    frames = problems.int_field(record, "video_frames", default=0, maximum=MAX_VIDEO_FRAMES)
    text_tokens = _parse_text_tokens(record, problems, policy)
    labels = problems.int_field(
        record, "label_tokens", default=text_tokens if text_tokens is not None else 0, maximum=MAX_TEXT_TOKENS
    )
    if "label_tokens" in record and labels is not None and text_tokens is not None and labels > text_tokens:
        problems.add("label_tokens", f"must be <= text_tokens ({text_tokens}), got {labels}")
    if labels == 0 and text_tokens is not None:
        problems.add("label_tokens", "is 0 (or text_tokens is 0 and no label_tokens given): nothing to learn")
    if "source" in record:
        problems.str_field(record, "source")
    if problems or sample_id is None or sizes is None or frames is None or text_tokens is None or labels is None:
        return None
    return policy.shape(sample_id, image_sizes=sizes, video_frames=frames, text_tokens=text_tokens, label_tokens=labels)


def _parse_images(record: Mapping[str, Any], problems: FieldProblems) -> list[tuple[int, int]] | None:
    value = record.get("images", [])
    if not isinstance(value, list):
        problems.add("images", f"must be a list of [width, height] pairs, got {type_name(value)}")
        return None
    checked = [problems.check_size(item, f"images[{i}]") for i, item in enumerate(value)]
    sizes = [size for size in checked if size is not None]
    return sizes if len(sizes) == len(checked) else None


def _parse_text_tokens(record: Mapping[str, Any], problems: FieldProblems, policy: ShapePolicy) -> int | None:
    if "text_tokens" in record and "text" in record:
        problems.add("text", "give either 'text_tokens' or 'text', not both")
        return None
    if "text" in record:
        text = record["text"]
        if not isinstance(text, str):
            problems.add("text", f"must be a string, got {type_name(text)}")
            return None
        return policy.count_tokens(text)
    if "text_tokens" not in record:
        problems.add("text_tokens", "is missing (give 'text_tokens' or 'text')")
        return None
    return problems.check_int(record["text_tokens"], "text_tokens", maximum=MAX_TEXT_TOKENS)


def read_manifest(path: PathArg, policy: ShapePolicy = DEFAULT_POLICY, *, on_bad_sample: str = "error") -> ReadResult:
    """Read a shape manifest into one :class:`SampleShape` per line, derived under ``policy``.

    Args:
        path: the JSONL manifest (a JSON array of the same objects also works).
        policy: tiling and token policy used to derive tiles and LLM tokens.
        on_bad_sample: ``"error"`` raises :class:`DataError` at the first bad record;
            ``"skip"`` drops bad records and reports them in ``result.report``.

    Returns:
        A :class:`ReadResult` (a list of shapes, in file order, with ``.report``).
    """
    return read_records(
        path,
        load_records(path),
        lambda record, problems: parse_manifest_record(record, problems, policy),
        on_bad_sample=on_bad_sample,
    )


def manifest_record(shape: SampleShape | Mapping[str, Any], source: str | None = None) -> dict[str, Any]:
    """The manifest object of a shape (or a dict already in manifest form), compactly.

    Zero ``video_frames``, empty ``images`` and ``label_tokens == text_tokens`` are left out.
    """
    if isinstance(shape, SampleShape):
        record: dict[str, Any] = {"id": shape.sample_id}
        if shape.image_sizes:
            record["images"] = [list(size) for size in shape.image_sizes]
        if shape.video_frames:
            record["video_frames"] = shape.video_frames
        record["text_tokens"] = shape.text_tokens
        if shape.label_tokens != shape.text_tokens:
            record["label_tokens"] = shape.label_tokens
    else:
        record = {key: shape[key] for key in MANIFEST_KEYS if key in shape}
        if "images" in record:
            record["images"] = [list(size) for size in record["images"]]
    if source is not None:
        record["source"] = source
    return record


def write_manifest(
    path: PathArg, records: Iterable[SampleShape | Mapping[str, Any]], *, source: str | None = None
) -> int:
    """Write ``records`` (shapes or manifest dicts) as a JSONL manifest; returns the line count.

    Every record is checked as :func:`read_manifest` would check it before anything is
    written, so a manifest that writes also reads. ``source`` tags every line.
    """
    lines = []
    seen: set[str] = set()
    for index, item in enumerate(records):
        record = manifest_record(item, source)
        problems = FieldProblems()
        parse_manifest_record(record, problems, DEFAULT_POLICY)
        if not problems and record["id"] in seen:
            problems.add("id", "duplicate id")
        if problems:
            field_name, message = problems.items[0]
            raise DataError(
                message, path=path, record=index, record_kind="index", sample_id=str(record.get("id")), field=field_name
            )
        seen.add(record["id"])
        lines.append(json.dumps(record, separators=(", ", ": ")))
    Path(path).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return len(lines)


__all__ = ["read_manifest", "write_manifest", "manifest_record", "parse_manifest_record", "is_manifest_record"]
