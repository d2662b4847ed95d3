"""DataError: a bad dataset record, named by file, record and field."""

from __future__ import annotations

from os import PathLike
from typing import Union

PathArg = Union[str, "PathLike[str]"]


def describe_location(
    path: PathArg | None,
    record: int | None,
    record_kind: str = "line",
    sample_id: str | None = None,
    field: str | None = None,
) -> str:
    """Where a problem is, e.g. ``data.jsonl line 12 (id 'abc'), field 'images[1]'``.

    ``record_kind`` is ``"line"`` (1-based JSONL line) or ``"index"`` (0-based position in a
    JSON array); every part that is ``None`` is left out.
    """
    parts: list[str] = []
    head = str(path) if path is not None else "<data>"
    if record is not None:
        head += f" {record_kind} {record}"
    if sample_id is not None:
        head += f" (id {sample_id!r})"
    parts.append(head)
    if field is not None:
        parts.append(f"field {field!r}")
    return ", ".join(parts)


class DataError(ValueError):
    """A dataset record (or a whole file) that cannot be turned into a :class:`SampleShape`.

    Attributes:
        path: the file at fault (``None`` for in-memory data).
        record: 1-based line number for JSONL, 0-based index for JSON arrays, ``None`` when
            the whole file is at fault.
        record_kind: ``"line"`` or ``"index"``: how to read ``record``.
        sample_id: the record's ``id`` when it could be read.
        field: the field at fault, e.g. ``"images[1]"`` (``None`` for whole-record problems).
        reason: the bare message, without the location.
    """

    def __init__(
        self,
        reason: str,
        *,
        path: PathArg | None = None,
        record: int | None = None,
        record_kind: str = "line",
        sample_id: str | None = None,
        field: str | None = None,
    ) -> None:
        self.path = None if path is None else str(path)
        self.record = record
        self.record_kind = record_kind
        self.sample_id = sample_id
        self.field = field
        self.reason = reason
        super().__init__(f"{self.location}: {reason}")

    @property
    def location(self) -> str:
        """The location part of the message (file, record, id, field)."""
        return describe_location(self.path, self.record, self.record_kind, self.sample_id, self.field)

    def __reduce__(self):
        kwargs = dict(
            path=self.path, record=self.record, record_kind=self.record_kind, sample_id=self.sample_id, field=self.field
        )
        return (_rebuild_data_error, (self.reason, kwargs))


def _rebuild_data_error(reason: str, kwargs: dict) -> DataError:
    return DataError(reason, **kwargs)
