"""Where a LLaVA record's image sizes and video frame counts come from, in one place.

An image's size is, in this order: the size the record gives (``width``/``height`` or
``image_sizes``); the ``image_sizes`` side table; the image file's header under
``image_folder`` (cached beside the data file, see :mod:`dflop_ds.data.headers`); and only
when no ``image_folder`` is given, an explicitly requested ``fallback_size``. With an
``image_folder`` every image must exist (training loads it), whatever gave its size; a
missing or unreadable file is a bad record naming the path. A video's frame count is the
record's, the ``video_frames`` table's, then (under a ``video_folder``) its container's, read
with PyAV and cached beside the data file (:mod:`dflop_ds.data.video`), then
``fallback_frames``; with a ``video_folder`` every video must exist and a count the record or
the table gives must match its container's. A shape policy with a
``video_rule`` also needs the frame size and rate: they come from the container, so such a
video needs a ``video_folder``.

Nothing has a silent default: a size found nowhere is a bad record.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dflop_ds.data.errors import PathArg
from dflop_ds.data.headers import HeaderSizes, cache_path_for
from dflop_ds.data.records import RawRecord
from dflop_ds.data.sizes import Fallback, fallback_size_for, load_frame_table, load_size_table
from dflop_ds.data.video import VIDEO_CACHE_SUFFIX, VideoHeaders, VideoInfo

#: Record keys that give image sizes (a record with any of them needs no header).
SIZE_KEYS = ("image_sizes", "width", "height")


@dataclass(frozen=True)
class MediaLookup:
    """Side tables, media folders and fallbacks for what a record does not carry."""

    image_sizes: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    video_frames: Mapping[str, int] = field(default_factory=dict)
    fallback_size: Fallback = None
    fallback_frames: int | None = None
    headers: HeaderSizes | None = None
    videos: VideoHeaders | None = None

    def image_size(self, path: str, given: tuple[int, int] | None = None) -> tuple[int, int] | str:
        """Size of image ``path`` (``given``: the record's), or a message saying why there is none."""
        if self.headers is not None:
            problem = self.headers.missing(path)
            if problem is not None:
                return problem
        if given is not None:
            return given
        if path in self.image_sizes:
            return self.image_sizes[path]
        if self.headers is not None:
            return self.headers.size(path)
        size = fallback_size_for(self.fallback_size, path)
        if size is None:
            return (
                f"no size for image {path!r}: not in the record, not in the image_sizes table, "
                "no image_folder to read its header from, and no fallback_size"
            )
        return size

    def video(
        self, path: str, given: int | None = None, *, need_info: bool = False, given_by: str = "the record"
    ) -> tuple[int, VideoInfo | None] | str:
        """``(frame count, container facts or None)`` of video ``path`` (``given``: the record's
        frame count, from ``given_by``), or a message saying why there is none. ``need_info``: the
        container's facts (size, rate) are needed, so the file must be readable under the
        ``video_folder``. Under a ``video_folder`` the file is the truth: a frame count the record
        or the table gives that disagrees with the container's is refused, naming both."""
        if self.videos is not None:
            problem = self.videos.missing(path)
            if problem is not None:
                return problem
        known = given if given is not None else self.video_frames.get(path)
        info = None
        if self.videos is not None:
            found = self.videos.info(path)
            if isinstance(found, str):
                return found
            info = found
            if known is not None and known != info.frames:
                source = given_by if given is not None else "the video_frames table"
                return (
                    f"{source} gives {known} frame(s) for video {path!r}, but the file "
                    f"{self.videos.full_path(path)} has {info.frames}: correct or remove the count "
                    "(the file's is read when none is given)"
                )
        elif need_info:
            return (
                f"no frame size and rate for video {path!r}: the shape policy needs them from the video file, "
                "and no video_folder was given to read it from"
            )
        if known is not None:
            return known, info
        if info is not None:
            return info.frames, info
        if self.fallback_frames is not None:
            return self.fallback_frames, None
        return (
            f"no frame count for video {path!r}: not in the record ('video_frames'/'frame_count'), "
            "not in the video_frames table, no video_folder to read it from, and no fallback_frames"
        )

    def save_cache(self) -> None:
        """Write the header caches (image sizes, video facts), if headers were read."""
        for cache in (self.headers, self.videos):
            if cache is not None:
                cache.save()


def record_image_paths(value: Any) -> list[str]:
    """The image paths of a raw record (no checking: malformed values give none)."""
    if not isinstance(value, Mapping):
        return []
    image = value.get("image")
    if isinstance(image, str):
        return [image] if image else []
    if isinstance(image, list):
        return [item for item in image if isinstance(item, str) and item]
    return []


def image_field(record: Mapping[str, Any], i: int) -> str:
    """The field that names image ``i`` of ``record``: ``image`` for one path, ``image[i]`` for a list."""
    return "image" if isinstance(record.get("image"), str) else f"image[{i}]"


def recorded_size_source(record: Mapping[str, Any], i: int) -> tuple[str, str]:
    """``(field, description)`` of where image ``i``'s size came from when it is not read from the
    file itself: the record's ``image_sizes`` or ``width``/``height``, else the ``image_sizes``
    table (or a header cache made when the file was another size)."""
    if "image_sizes" in record:
        return f"image_sizes[{i}]", "the record's 'image_sizes'"
    if "width" in record or "height" in record:
        return "width/height", "the record's 'width'/'height'"
    return image_field(record, i), "the image_sizes table (or a stale header cache)"


def size_mismatch(given_by: str, given: Sequence[int], path: str, full: str, real: Sequence[int]) -> str:
    """Why image ``path`` (the file ``full``, ``real`` pixels) cannot train when its tokens depend
    on its size and ``given_by`` (:func:`recorded_size_source`) sized it ``given``."""
    return (
        f"{given_by} gives {given[0]}x{given[1]} for image {path!r}, but the file {full} is {real[0]}x{real[1]}: "
        "its tokens depend on its size, so correct or remove the recorded size (the file's header is read "
        "when none is given)"
    )


def paths_needing_headers(records: Iterable[RawRecord], table: Mapping[str, Any]) -> list[str]:
    """Image paths of records that give no size for them and that ``table`` does not cover."""
    paths: list[str] = []
    for raw in records:
        if isinstance(raw.value, Mapping) and any(key in raw.value for key in SIZE_KEYS):
            continue
        paths.extend(path for path in record_image_paths(raw.value) if path not in table)
    return paths


@dataclass(frozen=True)
class MediaOptions:
    """Where a LLaVA file's media sizes come from: the one set of options every reader takes.

    The readers (:func:`~dflop_ds.data.read_dataset`, ``read_llava``, ``validate_dataset``)
    accept these fields as keyword arguments; an unknown keyword is refused by name.

    Attributes:
        image_folder: folder the records' image paths are relative to; sizes the record and
            the table do not give are read from the image headers (cached beside the data file).
        video_folder: folder the records' video paths are relative to (each video must exist);
            frame counts the record and the table do not give, and the frame size and rate a
            ``video_rule`` needs, are read from the containers (cached beside the data file).
        image_sizes: side table, a JSON file or a dict mapping image path -> ``[w, h]``.
        video_frames: side table, a JSON file or a dict mapping video path -> frame count.
        fallback_size: size of images found nowhere else, only without an ``image_folder``:
            ``(w, h)`` or a :class:`~dflop_ds.data.sizes.SizeDraw`; ``None`` (default): a bad record.
        fallback_frames: frame count of videos found nowhere else (``None``: a bad record).
    """

    image_folder: PathArg | None = None
    video_folder: PathArg | None = None
    image_sizes: PathArg | Mapping[str, Sequence[int]] | None = None
    video_frames: PathArg | Mapping[str, int] | None = None
    fallback_size: Fallback = None
    fallback_frames: int | None = None


def media_folder(data_path: PathArg, folder: PathArg | None) -> str:
    """The folder a data file's media paths are relative to: ``folder`` when given, else the data
    file's own folder (the default of training and of every data command alike)."""
    return str(folder) if folder is not None else os.path.dirname(os.path.abspath(data_path))


#: each media folder, and the options that give what its files would (so it is not defaulted)
FOLDER_ALTERNATIVES = {
    "image_folder": ("image_sizes", "fallback_size"),
    "video_folder": ("video_frames", "fallback_frames"),
}


def default_media_folders(data_path: PathArg, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` (fields of :class:`MediaOptions`) with each media folder that is not given set to
    the data file's folder (:func:`media_folder`, as training does), unless a side table or fallback
    is given for that kind of media instead (then no folder: its files need not be at hand)."""
    filled = dict(options)
    for folder, alternatives in FOLDER_ALTERNATIVES.items():
        if filled.get(folder) is None and all(filled.get(name) is None for name in alternatives):
            filled[folder] = media_folder(data_path, None)
    return filled


def media_lookup(
    data_path: PathArg, records: Sequence[RawRecord], options: MediaOptions, *, progress: bool = True
) -> MediaLookup:
    """The :class:`MediaLookup` of the LLaVA file ``data_path``, its header sizes read up front.

    Every image of ``records`` that needs its header has it read here (once, with a progress
    bar for long scans; the cache file beside ``data_path`` keeps the sizes for the next read).

    Raises:
        DataError: a side table cannot be read or has a bad entry (naming it).
    """
    table = load_size_table(options.image_sizes)
    headers = None
    if options.image_folder is not None:
        headers = HeaderSizes(options.image_folder, cache_path_for(data_path), progress=progress)
        headers.prefetch(paths_needing_headers(records, table))
    videos = None
    if options.video_folder is not None:
        videos = VideoHeaders(options.video_folder, cache_path_for(data_path, VIDEO_CACHE_SUFFIX), progress=progress)
    return MediaLookup(
        table, load_frame_table(options.video_frames), options.fallback_size, options.fallback_frames, headers, videos
    )
