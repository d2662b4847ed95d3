"""The benchmark's users' mixture (dflop_ds.testing.mixture_data): rows drawn from a shape manifest
keep its modalities, image counts and token counts on the tiny models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflop_ds.testing.mixture_data import frames_of, write_mixture_dataset

MIXTURE = Path(__file__).resolve().parent.parent / "examples" / "data" / "mixture.jsonl"


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    """40 records drawn from the bundled mixture, their shapes on the tiny LLaVA, and the manifest rows."""
    from dflop_ds.hf_trainer import llava_json_shapes
    from dflop_ds.testing.hf_tiny import build_tiny_llava

    root = tmp_path_factory.mktemp("mixture")
    data, images = write_mixture_dataset(root / "data", MIXTURE, 40, seed=4, max_text_tokens=320)
    manifest = {row["id"]: row for row in map(json.loads, MIXTURE.read_text().splitlines())}
    shapes = llava_json_shapes(data, str(build_tiny_llava(root / "model")), image_folder=images)
    return json.loads(data.read_text()), shapes, manifest


def test_frames_are_one_per_stride_within_the_bounds():
    assert [frames_of(f, 120, 4, 16) for f in (100, 600, 1020, 1919, 1920, 5395)] == [4, 5, 8, 15, 16, 16]


def test_drawn_rows_keep_the_manifest_modalities_and_image_counts(mixture):
    records, _, manifest = mixture
    assert len({r["id"] for r in records}) == 40  # drawn without replacement
    kinds = set()
    for record in records:
        row = manifest[record["id"]]
        images = record.get("image") or []
        images = [images] if isinstance(images, str) else images
        if "video_frames" in row:
            assert len(images) == frames_of(row["video_frames"], 120, 4, 16), record["id"]
            kinds.add("video")
        else:
            assert len(images) == len(row.get("images") or []), record["id"]
            kinds.add(len(images) if len(images) < 2 else "multi")
    assert kinds == {0, 1, "multi", "video"}


def test_drawn_rows_keep_the_manifest_token_counts_on_the_tiny_tokenizer(mixture):
    records, shapes, manifest = mixture
    got = want = 0
    for record, shape in zip(records, shapes):
        row = manifest[record["id"]]
        text = min(row["text_tokens"], 319)
        label = max(1, min(row["label_tokens"], 320 - text))
        # a word is 1-5 tokens, and the answer's turn adds its end tokens
        assert abs(shape.label_tokens - label) <= 0.3 * label + 6, (record["id"], shape.label_tokens, label)
        got, want = got + shape.label_tokens, want + label
    assert abs(got - want) <= 0.2 * want


def test_more_records_than_the_manifest_holds_is_an_error_naming_it(tmp_path):
    manifest = tmp_path / "small.jsonl"
    manifest.write_text('{"id": "a", "text_tokens": 5, "label_tokens": 2}\n')
    with pytest.raises(ValueError, match="small.jsonl: 2 records asked, the manifest has 1"):
        write_mixture_dataset(tmp_path / "out", manifest, 2)
