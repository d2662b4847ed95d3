"""Short real video files for tests and benchmarks, encoded in-process with PyAV (the ``video`` extra)."""

from __future__ import annotations

import json
import random
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


def add_video_records(
    data_path: PathArg,
    video_folder: PathArg,
    n_videos: int,
    *,
    seed: int = 0,
    frames: tuple[int, int] = (4, 12),
    side: tuple[int, int] = (16, 64),
    fps: int = 4,
) -> list[str]:
    """Append ``n_videos`` LLaVA-Video records (``"video"``: a path under ``video_folder``) to the
    LLaVA JSON array at ``data_path``, each with a short real video (``frames`` frames of even sides
    within ``side`` at ``fps``) written under ``video_folder``; returns their ids. Half the records
    mark the video with ``<video>``, half with ``<image>`` as LLaVA-Video's data does."""
    from dflop_ds.testing.llava_data import WORDS

    rng = random.Random(seed)
    path = Path(data_path)
    records = json.loads(path.read_text())
    ids = []
    for i in range(n_videos):
        name = f"clip_{seed}_{i:03d}.mp4"
        width, height = (2 * (rng.randint(*side) // 2) for _ in range(2))
        write_video(
            Path(video_folder) / name,
            frames=rng.randint(*frames),
            width=width,
            height=height,
            fps=fps,
            seed=seed * 1000 + i,
        )
        mark = "<video>" if i % 2 == 0 else "<image>"
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20)))
        ids.append(f"video{seed}_{i:03d}")
        records.append(
            {
                "id": ids[-1],
                "video": name,
                "conversations": [{"from": "human", "value": f"{mark}\n{question}"}, {"from": "gpt", "value": answer}],
            }
        )
    path.write_text(json.dumps(records, indent=1))
    return ids


__all__ = ["add_video_records", "write_video"]
