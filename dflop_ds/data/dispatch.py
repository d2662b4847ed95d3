"""Tell a shape manifest from a LLaVA file by content, and read either.

Manifest records carry ``text_tokens`` or ``text`` and no ``conversations``; LLaVA records carry
``conversations``. The first record that is a JSON object decides.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from dflop_ds.data.errors import DataError, PathArg
from dflop_ds.data.llava import MediaLookup, parse_llava_record
from dflop_ds.data.manifest import is_manifest_record, parse_manifest_record
from dflop_ds.data.records import RawRecord, ReadResult, RecordParser, load_records, read_records
from dflop_ds.data.sizes import DEFAULT_FALLBACK_SIZE, Fallback, load_frame_table, load_size_table
from dflop_ds.shapes import ShapePolicy

MANIFEST = "manifest"
LLAVA = "llava"


def detect_format(records: Sequence[RawRecord], path: PathArg) -> str:
    """``"manifest"`` or ``"llava"``, judged by the first record that is a JSON object.

    Raises:
        DataError: no record is an object, or the first one fits neither format.
    """
    for raw in records:
        if isinstance(raw.value, Mapping):
            if "conversations" in raw.value:
                return LLAVA
            if is_manifest_record(raw.value):
                return MANIFEST
            raise DataError("cannot tell the format: the first record has neither 'conversations' "
                            "(LLaVA) nor 'text_tokens'/'text' (shape manifest)",
                            path=path, record=raw.number, record_kind=raw.kind)
    raise DataError("no JSON object records found", path=path)


def record_parser(fmt: str, policy: ShapePolicy, media: MediaLookup | None = None) -> RecordParser:
    """The per-record parser of format ``fmt`` (``media`` is used by LLaVA only)."""
    if fmt == LLAVA:
        lookup = media or MediaLookup()
        return lambda record, problems: parse_llava_record(record, problems, policy, lookup)
    if fmt == MANIFEST:
        return lambda record, problems: parse_manifest_record(record, problems, policy)
    raise ValueError(f"unknown dataset format {fmt!r} (expected {MANIFEST!r} or {LLAVA!r})")


def read_dataset(
    path: PathArg,
    policy: ShapePolicy = ShapePolicy(),
    *,
    image_sizes: PathArg | Mapping[str, Sequence[int]] | None = None,
    video_frames: PathArg | Mapping[str, int] | None = None,
    fallback_size: Fallback = DEFAULT_FALLBACK_SIZE,
    fallback_frames: int | None = None,
    on_bad_sample: str = "error",
) -> ReadResult:
    """Read a shape manifest or a LLaVA file, whichever ``path`` holds.

    The media options mean what they mean for :func:`~dflop_ds.data.llava.read_llava`; they are
    unused for manifests, which carry their own sizes.
    """
    records = load_records(path)
    fmt = detect_format(records, path)
    media = None
    if fmt == LLAVA:
        media = MediaLookup(load_size_table(image_sizes), load_frame_table(video_frames),
                            fallback_size, fallback_frames)
    return read_records(path, records, record_parser(fmt, policy, media), on_bad_sample=on_bad_sample)


__all__ = ["MANIFEST", "LLAVA", "detect_format", "record_parser", "read_dataset"]
