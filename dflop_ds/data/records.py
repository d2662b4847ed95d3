"""Raw records of a JSON-array or JSONL file, and the shared read loop of all readers.

:func:`load_records` turns a file into :class:`RawRecord` objects (malformed JSONL lines
included, flagged). :func:`read_records` runs a reader's per-record parser over them, enforces
unique ids and applies the ``on_bad_sample`` policy, returning a :class:`ReadResult` (a list of
shapes carrying a :class:`ReadReport`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflop_ds.data.errors import DataError, PathArg
from dflop_ds.data.fields import FieldProblems, peek_id, type_name
from dflop_ds.shapes import SampleShape

logger = logging.getLogger(__name__)

BAD_SAMPLE_POLICIES = ("error", "skip")

#: A reader's per-record parser: returns the shape, or None after recording problems.
RecordParser = Callable[[Mapping[str, Any], FieldProblems], "SampleShape | None"]


@dataclass(frozen=True)
class RawRecord:
    """One record of a file before parsing.

    ``number`` is the 1-based line (``kind == "line"``, JSONL) or the 0-based array index
    (``kind == "index"``, JSON array). ``value`` is the decoded JSON; ``error`` is set instead
    when the line cannot be decoded (bad bytes, bad JSON, a number or nesting past the
    decoder's limits, an oversized line), with ``id_hint`` the id read from the raw text if any.
    """

    number: int
    kind: str
    value: Any = None
    error: str | None = None
    id_hint: str | None = None


#: Longest JSONL line read as a record; longer ones are bad records (a LLaVA record is kilobytes).
MAX_LINE_BYTES = 16 * 1024 * 1024
_ID_PATTERN = re.compile(rb'"id"\s*:\s*(?:"((?:[^"\\]|\\.){1,200})"|(-?\d{1,30})\b)')


def _id_hint(line: bytes) -> str | None:
    """The record's id as written in a line that cannot be decoded, when it is readable."""
    match = _ID_PATTERN.search(line[:65536])
    if match is None:
        return None
    return (match.group(1) or match.group(2)).decode("utf-8", errors="replace")


def decode_line(line: bytes) -> tuple[Any, str | None]:
    """``(value, None)`` for a good JSON line, ``(None, reason)`` for a bad one: not UTF-8, not
    JSON, an integer too long to convert, nesting too deep for the decoder, or oversized."""
    if len(line) > MAX_LINE_BYTES:
        return None, f"line is {len(line)} bytes, over the {MAX_LINE_BYTES}-byte limit of one record"
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8: byte 0x{line[exc.start]:02x} at column {exc.start + 1}"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"malformed JSON: {exc.msg} (column {exc.colno})"
    except RecursionError:
        return None, "JSON nested too deeply to decode"
    except ValueError as exc:  # e.g. an integer longer than Python's int conversion limit
        return None, f"JSON value out of range: {exc}"


def load_records(path: PathArg) -> list[RawRecord]:
    """Read ``path`` as a JSON array (first non-blank character ``[``) or as JSONL.

    Raises:
        DataError: the file cannot be read, or is a JSON array that does not decode (a bad
            JSONL line does not raise: it becomes a flagged record, see :func:`decode_line`).
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read file: {exc}", path=path) from exc
    if data.lstrip().startswith(b"["):
        try:
            values = json.loads(data.decode("utf-8"))
        except json.JSONDecodeError as exc:
            raise DataError(
                f"invalid JSON array: {exc.msg} (column {exc.colno})", path=path, record=exc.lineno, record_kind="line"
            ) from exc
        except (UnicodeDecodeError, RecursionError, ValueError) as exc:
            raise DataError(f"invalid JSON array: {type(exc).__name__}: {exc}", path=path) from exc
        if not isinstance(values, list):
            raise DataError(f"expected a JSON array of records, found {type_name(values)}", path=path)
        return [RawRecord(index, "index", value) for index, value in enumerate(values)]
    records = []
    for number, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        value, error = decode_line(line.rstrip(b"\r"))
        records.append(RawRecord(number, "line", value, error, _id_hint(line) if error else None))
    return records


@dataclass
class ReadReport:
    """What a reader did with a file: samples read, records skipped and why."""

    path: str
    n_records: int = 0
    n_read: int = 0
    skipped_records: list[int] = field(default_factory=list)
    problems: list[DataError] = field(default_factory=list)

    @property
    def n_skipped(self) -> int:
        """Records dropped under ``on_bad_sample="skip"``."""
        return len(self.skipped_records)

    def summary(self) -> str:
        """One line: read and skipped counts."""
        return f"{self.path}: read {self.n_read} of {self.n_records} records, skipped {self.n_skipped} bad record(s)"


class ReadResult(list):
    """A ``list[SampleShape]`` that also carries the :class:`ReadReport` of its read.

    ``record_numbers[i]`` is the line (JSONL) or index (JSON array) that ``self[i]`` came from.
    """

    report: ReadReport
    record_numbers: list[int]

    def __init__(self, shapes: Iterable[SampleShape], report: ReadReport, record_numbers: Iterable[int] = ()) -> None:
        super().__init__(shapes)
        self.report = report
        self.record_numbers = list(record_numbers)


def check_policy(on_bad_sample: str) -> None:
    """Reject an unknown ``on_bad_sample`` value."""
    if on_bad_sample not in BAD_SAMPLE_POLICIES:
        raise ValueError(f"on_bad_sample must be one of {BAD_SAMPLE_POLICIES}, got {on_bad_sample!r}")


def read_records(
    path: PathArg,
    records: Iterable[RawRecord],
    parse: RecordParser,
    *,
    on_bad_sample: str = "error",
    warn: bool = True,
) -> ReadResult:
    """Parse every record with ``parse``; bad records raise or are skipped and reported.

    A record is bad when it is malformed JSON, not an object, has field problems, or repeats
    an earlier record's id. Under ``"error"`` the first bad record raises :class:`DataError`;
    under ``"skip"`` it is dropped, every one of its problems is kept in the report, and a
    warning with the count is logged (unless ``warn`` is False).
    """
    check_policy(on_bad_sample)
    report = ReadReport(path=str(path))
    shapes: list[SampleShape] = []
    numbers: list[int] = []
    first_seen: dict[str, int] = {}
    for raw in records:
        report.n_records += 1
        errors = _record_errors(path, raw, parse, first_seen)
        if isinstance(errors, SampleShape):
            first_seen[errors.sample_id] = raw.number
            shapes.append(errors)
            numbers.append(raw.number)
            continue
        if on_bad_sample == "error":
            raise errors[0]
        report.skipped_records.append(raw.number)
        report.problems.extend(errors)
    report.n_read = len(shapes)
    if report.n_skipped and warn:
        logger.warning("%s; first problem: %s", report.summary(), report.problems[0])
    return ReadResult(shapes, report, numbers)


def _record_errors(
    path: PathArg,
    raw: RawRecord,
    parse: RecordParser,
    first_seen: Mapping[str, int],
) -> SampleShape | list[DataError]:
    """The parsed shape of ``raw``, or the list of its problems as DataErrors."""

    def error(reason: str, field_name: str | None = None, sample_id: str | None = None) -> DataError:
        return DataError(
            reason, path=path, record=raw.number, record_kind=raw.kind, sample_id=sample_id, field=field_name
        )

    if raw.error is not None:
        return [error(raw.error, sample_id=raw.id_hint)]
    if not isinstance(raw.value, Mapping):
        return [error(f"record must be a JSON object, got {type_name(raw.value)}")]
    problems = FieldProblems()
    try:
        shape = parse(raw.value, problems)
    except ValueError as exc:  # a policy rejecting a value the checks let through
        problems.add(None, str(exc))
        shape = None
    sample_id = peek_id(raw.value)
    if sample_id is not None and sample_id in first_seen:
        problems.add("id", f"duplicate id, first seen at {raw.kind} {first_seen[sample_id]}")
    if shape is not None and shape.text_tokens + shape.encoder_tiles == 0:
        problems.add(None, "sample has no text tokens and no media: there is nothing to train on")
    if problems or shape is None:
        if not problems:
            problems.add(None, "record could not be parsed")
        return [error(message, field_name, sample_id) for field_name, message in problems.items]
    return shape
