"""Check an output path before long work starts, so a typo fails in a second, not after a search."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


class OutputPathError(ValueError):
    """An output path cannot be written; the message names the option and the path."""


def _probe(folder: Path) -> None:
    """Create and remove a file in ``folder`` (raises ``OSError`` when it cannot be written)."""
    handle, probe = tempfile.mkstemp(dir=folder, prefix=".dflop-write-check-")
    os.close(handle)
    os.unlink(probe)


def check_writable(path: str | Path, what: str) -> Path:
    """Make sure ``path`` can be written (creating missing parent folders), without changing an
    existing file; raise :class:`OutputPathError` naming ``what`` (e.g. ``"--telemetry"``) and
    the path otherwise. Returns the path."""
    path = Path(path)
    if path.is_dir():
        raise OutputPathError(f"{what} {path}: is a folder, expected a file path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            with open(path, "a"):
                pass
        else:
            _probe(path.parent)
    except OSError as error:
        raise OutputPathError(f"{what} {path}: cannot be written ({error.strerror or error})") from None
    return path


def check_writable_folder(path: str | Path, what: str) -> Path:
    """Make sure the folder ``path`` exists or can be created and can be written in; raise
    :class:`OutputPathError` naming ``what`` (e.g. ``"--output_dir"``) and the path otherwise."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputPathError(f"{what} {path}: is a file, expected a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        _probe(path)
    except OSError as error:
        raise OutputPathError(f"{what} {path}: cannot be written ({error.strerror or error})") from None
    return path
