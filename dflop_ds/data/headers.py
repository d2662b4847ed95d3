"""Image sizes read from file headers, cached in a JSON file beside the data file.

``PIL.Image.open`` parses only the header of a file (the pixels are decoded on first access),
so reading a size costs one small read per image. The sizes are kept in a cache file (by
default ``<data file>.image_sizes.cache.json``) keyed by the image's absolute path, with the
file's modification time and byte size: an entry whose file changed or is gone is read again
or dropped, so profiling a million records reads each header once across runs.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from dflop_ds.data.errors import PathArg
from dflop_ds.data.images import open_image

logger = logging.getLogger(__name__)

CACHE_FORMAT = "dflop-ds-image-size-cache"
CACHE_VERSION = 1
CACHE_SUFFIX = ".image_sizes.cache.json"
#: Show a progress bar (on stderr) when at least this many headers must be read.
PROGRESS_MIN_FILES = 2000


def cache_path_for(data_path: PathArg, suffix: str = CACHE_SUFFIX) -> Path:
    """The cache file of the data file ``data_path``: beside it, named after it."""
    return Path(str(data_path) + suffix)


def read_header_size(path: PathArg) -> tuple[int, int]:
    """``(width, height)`` of the image at ``path`` from its header (no pixel decoding).

    Raises:
        OSError: the file cannot be opened, PIL does not recognise it as an image, or it is over
            the pixel limit (:func:`~dflop_ds.data.images.open_image`).
    """
    with open_image(path) as image:
        width, height = image.size
    if width < 1 or height < 1:
        raise OSError(f"header gives an empty size {width}x{height}")
    return int(width), int(height)


def _file_key(stat: os.stat_result) -> list[int]:
    return [stat.st_mtime_ns, stat.st_size]


class HeaderSizes:
    """Sizes of images under ``image_folder``, from their headers, through a cache file.

    Paths are looked up as records write them (relative to ``image_folder``; absolute paths
    stay as they are). Results, sizes and problems alike, are remembered for the lifetime of
    the object; :meth:`save` writes the cache when something new was read. A subclass reads
    other facts of other media files by setting :attr:`kind`, :attr:`cache_format`,
    :attr:`value_len` and :meth:`read_value` (``dflop_ds.data.video.VideoHeaders``).

    Args:
        image_folder: the folder record paths are relative to.
        cache_path: the cache file (``None``: no cache).
        progress: show a progress bar on stderr for long header scans.
    """

    #: what the files are, in messages
    kind = "image"
    #: the cache file's format name
    cache_format = CACHE_FORMAT
    #: integers a file's value has (the cache stores them, then the file's modification time and size)
    value_len = 2

    def read_value(self, full_path: str) -> tuple[int, ...]:
        """The file's value (here ``(width, height)``); raises ``OSError``/``ValueError`` when unreadable."""
        return read_header_size(full_path)

    def __init__(self, image_folder: PathArg, cache_path: PathArg | None = None, *, progress: bool = True) -> None:
        self.image_folder = Path(image_folder)
        self.cache_path = None if cache_path is None else Path(cache_path)
        self.progress = progress
        self.headers_read = 0
        self._stats: dict[str, os.stat_result | str] = {}
        self._sizes: dict[str, tuple[int, ...] | str] = {}
        self._cache = self._load_cache()
        self._dirty = False

    def full_path(self, path: str) -> str:
        """The absolute path of record path ``path``."""
        return os.path.abspath(os.path.join(self.image_folder, path))

    # -- the cache file -----------------------------------------------------------------
    def _load_cache(self) -> dict[str, list[int]]:
        if self.cache_path is None or not self.cache_path.exists():
            return {}
        try:
            data = json.loads(self.cache_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            logger.warning(
                "ignoring unreadable %s size cache %s (%s); it will be rebuilt", self.kind, self.cache_path, exc
            )
            return {}
        if (
            not isinstance(data, dict)
            or data.get("format") != self.cache_format
            or data.get("format_version") != CACHE_VERSION
        ):
            logger.warning(
                "ignoring %s size cache %s of another format or version; it will be rebuilt", self.kind, self.cache_path
            )
            return {}
        entries = data.get("entries")
        if not isinstance(entries, dict):
            return {}
        return {
            key: value
            for key, value in entries.items()
            if isinstance(value, list) and len(value) == self.value_len + 2 and all(isinstance(v, int) for v in value)
        }

    def save(self) -> None:
        """Write the cache file if this object read headers or dropped stale entries.

        A cache that cannot be written is logged as a warning (the sizes are then read again
        next time), never an error.
        """
        if self.cache_path is None or not self._dirty:
            return
        payload = {"format": self.cache_format, "format_version": CACHE_VERSION, "entries": self._cache}
        tmp = self.cache_path.with_name(f"{self.cache_path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(payload, separators=(",", ":")), encoding="utf-8")
            os.replace(tmp, self.cache_path)
        except OSError as exc:
            logger.warning(
                "cannot write %s size cache %s (%s); the files will be read again next time",
                self.kind,
                self.cache_path,
                exc,
            )
            tmp.unlink(missing_ok=True)
            return
        self._dirty = False

    # -- lookups ------------------------------------------------------------------------
    def _stat(self, path: str) -> os.stat_result | str:
        if path not in self._stats:
            full = self.full_path(path)
            try:
                self._stats[path] = os.stat(full)
            except FileNotFoundError:
                self._stats[path] = f"{self.kind} file not found: {full}"
            except OSError as exc:
                self._stats[path] = f"cannot access {self.kind} file {full}: {exc.strerror or exc}"
        return self._stats[path]

    def missing(self, path: str) -> str | None:
        """Why the file ``path`` cannot be used (missing, not a file), or None when it exists."""
        stat = self._stat(path)
        if isinstance(stat, str):
            if self._cache.pop(self.full_path(path), None) is not None:
                self._dirty = True
            return stat
        if not os.path.isfile(self.full_path(path)):
            return f"{self.kind} path is not a file: {self.full_path(path)}"
        return None

    def _cached(self, path: str, stat: os.stat_result) -> tuple[int, ...] | None:
        entry = self._cache.get(self.full_path(path))
        if entry is None:
            return None
        if entry[self.value_len :] != _file_key(stat):
            del self._cache[self.full_path(path)]
            self._dirty = True
            return None
        return tuple(entry[: self.value_len])

    def _read(self, path: str, stat: os.stat_result) -> tuple[int, ...] | str:
        full = self.full_path(path)
        self.headers_read += 1
        try:
            value = tuple(int(v) for v in self.read_value(full))
        except (OSError, ValueError) as exc:  # PIL: UnidentifiedImageError is an OSError
            return f"cannot read the {self.kind} header of {full}: {exc}"
        self._cache[full] = [*value, *_file_key(stat)]
        self._dirty = True
        return value

    def prefetch(self, paths: Iterable[str]) -> None:
        """Look up the sizes of ``paths`` now, showing progress when many headers must be read."""
        todo: list[tuple[str, os.stat_result]] = []
        for path in dict.fromkeys(paths):
            if path in self._sizes:
                continue
            problem = self.missing(path)
            if problem is not None:
                self._sizes[path] = problem
                continue
            stat = self._stat(path)
            assert not isinstance(stat, str)
            cached = self._cached(path, stat)
            if cached is not None:
                self._sizes[path] = cached
            else:
                todo.append((path, stat))
        items: Iterable[tuple[str, os.stat_result]] = todo
        if self.progress and len(todo) >= PROGRESS_MIN_FILES:
            from tqdm import tqdm

            items = tqdm(
                todo,
                desc=f"reading {self.kind} headers under {self.image_folder}",
                unit="file",
                file=sys.stderr,
                mininterval=1.0,
            )
        for path, stat in items:
            self._sizes[path] = self._read(path, stat)

    def value(self, path: str) -> tuple[int, ...] | str:
        """The value of file ``path`` (its :meth:`read_value`), or a message naming the file and why not."""
        if path not in self._sizes:
            self.prefetch([path])
        return self._sizes[path]

    def size(self, path: str) -> tuple[int, int] | str:
        """``(width, height)`` of image ``path``, or a message naming the file and why not."""
        value = self.value(path)
        return value if isinstance(value, str) else (value[0], value[1])
