"""Strict checks of configuration values: a boolean is a boolean, a number is a number.

JSON configs are written by hand: ``"false"`` (a non-empty string, so truthy), ``"0.001"`` or
``true`` where a number belongs are refused with the key and the value, never reinterpreted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

_KINDS = {
    "bool": "a boolean (true or false)",
    "int": "an integer",
    "number": "a number",
    "str": "a string",
    "dict": "an object ({...})",
    "list": "a list ([...])",
}


def _has_kind(value: Any, kind: str) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, {"str": str, "dict": dict, "list": list}[kind])


def check_setting(
    key: str,
    value: Any,
    kind: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    optional: bool = False,
    choices: Sequence[Any] | None = None,
    words: Sequence[str] = (),
    nonempty: bool = False,
) -> None:
    """Raise ``ValueError`` naming ``key`` and ``value`` unless ``value`` is of ``kind``
    (``"bool"``, ``"int"``, ``"number"``, ``"str"``, ``"dict"``, ``"list"``; ``None`` too when
    ``optional``; one of the strings ``words`` too, e.g. ``"auto"`` beside a number), within
    ``[minimum, maximum]``, greater than ``above``, among ``choices``, and with ``nonempty`` a
    string with more than blanks (a path or name: ``""`` would name nothing)."""
    if (value is None and optional) or (isinstance(value, str) and value in words):
        return
    what = _KINDS[kind] + (" or null" if optional else "") + "".join(f" or {word!r}" for word in words)
    if not _has_kind(value, kind):
        raise ValueError(f"{key} must be {what}, got {value!r} ({type(value).__name__})")
    if nonempty and isinstance(value, str) and not value.strip():
        raise ValueError(f"{key} must be a non-empty string (a path or name), got {value!r}: leave the key out instead")
    if choices is not None and value not in choices:
        raise ValueError(f"{key} must be one of {list(choices)}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{key} must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{key} must be <= {maximum}, got {value!r}")
    if above is not None and not value > above:
        raise ValueError(f"{key} must be > {above}, got {value!r}")
