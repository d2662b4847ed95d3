"""Build the bundled shape manifests (numbers only) from the public metadata in shared/data.

Run from the repo root::

    .venv/bin/python examples/data/build_manifests.py --shared ../shared/data --out examples/data

Every output line holds sizes, frame counts and token counts; no text leaves this script (the
sources' licences allow shipping derived numbers, not their text). Token counts use
``dflop_ds.shapes.default_token_count`` (one token per 4 UTF-8 bytes). All draws are seeded, so
a rebuild reproduces the files byte for byte. See README.md next to this script.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
if str(REPO_ROOT) not in sys.path:  # runnable as a script without installing the package
    sys.path.insert(0, str(REPO_ROOT))

from dflop_ds.data import SizeDraw, read_llava, write_manifest  # noqa: E402 - after the sys.path fallback above
from dflop_ds.data.llava import conversation_tokens  # noqa: E402 - after the sys.path fallback above
from dflop_ds.data.manifest import manifest_record  # noqa: E402 - after the sys.path fallback above
from dflop_ds.shapes import SampleShape, ShapePolicy  # noqa: E402 - after the sys.path fallback above

DEFAULT_SHARED = REPO_ROOT.parent / "shared" / "data"

#: Token counting only (tiling is irrelevant here: manifests store raw sizes).
COUNTING = ShapePolicy()

#: Our own fixed prompts (the sources' captions are answers; the prompt makes them a turn).
CAPTION_PROMPT = "<image>\nDescribe this image in one short sentence."
MULTI_PROMPT = "Describe each of these images in one short sentence, in order."

#: Subsample sizes, chosen to keep all shipped files together under ~2 MB.
N_COCO = 2000
N_LLAVA_PRETRAIN = 1500
N_SCIENCEQA = 2000
N_NEXTQA = 2000
N_MULTI = 1000
N_MIXTURE = 3000
#: Mixture share per modality (sums to 1).
MIXTURE_SHARES = {"image": 0.40, "text": 0.20, "multi_image": 0.15, "video": 0.25}

Record = dict[str, Any]


def load_coco(shared: Path) -> tuple[dict[int, tuple[int, int]], dict[int, list[str]]]:
    """COCO val2017: image id -> (width, height), and image id -> its captions."""
    data = json.loads((shared / "coco_captions_val2017.json").read_text(encoding="utf-8"))
    sizes = {img["id"]: (int(img["width"]), int(img["height"])) for img in data["images"]}
    captions: dict[int, list[str]] = defaultdict(list)
    for ann in data["annotations"]:
        captions[ann["image_id"]].append(ann["caption"])
    return sizes, captions


def shape_record(
    sample_id: str,
    source: str,
    turns: Sequence[tuple[str, str]],
    *,
    images: Sequence[tuple[int, int]] = (),
    video_frames: int = 0,
) -> Record:
    """A manifest record (numbers only) of a conversation with the given media."""
    text_tokens, label_tokens = conversation_tokens(turns, COUNTING)
    shape = COUNTING.shape(
        sample_id, image_sizes=images, video_frames=video_frames, text_tokens=text_tokens, label_tokens=label_tokens
    )
    return manifest_record(shape, source)


def build_coco(rng: random.Random, sizes: dict, captions: dict) -> list[Record]:
    """One image, one randomly chosen caption as the answer to a fixed prompt."""
    image_ids = rng.sample(sorted(sizes), N_COCO)
    return [
        shape_record(
            f"coco-{image_id}",
            "coco",
            [("human", CAPTION_PROMPT), ("gpt", rng.choice(captions[image_id]))],
            images=[sizes[image_id]],
        )
        for image_id in image_ids
    ]


def build_multi_image(rng: random.Random, sizes: dict, captions: dict) -> list[Record]:
    """Synthesized: 2-4 distinct COCO images per sample, answered by one caption of each."""
    ids = sorted(sizes)
    records = []
    for index in range(N_MULTI):
        chosen = rng.sample(ids, rng.randint(2, 4))
        prompt = "<image>\n" * len(chosen) + MULTI_PROMPT
        answer = "\n".join(f"{k + 1}. {rng.choice(captions[i])}" for k, i in enumerate(chosen))
        records.append(
            shape_record(
                f"multi_image-{index}",
                "multi_image",
                [("human", prompt), ("gpt", answer)],
                images=[sizes[i] for i in chosen],
            )
        )
    return records


def build_llava_file(rng: random.Random, path: Path, source: str, n: int, draw: SizeDraw) -> list[Record]:
    """A LLaVA file read with image sizes drawn from the COCO distribution, subsampled."""
    shapes: list[SampleShape] = read_llava(path, COUNTING, fallback_size=draw)
    picked = sorted(rng.sample(range(len(shapes)), min(n, len(shapes))))
    records = []
    for i in picked:
        record = manifest_record(shapes[i], source)
        record["id"] = f"{source}-{shapes[i].sample_id}"
        records.append(record)
    return records


def build_alpaca(shared: Path) -> list[Record]:
    """Text-only instructions: instruction (+ input) asked, output answered."""
    items = json.loads((shared / "llamafactory_alpaca_en_demo.json").read_text(encoding="utf-8"))
    records = []
    for index, item in enumerate(items):
        question = item["instruction"] + ("\n" + item["input"] if item.get("input") else "")
        records.append(shape_record(f"alpaca-{index}", "alpaca", [("human", question), ("gpt", item["output"])]))
    return records


def build_nextqa(rng: random.Random, shared: Path) -> list[Record]:
    """Video QA: the question with its five options asked, the correct option answered."""
    with open(shared / "nextqa_val.csv", newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    records = []
    for row in sorted(rng.sample(rows, N_NEXTQA), key=lambda r: (r["video"], int(r["qid"]))):
        options = "\n".join(f"{k}. {row[f'a{k}']}" for k in range(5))
        question = f"<video>\n{row['question']}?\n{options}"
        answer = row[f"a{int(row['answer'])}"]
        records.append(
            shape_record(
                f"nextqa-{row['video']}-{row['qid']}",
                "nextqa",
                [("human", question), ("gpt", answer)],
                video_frames=int(row["frame_count"]),
            )
        )
    return records


def modality(record: Record) -> str:
    """``text``, ``image``, ``multi_image`` or ``video`` of a manifest record."""
    if record.get("video_frames", 0) > 0:
        return "video"
    n_images = len(record.get("images", []))
    return "text" if n_images == 0 else "image" if n_images == 1 else "multi_image"


def build_mixture(rng: random.Random, files: dict[str, list[Record]]) -> list[Record]:
    """Draw ``N_MIXTURE`` records by modality share from all the other files, shuffled."""
    pools: dict[str, list[Record]] = defaultdict(list)
    for name in sorted(files):
        for record in files[name]:
            pools[modality(record)].append(record)
    counts = {kind: round(share * N_MIXTURE) for kind, share in MIXTURE_SHARES.items()}
    mixture = [record for kind, count in counts.items() for record in rng.sample(pools[kind], count)]
    rng.shuffle(mixture)
    return mixture


def build_all(shared: Path, seed: int = 0) -> dict[str, list[Record]]:
    """Every bundled manifest, by file stem."""
    sizes, captions = load_coco(shared)
    # One entry per COCO image, so common sizes are drawn as often as they occur.
    draw = SizeDraw([sizes[i] for i in sorted(sizes)], seed=seed)

    def rng(name: str) -> random.Random:
        return random.Random(f"{seed}:{name}")

    files = {
        "coco": build_coco(rng("coco"), sizes, captions),
        "llava_pretrain": build_llava_file(
            rng("llava_pretrain"),
            shared / "llava_pretrain_blip_laion_cc_sbu_2k.json",
            "llava_pretrain",
            N_LLAVA_PRETRAIN,
            draw,
        ),
        "scienceqa": build_llava_file(
            rng("scienceqa"), shared / "llava_scienceqa_test_CQM-A.json", "scienceqa", N_SCIENCEQA, draw
        ),
        "alpaca": build_alpaca(shared),
        "nextqa": build_nextqa(rng("nextqa"), shared),
        "multi_image": build_multi_image(rng("multi_image"), sizes, captions),
    }
    files["mixture"] = build_mixture(rng("mixture"), files)
    return files


def main(argv: Sequence[str] | None = None) -> int:
    """Build and write the manifests; print one summary line per file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", type=Path, default=DEFAULT_SHARED, help="folder of the source files")
    parser.add_argument("--out", type=Path, default=HERE, help="output folder")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, records in build_all(args.shared, args.seed).items():
        path = args.out / f"{name}.jsonl"
        n = write_manifest(path, records)
        kinds: dict[str, int] = defaultdict(int)
        for record in records:
            kinds[modality(record)] += 1
        print(f"{path}: {n} samples, {path.stat().st_size / 1024:.0f} KiB, {dict(sorted(kinds.items()))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
