"""Reading and writing the project's JSON files, with errors that name the file."""

from __future__ import annotations

import json
from os import PathLike
from pathlib import Path
from typing import Any

PathArg = str | PathLike[str]


class DuplicateKeyError(ValueError):
    """A JSON object repeats a key (JSON parsers keep the last value silently)."""


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` that builds an object and refuses a repeated key, naming it."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise DuplicateKeyError(f"duplicate key {key!r} in one object (the first value would be ignored)")
        obj[key] = value
    return obj


def parse_json(text: str, source: str, error: type[Exception] = ValueError) -> Any:
    """The JSON value of ``text`` (read from ``source``); a syntax error raises ``error`` naming
    ``source``, line and column, and an object that repeats a key raises it naming the key."""
    try:
        return json.loads(text, object_pairs_hook=_refuse_duplicates)
    except json.JSONDecodeError as exc:
        raise error(f"{source}: not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except DuplicateKeyError as exc:
        raise error(f"{source}: {exc}") from None


def read_json_object(path: PathArg, error: type[Exception] = ValueError) -> dict[str, Any]:
    """The JSON object stored at ``path``.

    Raises ``FileNotFoundError`` for a missing file and ``error`` (a ``ValueError`` by default)
    naming the file when it is not valid JSON (with line and column), repeats a key in an
    object (naming the key), or is not a JSON object.
    """
    if Path(path).is_dir():
        raise error(f"{path}: is a folder, expected a JSON file")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text ({exc})") from None
    data = parse_json(text, str(path), error)
    if not isinstance(data, dict):
        raise error(f"{path}: expected one JSON object, found {type(data).__name__}")
    return data


def write_json(path: PathArg, data: Any, indent: int | None = 1) -> None:
    """Write ``data`` as JSON (with a final newline) to ``path``."""
    Path(path).write_text(json.dumps(data, indent=indent) + "\n", encoding="utf-8")
