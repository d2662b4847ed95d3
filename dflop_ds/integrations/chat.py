"""Sample shapes of chat rows (``messages`` + ``images``), the layout ms-swift and LLaMA-Factory
datasets share, from the rows' text and the images' headers: no pixel is decoded.

Each row becomes the LLaVA record the project's reader already shapes (``from``/``value`` turns,
``image_sizes`` from the headers), so text tokens, image tokens and the family's chat template are
counted exactly as for ``llava_json_shapes``. Rows with videos or audio are refused by index: the
plugins shape images only.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dflop_ds.data import DataError
from dflop_ds.data.formats import LLAVA, read_loaded
from dflop_ds.data.media import MediaOptions
from dflop_ds.data.records import RawRecord
from dflop_ds.hf_trainer.shapes import ShapeTable, image_size
from dflop_ds.shapes import ShapePolicy

#: row columns holding media the plugins do not shape
UNSHAPED_MEDIA = ("videos", "audios")


def media_size(image: Any) -> tuple[int, int]:
    """``(width, height)`` of a row's image: a path, a ``{"bytes", "path"}`` entry or a PIL image,
    read from the header."""
    if isinstance(image, (str, os.PathLike)):
        return image_size({"path": os.fspath(image)})
    return image_size(image)


def llava_record(
    index: int, row: Mapping[str, Any], content_key: str = "content", role_key: str = "role", source: str | None = None
) -> dict:
    """Row ``index`` (of ``source``, named in errors) as a LLaVA record with its images' sizes
    (``image_sizes``), read from headers."""

    def refused(reason: str, field: str) -> DataError:
        return DataError(reason, path=source, record=index, record_kind="index", sample_id=str(index), field=field)

    for key in UNSHAPED_MEDIA:
        if row.get(key):
            raise refused(f"has {key}, which the framework plugins do not shape yet", key)
    images: Sequence[Any] = row.get("images") or []
    try:
        sizes = [list(media_size(image)) for image in images]
    except (OSError, ValueError) as error:
        raise refused(f"cannot read an image header: {error}", "images") from error
    messages = row.get("messages")
    if not isinstance(messages, list):
        raise refused("has no 'messages' list", "messages")
    for i, turn in enumerate(messages):
        if not isinstance(turn, Mapping):
            raise refused(
                f"must be an object with {role_key!r} and {content_key!r}, got {type(turn).__name__}", f"messages[{i}]"
            )
    turns = [{"from": turn.get(role_key), "value": turn.get(content_key)} for turn in messages]
    record: dict[str, Any] = {"id": str(index), "conversations": turns}
    if sizes:
        record.update(image=[f"image{i}" for i in range(len(sizes))], image_sizes=sizes)
    return record


def chat_shapes(rows: Iterable[Mapping[str, Any]], policy: ShapePolicy, source: str) -> ShapeTable:
    """One shape per row of ``rows`` (a dataset's ``messages`` / ``images`` rows, in index order)
    under ``policy``; a bad row is a :class:`~dflop_ds.data.DataError` naming ``source`` and the
    row's index."""
    records = [RawRecord(index, "index", llava_record(index, row, source=source)) for index, row in enumerate(rows)]
    shapes = read_loaded(source, records, policy, fmt=LLAVA, media=MediaOptions(), on_bad_sample="error")
    return ShapeTable(shapes, policy)


__all__ = ["chat_shapes", "llava_record", "media_size"]
