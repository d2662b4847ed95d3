"""A LLaVA-format dataset whose shapes follow a bundled shape manifest (``examples/data/mixture.jsonl``:
text-only, one-image, multi-image and video rows in the proportions and sizes users train on), with
real image files, for the framework benchmarks.

Each drawn manifest row becomes a chat of the same token counts on the tiny models' tokenizers
(:data:`TOKENS_PER_WORD`), its images written at ``image_scale`` of their real sizes, and a video
row becomes a list of frames, one image each (how video rows reach frameworks whose plugins shape
images only): one frame per ``frame_stride`` of its real frame count, between ``min_frames`` and
``max_frames``, so the longest videos are the heaviest rows, as in training.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from dflop_ds.testing.llava_data import WORDS, llava_record, write_records

#: tokens per word of :data:`~dflop_ds.testing.llava_data.WORDS` on the tiny LLaVA and Qwen2-VL
#: tokenizers (77 and 78 tokens for 24 words, measured)
TOKENS_PER_WORD = 3.2
#: a video frame's size before ``image_scale`` (the manifests hold frame counts, not sizes)
FRAME_SIZE = (640, 360)


def _words(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, round(tokens / TOKENS_PER_WORD))))


def _write_image(path: Path, rng: random.Random, width: int, height: int) -> None:
    from PIL import Image

    Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3)).save(path)


def frames_of(frames: int, frame_stride: int, min_frames: int, max_frames: int) -> int:
    """Frames kept of a video of ``frames``: one per ``frame_stride``, within ``[min_frames, max_frames]``."""
    return max(min_frames, min(max_frames, frames // frame_stride))


def write_mixture_dataset(
    directory: str | Path,
    manifest: str | Path,
    n_records: int,
    *,
    seed: int = 0,
    image_scale: float = 0.25,
    min_side: int = 56,
    frame_stride: int = 120,
    min_frames: int = 4,
    max_frames: int = 16,
    max_text_tokens: int = 320,
) -> tuple[Path, Path]:
    """Write ``n_records`` LLaVA records drawn (seeded, without replacement) from ``manifest`` and
    their images under ``directory``; returns ``(directory/data.json, directory/images)``.

    A row's text and label tokens keep their counts up to ``max_text_tokens`` together (the answer
    is shortened first); image sides are scaled by ``image_scale``, at least ``min_side`` px."""
    rows = [json.loads(line) for line in Path(manifest).read_text().splitlines() if line.strip()]
    if n_records > len(rows):
        raise ValueError(f"{manifest}: {n_records} records asked, the manifest has {len(rows)}")
    rng = random.Random(seed)
    root = Path(directory)
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    records = []
    for i, row in enumerate(rng.sample(rows, n_records)):
        sizes = [tuple(size) for size in row.get("images") or []]
        if "video_frames" in row:
            sizes = [FRAME_SIZE] * frames_of(int(row["video_frames"]), frame_stride, min_frames, max_frames)
        paths = []
        for j, (width, height) in enumerate(sizes):
            name = f"{i:04d}_{j}.{'jpg' if 'video_frames' in row else 'png'}"
            scaled = (max(min_side, round(width * image_scale)), max(min_side, round(height * image_scale)))
            _write_image(images / name, rng, *scaled)
            paths.append(name)
        text = min(int(row["text_tokens"]), max_text_tokens - 1)
        label = max(1, min(int(row["label_tokens"]), max_text_tokens - text))
        prompt = "".join("<image>\n" for _ in paths) + _words(rng, text)
        turns = [{"from": "human", "value": prompt}, {"from": "gpt", "value": _words(rng, label)}]
        records.append(llava_record(f"{row['id']}", turns, paths))
    return write_records(root, records), images


__all__ = ["FRAME_SIZE", "TOKENS_PER_WORD", "frames_of", "write_mixture_dataset"]
