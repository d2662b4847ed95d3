"""Short real video files for tests and benchmarks, encoded in-process with PyAV (the ``video`` extra)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dflop_ds.data.errors import PathArg


def write_video(
    path: PathArg, *, frames: int, width: int, height: int, fps: int = 4, codec: str = "mpeg4", seed: int = 0
) -> Path:
    """Encode ``frames`` random RGB frames of ``width x height`` (even sizes: yuv420p) at ``fps`` into
    ``path`` (the container from its suffix, e.g. ``.mp4``) and return it."""
    import av

    if width % 2 or height % 2:
        raise ValueError(f"write_video: yuv420p needs even frame sizes, got {width}x{height}")
    rng = np.random.default_rng(seed)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(out), mode="w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(frames):
            pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out


__all__ = ["write_video"]
