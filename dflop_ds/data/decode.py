"""Decode a dataset's media files in full, as training will, to find the ones headers cannot.

A header read (:mod:`dflop_ds.data.headers`, :mod:`dflop_ds.data.video`) proves a file starts
like an image or a video; a truncated PNG or JPEG, a corrupt video stream or a video whose
frames end before its header's count only fail when their pixels are decoded. ``dflop-ds
validate --deep`` decodes every image (:func:`~dflop_ds.data.images.load_rgb`) and every frame
of every video (:func:`~dflop_ds.data.video.decoded_frame_count`) of the good records; plain
``validate`` decodes a few files spread over the dataset (:data:`SAMPLED_DECODES`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dflop_ds.data.images import load_rgb
from dflop_ds.data.media import MediaOptions, image_field, record_image_paths, recorded_size_source, size_mismatch
from dflop_ds.data.records import RawRecord, ReadResult
from dflop_ds.data.video import decoded_frame_count

#: Media files plain ``validate`` decodes, spread evenly over the dataset (``--deep``: all).
SAMPLED_DECODES = 8


@dataclass(frozen=True)
class MediaFile:
    """One media file of a good record: where it is named (record, id, field, ``path`` as the record
    gives it) and what it must hold (a video's ``frames``; an image's ``size`` when the sample's
    tokens depend on it, as ``size_given_by`` gave it)."""

    record: int
    sample_id: str
    field: str
    kind: str
    full_path: str
    frames: int = 0
    size: tuple[int, int] | None = None
    path: str = ""
    size_given_by: str = ""


def media_files(
    records: Sequence[RawRecord], result: ReadResult, options: MediaOptions, *, check_sizes: bool = False
) -> list[MediaFile]:
    """The image and video files of the records ``result`` read well, in file order; media of a
    kind whose folder ``options`` does not give are left out (there is no file to decode).
    ``check_sizes``: each image must have the size its shape was made with (a policy whose tokens
    depend on the size, as Qwen2-VL's, where training refuses a recorded size that is not the file's)."""
    by_number = {raw.number: raw for raw in records}
    files: list[MediaFile] = []
    for shape, number in zip(result, result.record_numbers):
        value = by_number[number].value
        if options.image_folder is not None:
            paths = record_image_paths(value)
            for i, path in enumerate(paths):
                full = os.path.abspath(os.path.join(options.image_folder, path))
                size = shape.image_sizes[i] if check_sizes else None
                given_by = recorded_size_source(value, i)[1]
                field = image_field(value, i)
                files.append(
                    MediaFile(
                        number, shape.sample_id, field, "image", full, size=size, path=path, size_given_by=given_by
                    )
                )
        if options.video_folder is not None and shape.video_frames and isinstance(value.get("video"), str):
            full = os.path.abspath(os.path.join(options.video_folder, value["video"]))
            files.append(MediaFile(number, shape.sample_id, "video", "video", full, shape.video_frames))
    return files


def spread(files: Sequence[MediaFile], limit: int | None) -> list[MediaFile]:
    """All of ``files`` (``limit`` None), or ``limit`` of them spread evenly from the first to the last."""
    if limit is None or limit >= len(files):
        return list(files)
    if limit <= 0:
        return []
    step = (len(files) - 1) / max(limit - 1, 1)
    return [files[round(i * step)] for i in range(limit)]


def decode_problem(file: MediaFile) -> str | None:
    """Why ``file`` cannot be decoded in full (naming it), or None when it decodes."""
    try:
        if file.kind == "image":
            real = load_rgb(file.full_path).size
            if file.size is not None and tuple(real) != tuple(file.size):
                return size_mismatch(file.size_given_by, file.size, file.path, file.full_path, real)
            return None
        decoded = decoded_frame_count(file.full_path)
    except (OSError, ValueError) as exc:
        return f"cannot decode {file.kind} {file.full_path}: {exc}"
    if decoded < file.frames:
        return (
            f"video {file.full_path} decodes to {decoded} frame(s), but its sample counts {file.frames} "
            "(from the record or the container's header): the file is truncated or corrupt"
        )
    return None


def decode_media(files: Sequence[MediaFile], *, progress: bool = True) -> list[tuple[MediaFile, str]]:
    """``(file, problem)`` of every file of ``files`` that does not decode, with a progress bar on
    stderr (``progress``)."""
    items: Iterable[MediaFile] = files
    if progress and files:
        from tqdm import tqdm

        items = tqdm(files, desc="decoding media files", unit="file", file=sys.stderr, mininterval=1.0)
    found = []
    for file in items:
        problem = decode_problem(file)
        if problem is not None:
            found.append((file, problem))
    return found


__all__ = ["SAMPLED_DECODES", "MediaFile", "decode_media", "decode_problem", "media_files", "spread"]
