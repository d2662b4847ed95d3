"""Reading and writing the project's JSON files, with errors that name the file."""

from __future__ import annotations

import json
from os import PathLike
from pathlib import Path
from typing import Any

PathArg = str | PathLike[str]


def read_json_object(path: PathArg, error: type[Exception] = ValueError) -> dict[str, Any]:
    """The JSON object stored at ``path``.

    Raises ``FileNotFoundError`` for a missing file and ``error`` (a ``ValueError`` by default)
    naming the file when it is not valid JSON or not a JSON object.
    """
    if Path(path).is_dir():
        raise error(f"{path}: is a folder, expected a JSON file")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text ({exc})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected one JSON object, found {type(data).__name__}")
    return data


def write_json(path: PathArg, data: Any, indent: int | None = 1) -> None:
    """Write ``data`` as JSON (with a final newline) to ``path``."""
    Path(path).write_text(json.dumps(data, indent=indent) + "\n", encoding="utf-8")
