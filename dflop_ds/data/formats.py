"""Tell a shape manifest from a LLaVA file by content, and read either.

Manifest records carry ``text_tokens`` or ``text`` and no ``conversations``; LLaVA records carry
``conversations``. The first record that is a JSON object decides.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dflop_ds.data.errors import DataError, PathArg
from dflop_ds.data.llava import parse_llava_record
from dflop_ds.data.manifest import is_manifest_record, parse_manifest_record
from dflop_ds.data.media import MediaLookup, MediaOptions, media_folder, media_lookup
from dflop_ds.data.records import RawRecord, ReadResult, RecordParser, load_records, read_records
from dflop_ds.shapes import DEFAULT_POLICY, ShapePolicy

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
            raise DataError(
                "cannot tell the format: the first record has neither 'conversations' "
                "(LLaVA) nor 'text_tokens'/'text' (shape manifest)",
                path=path,
                record=raw.number,
                record_kind=raw.kind,
            )
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
    policy: ShapePolicy = DEFAULT_POLICY,
    *,
    on_bad_sample: str = "error",
    fmt: str | None = None,
    warn: bool = True,
    **media: Any,
) -> ReadResult:
    """Read a shape manifest or a LLaVA file into sample shapes: the one way every command reads data.

    ``validate``, ``profile data``, ``plan`` and training all come here with the same options
    (``dflop_ds.commands.data.read_options`` turns the command-line flags into them).

    Args:
        path: the dataset file (JSON array or JSONL).
        policy: the shape policy (tiling, tokens per image, token counting).
        on_bad_sample: ``"error"`` (raise :class:`DataError` at the first bad record) or
            ``"skip"`` (drop bad records, keep their problems in ``result.report``).
        fmt: ``"llava"`` or ``"manifest"`` to insist on a format (default: told by content).
        warn: log a warning with the count of skipped records.
        **media: where media sizes and frame counts come from, the fields of
            :class:`~dflop_ds.data.media.MediaOptions` (``image_folder``, ``video_folder``,
            ``image_sizes``, ``video_frames``, ``fallback_size``, ``fallback_frames``); unused
            for manifests, which carry their own sizes. There is no default size: an image
            whose size is found nowhere is a bad record.

    Raises:
        DataError: the file or a side table cannot be read, the format cannot be told, or
            (under ``"error"``) a record is bad, named by file, record, id and field.
        TypeError: an unknown media option.
    """
    options = MediaOptions(**media)
    records = load_records(path)
    return read_loaded(
        path,
        records,
        policy,
        fmt=fmt or detect_format(records, path),
        media=options,
        on_bad_sample=on_bad_sample,
        warn=warn,
    )


def read_llava(
    path: PathArg,
    policy: ShapePolicy = DEFAULT_POLICY,
    *,
    on_bad_sample: str = "error",
    **media: Any,
) -> ReadResult:
    """Read a LLaVA-style JSON array or JSONL file into sample shapes (:func:`read_dataset` with the
    format fixed).

    Args:
        path: the dataset file.
        policy: tiling and token policy (its tokenizer counts the text).
        on_bad_sample: ``"error"`` (raise :class:`DataError`) or ``"skip"`` (drop and report).
        **media: where image sizes and frame counts come from: the fields of
            :class:`~dflop_ds.data.media.MediaOptions` (image/video folders, side tables and
            explicit fallbacks; an image of unknown size is a bad record).

    Returns:
        A :class:`ReadResult`: the shapes in file order, with ``.report``.
    """
    return read_dataset(path, policy, on_bad_sample=on_bad_sample, fmt=LLAVA, **media)


def read_loaded(
    path: PathArg,
    records: Sequence[RawRecord],
    policy: ShapePolicy,
    *,
    fmt: str,
    media: MediaOptions,
    on_bad_sample: str = "error",
    warn: bool = True,
) -> ReadResult:
    """:func:`read_dataset` on records already loaded from ``path`` in format ``fmt``."""
    lookup = media_lookup(path, records, media) if fmt == LLAVA else None
    try:
        return read_records(path, records, record_parser(fmt, policy, lookup), on_bad_sample=on_bad_sample, warn=warn)
    finally:
        if lookup is not None:
            lookup.save_cache()


def shape_reader(
    policy: ShapePolicy, image_folder: PathArg | None = None, video_folder: PathArg | None = None
) -> Callable[[PathArg, str], ReadResult]:
    """``read_shapes(path, on_bad_sample)``: :func:`read_dataset` under ``policy`` with media paths
    relative to ``image_folder`` / ``video_folder``, by default the data file's own folder
    (:func:`~dflop_ds.data.media.media_folder`): how a model source reads its training data."""

    def read_shapes(path: PathArg, on_bad_sample: str) -> ReadResult:
        return read_dataset(
            path,
            policy,
            on_bad_sample=on_bad_sample,
            image_folder=media_folder(path, image_folder),
            video_folder=media_folder(path, video_folder),
        )

    return read_shapes


__all__ = ["MANIFEST", "LLAVA", "detect_format", "record_parser", "read_dataset", "read_loaded", "shape_reader"]
