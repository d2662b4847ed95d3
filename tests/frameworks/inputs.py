"""Tiny inputs for the framework runs, built offline: HF LLaVA and Qwen2-VL checkpoints
(``save_pretrained`` of :mod:`dflop_ds.testing` builders) and one chat dataset with real image files
in each framework's own format.

ms-swift reads ``{"messages": [{"role", "content"}], "images": [paths]}`` JSONL; LLaMA-Factory reads
the same records through a ``dataset_info.json`` entry (sharegpt layout, ``messages`` / ``images``
columns, ``role`` / ``content`` tags). Image placeholders are ``<image>`` in both.

``--mixture MANIFEST`` draws the rows from a shape manifest instead (the benchmark's
examples/data/mixture.jsonl: text-only, image, multi-image and video rows, a video's frames as images;
:mod:`dflop_ds.testing.mixture_data`).

``--width N`` makes both models N times wider (the same layers and head size), so that compute
outweighs ZeRO-3's per-module gathers (`make bench-frameworks`).

Usage: python tests/frameworks/inputs.py OUT [--records N] [--encoder-heavy] [--mixture MANIFEST] [--width N]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROLES = {"human": "user", "gpt": "assistant"}
#: Qwen2-VL's real 14 px patches (the frameworks resize images to multiples of 28 themselves) and a
#: pixel range the runs set as MIN_PIXELS / MAX_PIXELS too, so the shapes count the tokens trained
QWEN_PATCH, QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 14, 4 * 28 * 28, 8 * 28 * 28
#: the smallest image side the dataset keeps
MIN_SIDE = 56


def chat_records(llava_records: list[dict], images: Path) -> list[dict]:
    """LLaVA records as ``messages`` / ``images`` chat records with absolute image paths."""
    out = []
    for record in llava_records:
        names = record.get("image") or []
        names = [names] if isinstance(names, str) else names
        messages = [{"role": ROLES[turn["from"]], "content": turn["value"]} for turn in record["conversations"]]
        out.append({"messages": messages, "images": [str(images / name) for name in names]})
    return out


def enlarge_small_images(folder: Path, side: int) -> None:
    """Re-save every image of ``folder`` with a side below ``side`` px at least that large
    (qwen_vl_utils, which ms-swift resizes Qwen2-VL images with, refuses sides below 28 px)."""
    from PIL import Image

    for path in sorted(folder.iterdir()):
        with Image.open(path) as image:
            width, height = image.size
            if min(width, height) < side:
                image.convert("RGB").resize((max(width, side), max(height, side))).save(path)


def build(
    out: Path, records: int, encoder_heavy: bool = False, mixture: Path | None = None, width: int = 1
) -> dict[str, str]:
    """Write the models and the dataset under ``out``; returns their paths by name. ``encoder_heavy``:
    both models are the encoder-heavy ones (the LLaVA's vision tower about half the work, Qwen2-VL's
    about 3x the LLM's per image token, as the benchmark's);
    ``mixture``: the rows are drawn from this shape manifest; ``width``: both models that many times
    wider (:func:`dflop_ds.testing.hf_tiny.widened`; with ``encoder_heavy`` only)."""
    from dflop_ds.testing.hf_tiny import build_encoder_heavy_llava, build_tiny_llava
    from dflop_ds.testing.llava_data import write_llava_dataset
    from dflop_ds.testing.mixture_data import write_mixture_dataset
    from dflop_ds.testing.qwen2_vl_tiny import build_tiny_qwen2_vl

    out.mkdir(parents=True, exist_ok=True)
    if width > 1 and not encoder_heavy:
        raise ValueError("--width widens the encoder-heavy models: pass --encoder-heavy with it")
    qwen = build_tiny_qwen2_vl(
        out / "qwen2_vl",
        min_pixels=QWEN_MIN_PIXELS,
        max_pixels=QWEN_MAX_PIXELS,
        patch_size=QWEN_PATCH,
        width=width,
        encoder_heavy=encoder_heavy,
    )
    llava = build_encoder_heavy_llava(out / "llava", width=width) if encoder_heavy else build_tiny_llava(out / "llava")
    paths = {"llava": str(llava), "qwen2_vl": str(qwen)}
    if mixture is not None:
        data, images = write_mixture_dataset(out / "data", mixture, records, seed=3, min_side=MIN_SIDE)
    else:
        data, images = write_llava_dataset(out / "data", records, seed=3, text_only=0.25, answer_words=(3, 20))
    enlarge_small_images(Path(images), MIN_SIDE)
    chats = chat_records(json.loads(Path(data).read_text()), Path(images).resolve())
    jsonl = out / "data" / "chat.jsonl"
    jsonl.write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    info = {
        "dflop_chat": {
            "file_name": jsonl.name,
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "images": "images"},
            "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"},
        }
    }
    (out / "data" / "dataset_info.json").write_text(json.dumps(info, indent=1))
    paths.update(data=str(jsonl), dataset_dir=str(out / "data"))
    (out / "inputs.json").write_text(json.dumps(paths, indent=1))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--records", type=int, default=28)
    parser.add_argument("--encoder-heavy", action="store_true", help="the encoder-heavy tiny LLaVA and Qwen2-VL")
    parser.add_argument("--mixture", type=Path, default=None, help="draw the rows from this shape manifest")
    parser.add_argument("--width", type=int, default=1, help="both models this many times wider (same layers)")
    cli = parser.parse_args()
    print(json.dumps(build(cli.out, cli.records, cli.encoder_heavy, cli.mixture, cli.width)))


if __name__ == "__main__":
    main()
