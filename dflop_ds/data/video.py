"""Video files read with PyAV (the ``video`` extra): facts from the container, sampled frames decoded.

:func:`read_video_info` gives a video's frame count, frame size and frame rate from the
container's stream header (no frame is decoded; only a container that records no frame count
has its packets counted, still without decoding). :class:`VideoHeaders` caches these facts
beside the data file as :class:`~dflop_ds.data.headers.HeaderSizes` caches image sizes.
:func:`sample_frame_indices` picks frames at a target rate as Qwen2-VL's recipes do, and
:func:`decode_frames` decodes just enough of the file to return them as RGB images.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from dflop_ds.data.errors import PathArg
from dflop_ds.data.headers import HeaderSizes

VIDEO_CACHE_FORMAT = "dflop-ds-video-info-cache"
VIDEO_CACHE_SUFFIX = ".video_info.cache.json"
#: Qwen2-VL's recipe (qwen-vl-utils): 2 frames per second, 4 to 768 frames
DEFAULT_VIDEO_FPS, DEFAULT_VIDEO_MAX_FRAMES, VIDEO_MIN_FRAMES = 2.0, 768, 4


@dataclass(frozen=True)
class VideoInfo:
    """What a video's cost depends on: source ``frames``, frame ``width x height`` and ``fps``."""

    frames: int
    width: int
    height: int
    fps: float


def _import_av() -> Any:
    try:
        import av
    except ImportError as exc:  # pragma: no cover - the extra is part of the test install
        raise OSError("reading video files needs PyAV: pip install 'dflop-ds[video]'") from exc
    return av


def _open(path: PathArg) -> Any:
    av = _import_av()
    try:
        return av.open(str(path))
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise OSError(f"cannot open video {path}: {exc}") from exc


def read_video_info(path: PathArg) -> VideoInfo:
    """The :class:`VideoInfo` of the video file at ``path`` from its first video stream's header.

    Raises:
        OSError: the file cannot be opened or demuxed, has no video stream, or gives no frame
            rate, no frame or an empty frame size.
    """
    av = _import_av()
    with _open(path) as container:
        if not container.streams.video:
            raise OSError(f"{path} has no video stream")
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        width, height = int(stream.codec_context.width), int(stream.codec_context.height)
        frames = int(stream.frames or 0)
        if not frames:  # the container does not record it: count the stream's packets (no decoding)
            try:
                frames = sum(1 for packet in container.demux(stream) if packet.size)
            except (av.FFmpegError, ValueError) as exc:
                raise OSError(f"cannot read the packets of {path}: {exc}") from exc
    if not rate or float(rate) <= 0:
        raise OSError(f"{path}: the video stream gives no frame rate")
    if frames < 1 or width < 1 or height < 1:
        raise OSError(f"{path}: the video stream has {frames} frame(s) of {width}x{height}")
    return VideoInfo(frames, width, height, float(rate))


class VideoHeaders(HeaderSizes):
    """:class:`VideoInfo` of videos under ``video_folder`` through a cache file beside the data file
    (the rate kept as an exact fraction); :meth:`info` looks one up."""

    kind = "video"
    cache_format = VIDEO_CACHE_FORMAT
    value_len = 5

    def read_value(self, full_path: str) -> tuple[int, ...]:
        """``(frames, width, height, fps numerator, fps denominator)`` from the container."""
        info = read_video_info(full_path)
        rate = Fraction(info.fps).limit_denominator(1_000_000)
        return info.frames, info.width, info.height, rate.numerator, rate.denominator

    def info(self, path: str) -> VideoInfo | str:
        """The :class:`VideoInfo` of video ``path``, or a message naming the file and why not."""
        value = self.value(path)
        if isinstance(value, str):
            return value
        frames, width, height, num, den = value
        return VideoInfo(frames, width, height, num / den)


def sampled_frame_count(
    frames: int,
    fps: float,
    *,
    target_fps: float,
    max_frames: int,
    min_frames: int = VIDEO_MIN_FRAMES,
    multiple: int = 2,
) -> int:
    """Frames Qwen2-VL's recipe samples from a video of ``frames`` frames at ``fps``: ``target_fps``
    frames per second of video, at least ``min_frames`` and at most ``max_frames`` (and the
    video's own), rounded down to a ``multiple`` (the temporal patch size); 0 when the video
    has fewer than ``multiple`` frames."""
    if frames < 1 or fps <= 0 or target_fps <= 0 or max_frames < 1:
        raise ValueError(
            f"cannot sample a video of {frames} frame(s) at {fps} fps with target_fps={target_fps}, "
            f"max_frames={max_frames}"
        )
    cap = math.floor(min(max_frames, frames) / multiple) * multiple
    wanted = min(max(frames / fps * target_fps, min_frames), cap, frames)
    return math.floor(wanted / multiple) * multiple


def sample_frame_indices(frames: int, count: int) -> list[int]:
    """``count`` frame indices spread evenly over ``frames`` frames, from the first (as HF samples them)."""
    import torch

    if not 0 < count <= frames:
        raise ValueError(f"cannot sample {count} of {frames} frame(s)")
    return torch.arange(0, frames, frames / count).int().tolist()[:count]


def decode_frames(path: PathArg, indices: Sequence[int]) -> list[Any]:
    """The frames at ``indices`` (ascending) of the video at ``path`` as RGB ``PIL`` images, decoding
    the stream up to the last one only.

    Raises:
        OSError: the file cannot be decoded or ends before the last index.
    """
    av = _import_av()
    wanted = sorted(set(int(i) for i in indices))
    images: dict[int, Any] = {}
    with _open(path) as container:
        if not container.streams.video:
            raise OSError(f"{path} has no video stream")
        try:
            for index, frame in enumerate(container.decode(container.streams.video[0])):
                if index in wanted:
                    images[index] = frame.to_image().convert("RGB")
                if index >= wanted[-1]:
                    break
        except (av.FFmpegError, ValueError) as exc:
            raise OSError(f"cannot decode {path}: {exc}") from exc
    missing = [i for i in wanted if i not in images]
    if missing:
        raise OSError(f"{path} ends before frame {missing[0]} (decoded {len(images)} of the wanted frames)")
    return [images[int(i)] for i in indices]


def decoded_frame_count(path: PathArg) -> int:
    """Frames of the video at ``path`` that decode, every frame of its first video stream decoded
    (what ``dflop-ds validate --deep`` checks a video with).

    Raises:
        OSError: the file cannot be opened, has no video stream, or a frame cannot be decoded.
    """
    av = _import_av()
    with _open(path) as container:
        if not container.streams.video:
            raise OSError(f"{path} has no video stream")
        try:
            return sum(1 for _ in container.decode(container.streams.video[0]))
        except (av.FFmpegError, ValueError) as exc:
            raise OSError(f"cannot decode {path}: {exc}") from exc


__all__ = [
    "VideoHeaders",
    "VideoInfo",
    "decode_frames",
    "decoded_frame_count",
    "read_video_info",
    "sample_frame_indices",
    "sampled_frame_count",
]
