"""dflop_ds.data: dataset readers (shape manifests, LLaVA conversations) and validation.

:func:`read_dataset` picks the reader from the file's content: manifest records carry
``text_tokens`` or ``text`` and no ``conversations``; LLaVA records carry ``conversations``.
"""

from dflop_ds.data.errors import DataError
from dflop_ds.data.formats import detect_format, read_dataset, read_llava
from dflop_ds.data.manifest import read_manifest, write_manifest
from dflop_ds.data.media import MediaOptions
from dflop_ds.data.records import ReadReport, ReadResult
from dflop_ds.data.sizes import DEFAULT_FALLBACK_SIZE, SizeDraw, load_frame_table, load_size_table
from dflop_ds.data.validate import Problem, format_problems, validate_dataset

__all__ = [
    "DataError",
    "MediaOptions",
    "ReadReport",
    "ReadResult",
    "SizeDraw",
    "DEFAULT_FALLBACK_SIZE",
    "read_dataset",
    "read_manifest",
    "write_manifest",
    "read_llava",
    "detect_format",
    "load_size_table",
    "load_frame_table",
    "Problem",
    "format_problems",
    "validate_dataset",
]
