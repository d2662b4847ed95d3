"""Typed field checks for dataset records, collecting every problem of a record.

Readers parse a record through a :class:`FieldProblems` collector: each getter returns the
value when it is valid and otherwise records ``(field, message)`` and returns ``None``, so one
pass finds all of a record's problems (the validator reports them all; readers raise the first).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: Largest plausible image side in pixels; anything bigger is treated as corrupt metadata.
MAX_IMAGE_SIDE = 100_000
#: Largest plausible frame count of one video (about 4 days at 30 fps).
MAX_VIDEO_FRAMES = 10_000_000
#: Largest plausible text token count of one sample.
MAX_TEXT_TOKENS = 10_000_000


def is_int(value: Any) -> bool:
    """True for JSON integers (``bool`` excluded, although Python counts it as ``int``)."""
    return isinstance(value, int) and not isinstance(value, bool)


def type_name(value: Any) -> str:
    """The JSON name of ``value``'s type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


@dataclass
class FieldProblems:
    """The problems found in one record, as ``(field, message)`` pairs."""

    items: list[tuple[str | None, str]] = field(default_factory=list)

    def add(self, field_name: str | None, message: str) -> None:
        """Record a problem of ``field_name`` (``None``: the record as a whole)."""
        self.items.append((field_name, message))

    def __bool__(self) -> bool:
        return bool(self.items)

    def check_int(self, value: Any, name: str, *, minimum: int = 0, maximum: int) -> int | None:
        """``value`` if it is an int in ``[minimum, maximum]``, else record why and return None."""
        if not is_int(value):
            self.add(name, f"must be an int, got {type_name(value)} {value!r}")
            return None
        if value < minimum:
            what = "positive" if minimum == 1 else f">= {minimum}"
            self.add(name, f"must be {what}, got {value}")
            return None
        if value > maximum:
            self.add(name, f"{value} is implausibly large (limit {maximum})")
            return None
        return int(value)

    def int_field(
        self,
        record: Mapping[str, Any],
        key: str,
        *,
        default: int | None = None,
        minimum: int = 0,
        maximum: int,
    ) -> int | None:
        """Read integer field ``key``; missing is a problem only when there is no ``default``."""
        if key not in record:
            if default is None:
                self.add(key, "is missing")
            return default
        return self.check_int(record[key], key, minimum=minimum, maximum=maximum)

    def check_size(self, value: Any, name: str) -> tuple[int, int] | None:
        """A ``[width, height]`` pair of positive ints, or None after recording the problem."""
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            self.add(name, f"must be a [width, height] pair, got {value!r}")
            return None
        width = self.check_int(value[0], f"{name}.width", minimum=1, maximum=MAX_IMAGE_SIDE)
        height = self.check_int(value[1], f"{name}.height", minimum=1, maximum=MAX_IMAGE_SIDE)
        if width is None or height is None:
            return None
        return (width, height)

    def str_field(self, record: Mapping[str, Any], key: str, *, required: bool = True) -> str | None:
        """Read string field ``key`` (non-empty when present)."""
        if key not in record:
            if required:
                self.add(key, "is missing")
            return None
        value = record[key]
        if not isinstance(value, str):
            self.add(key, f"must be a string, got {type_name(value)} {value!r}")
            return None
        if not value:
            self.add(key, "must not be empty")
            return None
        return value

    def sample_id(self, record: Mapping[str, Any], *, allow_int: bool = False) -> str | None:
        """The record's ``id`` as a string (ints accepted when ``allow_int``)."""
        if "id" not in record:
            self.add("id", "is missing")
            return None
        value = record["id"]
        if allow_int and is_int(value):
            return str(value)
        return self.str_field(record, "id")


def peek_id(record: Any) -> str | None:
    """The record's id for messages, if it has a usable one (no checking)."""
    if isinstance(record, Mapping):
        value = record.get("id")
        if isinstance(value, str) or is_int(value):
            return str(value)
    return None
