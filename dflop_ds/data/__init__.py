"""dflop_ds.data: dataset readers (shape manifests, LLaVA conversations) and validation.

:func:`read_dataset` picks the reader from the file's content: manifest records carry
``text_tokens`` or ``text`` and no ``conversations``; LLaVA records carry ``conversations``.
"""

from __future__ import annotations

from typing import Any

from dflop_ds.data.errors import DataError, PathArg
from dflop_ds.data.llava import read_llava
from dflop_ds.data.manifest import is_manifest_record, read_manifest, write_manifest
from dflop_ds.data.records import RawRecord, ReadReport, ReadResult, load_records
from dflop_ds.data.sizes import DEFAULT_FALLBACK_SIZE, SizeDraw, load_frame_table, load_size_table
from dflop_ds.shapes import ShapePolicy

MANIFEST = "manifest"
LLAVA = "llava"
LLAVA_OPTIONS = ("image_sizes", "video_frames", "fallback_size", "fallback_frames")


def detect_format(records: list[RawRecord], path: PathArg) -> str:
    """``"manifest"`` or ``"llava"``, judged by the first record that is a JSON object.

    Raises:
        DataError: no record is an object, or the first one fits neither format.
    """
    for raw in records:
        if isinstance(raw.value, dict):
            if "conversations" in raw.value:
                return LLAVA
            if is_manifest_record(raw.value):
                return MANIFEST
            raise DataError("cannot tell the format: the first record has neither 'conversations' "
                            "(LLaVA) nor 'text_tokens'/'text' (shape manifest)",
                            path=path, record=raw.number, record_kind=raw.kind)
    raise DataError("no JSON object records found", path=path)


def read_dataset(path: PathArg, policy: ShapePolicy = ShapePolicy(), **kw: Any) -> ReadResult:
    """Read a shape manifest or a LLaVA file, whichever ``path`` holds.

    Keyword arguments go to :func:`read_manifest` or :func:`read_llava`; the LLaVA-only
    options (``image_sizes``, ``video_frames``, ``fallback_size``, ``fallback_frames``) are
    ignored for manifests, which carry their sizes.
    """
    fmt = detect_format(load_records(path), path)
    if fmt == LLAVA:
        return read_llava(path, policy, **kw)
    return read_manifest(path, policy, **{k: v for k, v in kw.items() if k not in LLAVA_OPTIONS})


__all__ = [
    "DataError", "ReadReport", "ReadResult", "SizeDraw", "DEFAULT_FALLBACK_SIZE",
    "read_dataset", "read_manifest", "write_manifest", "read_llava", "detect_format",
    "load_size_table", "load_frame_table",
]
