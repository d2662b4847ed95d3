"""A small LLaVA-format dataset with real image files, written to disk for tests, demos and benchmarks.

Records mix text-only chats, single images, several images and multi-turn conversations; the
images are real PNG and JPEG files of varied sizes (random noise, so nothing is downloaded).
Conversations follow LLaVA's JSON layout: ``{"id", "image": path | [paths], "conversations":
[{"from": "human", "value": "<image>\\n..."}, {"from": "gpt", "value": "..."}]}``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "the a cat dog red blue small large photo picture shows sits on table grass sky tree car road "
    "person holds looks at near under next to what is in this image describe it color count how many "
    "two three left right top bottom bright dark"
).split()


def _sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def _write_image(path: Path, rng: random.Random, width: int, height: int) -> None:
    from PIL import Image

    raw = bytes(rng.getrandbits(8) for _ in range(width * height * 3))
    Image.frombytes("RGB", (width, height), raw).save(path)


def write_llava_dataset(
    directory: str | Path,
    n_records: int = 48,
    *,
    seed: int = 0,
    max_images: int = 3,
    answer_words: tuple[int, int] = (3, 40),
    text_only: float = 0.25,
) -> tuple[Path, Path]:
    """Write ``n_records`` LLaVA records and their images under ``directory``.

    Returns ``(data_path, image_folder)``: ``directory/data.json`` and ``directory/images``.
    A ``text_only`` share of the records (default a quarter) has no image, the rest hold 1..``max_images`` images
    (sizes 24-400 px per side, PNG or JPEG) placed inside the first human turn; a third of the
    chats have two rounds. Answers have ``answer_words`` words.
    """
    rng = random.Random(seed)
    root = Path(directory)
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n_records):
        n_images = 0 if rng.random() < text_only else rng.randint(1, max_images)
        paths = []
        for j in range(n_images):
            name = f"{i:04d}_{j}.{'png' if rng.random() < 0.6 else 'jpg'}"
            _write_image(images / name, rng, rng.randint(24, 400), rng.randint(24, 400))
            paths.append(name)
        question = _sentence(rng, 3, 12)
        prompt = "".join("<image>\n" for _ in paths) + question
        turns = [{"from": "human", "value": prompt}, {"from": "gpt", "value": _sentence(rng, *answer_words)}]
        if rng.random() < 0.33:
            turns += [
                {"from": "human", "value": _sentence(rng, 2, 8)},
                {"from": "gpt", "value": _sentence(rng, *answer_words)},
            ]
        records.append(llava_record(f"r{i:04d}", turns, paths))
    return write_records(root, records), images


def llava_record(record_id: str, turns: list[dict], images: list[str]) -> dict:
    """A LLaVA record: ``id``, ``conversations`` and, when it has any, ``image`` (one name or a list)."""
    record: dict = {"id": record_id, "conversations": turns}
    if images:
        record["image"] = images[0] if len(images) == 1 else images
    return record


def write_records(root: Path, records: list[dict]) -> Path:
    """Write ``records`` as LLaVA JSON to ``root/data.json``; returns its path."""
    data_path = root / "data.json"
    data_path.write_text(json.dumps(records, indent=1))
    return data_path
