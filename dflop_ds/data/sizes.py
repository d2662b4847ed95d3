"""Where image sizes and video frame counts come from when a record does not carry them.

* Side tables: JSON objects mapping a media path (as written in the record) to ``[w, h]``
  (images) or to a frame count (videos). Load them with :func:`load_size_table` /
  :func:`load_frame_table`, or pass the path straight to the readers.
* Fallbacks for images with no known size, used only when passed explicitly: a fixed size
  (e.g. ``DEFAULT_FALLBACK_SIZE``) or a :class:`SizeDraw`, a seeded draw from a list of real
  sizes that gives each image path the same size on every read, whatever the record order.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dflop_ds.data.errors import DataError, PathArg
from dflop_ds.data.fields import MAX_VIDEO_FRAMES, FieldProblems, type_name

#: A fixed size to pass as ``fallback_size`` when you want one: 640x480, the most common MS-COCO
#: size. The readers never use it unless it is passed (an image of unknown size is a bad record).
DEFAULT_FALLBACK_SIZE: tuple[int, int] = (640, 480)


class SizeDraw:
    """A seeded, order-independent draw of image sizes from a list of real sizes.

    ``draw(key)`` hashes ``(seed, key)`` to pick one of ``sizes``, so an image path always
    gets the same size for the same seed.
    """

    def __init__(self, sizes: Sequence[Sequence[int]], seed: int = 0) -> None:
        checker = FieldProblems()
        checked = [checker.check_size(size, f"sizes[{i}]") for i, size in enumerate(sizes)]
        if checker:
            field_name, message = checker.items[0]
            raise ValueError(f"SizeDraw: {field_name}: {message}")
        self.sizes = [size for size in checked if size is not None]  # all of them: no problem was found
        if not self.sizes:
            raise ValueError("SizeDraw needs at least one size")
        self.seed = int(seed)

    def draw(self, key: str) -> tuple[int, int]:
        """The size drawn for ``key`` (an image path)."""
        digest = hashlib.blake2b(f"{self.seed}:{key}".encode(), digest_size=8).digest()
        return self.sizes[int.from_bytes(digest, "little") % len(self.sizes)]

    def __repr__(self) -> str:
        return f"SizeDraw({len(self.sizes)} sizes, seed={self.seed})"


#: What the readers accept as an image-size fallback: a fixed size, a draw, or None (no fallback).
Fallback = tuple[int, int] | SizeDraw | None


def fallback_size_for(fallback: Fallback, key: str) -> tuple[int, int] | None:
    """The fallback size of image ``key`` (None when there is no fallback)."""
    if fallback is None:
        return None
    if isinstance(fallback, SizeDraw):
        return fallback.draw(key)
    width, height = fallback
    return (int(width), int(height))


def _load_table(table: PathArg | Mapping[str, Any] | None, what: str) -> tuple[dict[str, Any], str | None]:
    if table is None:
        return {}, None
    if isinstance(table, Mapping):
        return dict(table), None
    try:
        data = json.loads(Path(table).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {what} table: {exc}", path=table) from exc
    except json.JSONDecodeError as exc:
        raise DataError(f"{what} table is not valid JSON: {exc.msg}", path=table, record=exc.lineno) from exc
    if not isinstance(data, dict):
        raise DataError(f"{what} table must be a JSON object mapping path -> value, got {type_name(data)}", path=table)
    return data, str(table)


def load_size_table(table: PathArg | Mapping[str, Any] | None) -> dict[str, tuple[int, int]]:
    """Load an image side table (path -> ``[w, h]``), checking every entry.

    Raises:
        DataError: naming the table file and the key of the first bad entry.
    """
    data, path = _load_table(table, "image size")
    out: dict[str, tuple[int, int]] = {}
    for key, value in data.items():
        checker = FieldProblems()
        size = checker.check_size(value, key)
        if size is None:
            field_name, message = checker.items[0]
            raise DataError(message, path=path or "<image_sizes table>", field=field_name)
        out[key] = size
    return out


def load_frame_table(table: PathArg | Mapping[str, Any] | None) -> dict[str, int]:
    """Load a video side table (path -> frame count), checking every entry.

    Raises:
        DataError: naming the table file and the key of the first bad entry.
    """
    data, path = _load_table(table, "video frame")
    out: dict[str, int] = {}
    for key, value in data.items():
        checker = FieldProblems()
        frames = checker.check_int(value, key, minimum=1, maximum=MAX_VIDEO_FRAMES)
        if frames is None:
            field_name, message = checker.items[0]
            raise DataError(message, path=path or "<video_frames table>", field=field_name)
        out[key] = frames
    return out
