"""Dataset readers: manifest round trips, LLaVA conversations, bad records, skip policy, bundled data."""

from __future__ import annotations

import json
import logging
import pickle
from collections import Counter
from pathlib import Path

import pytest

from dflop_ds.data import (
    DataError,
    SizeDraw,
    detect_format,
    load_frame_table,
    load_size_table,
    read_dataset,
    read_llava,
    read_manifest,
    write_manifest,
)
from dflop_ds.data.manifest import MANIFEST_KEYS
from dflop_ds.data.records import load_records
from dflop_ds.shapes import TINY_POLICY, ShapePolicy

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "data"
#: Counts whitespace-separated words, so expected token counts are easy to read off.
WORDS = ShapePolicy(
    tile_size=336,
    max_tiles=4,
    tokens_per_tile=16,
    max_frames=8,
    tokens_per_frame=16,
    tokenizer=lambda text: len(text.split()),
)


# ---------------------------------------------------------------- manifest


def test_manifest_round_trip(tmp_path: Path) -> None:
    shapes = [
        TINY_POLICY.shape("img", image_sizes=[(640, 480)], text_tokens=30, label_tokens=10),
        TINY_POLICY.shape("multi", image_sizes=[(10, 20), (3000, 200), (5, 5)], text_tokens=9),
        TINY_POLICY.shape("vid", video_frames=1234, text_tokens=40, label_tokens=3),
        TINY_POLICY.shape("txt", text_tokens=12, label_tokens=7),
    ]
    path = tmp_path / "m.jsonl"
    assert write_manifest(path, shapes, source="unit") == 4
    back = read_manifest(path, TINY_POLICY)
    assert list(back) == shapes
    assert back.report.n_read == 4 and back.report.n_skipped == 0
    assert back.record_numbers == [1, 2, 3, 4]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(line["source"] == "unit" for line in lines)
    assert "label_tokens" not in lines[1]  # equal to text_tokens: left out, defaults back


def test_manifest_derives_under_the_given_policy(tmp_path: Path, write_jsonl) -> None:
    path = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "images": [[2000, 2000]], "text_tokens": 5}])
    assert read_manifest(path, ShapePolicy()).pop().encoder_tiles == 10
    assert read_manifest(path, TINY_POLICY).pop().encoder_tiles == 5


def test_manifest_text_is_counted_by_the_policy_tokenizer(tmp_path: Path, write_jsonl) -> None:
    path = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "one two three four", "label_tokens": 2}])
    (shape,) = read_manifest(path, WORDS)
    assert (shape.text_tokens, shape.label_tokens) == (4, 2)


def test_write_manifest_rejects_bad_records(tmp_path: Path) -> None:
    with pytest.raises(DataError) as info:
        write_manifest(tmp_path / "m.jsonl", [{"id": "a", "text_tokens": 3}, {"id": "b", "text_tokens": -3}])
    assert (info.value.record, info.value.field, info.value.sample_id) == (1, "text_tokens", "b")
    with pytest.raises(DataError, match="duplicate"):
        write_manifest(tmp_path / "m.jsonl", [{"id": "a", "text_tokens": 3}, {"id": "a", "text_tokens": 3}])
    assert not (tmp_path / "m.jsonl").exists()


def test_manifest_as_json_array_uses_indices(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text(json.dumps([{"id": "a", "text_tokens": 1}, {"id": "b", "text_tokens": "x"}]))
    with pytest.raises(DataError) as info:
        read_manifest(path)
    assert (info.value.record, info.value.record_kind, info.value.field) == (1, "index", "text_tokens")
    assert "m.json index 1 (id 'b'), field 'text_tokens'" in str(info.value)


# One record of each kind of bad manifest record: (record, field named in the error).
BAD_MANIFEST_RECORDS = [
    ({"images": [], "text_tokens": 3}, "id"),
    ({"id": 7, "text_tokens": 3}, "id"),
    ({"id": "", "text_tokens": 3}, "id"),
    ({"id": "x", "images": [[10, 10]]}, "text_tokens"),
    ({"id": "x", "text_tokens": "12"}, "text_tokens"),
    ({"id": "x", "text_tokens": 12.5}, "text_tokens"),
    ({"id": "x", "text_tokens": -1}, "text_tokens"),
    ({"id": "x", "text_tokens": 3, "text": "a b"}, "text"),
    ({"id": "x", "text": 5}, "text"),
    ({"id": "x", "images": {"w": 1}, "text_tokens": 3}, "images"),
    ({"id": "x", "images": [[10, 10], [-3, 5]], "text_tokens": 3}, "images[1].width"),
    ({"id": "x", "images": [[10, 10], [5, 0]], "text_tokens": 3}, "images[1].height"),
    ({"id": "x", "images": [[10, 10, 3]], "text_tokens": 3}, "images[0]"),
    ({"id": "x", "images": [[True, 10]], "text_tokens": 3}, "images[0].width"),
    ({"id": "x", "images": [[200_000, 10]], "text_tokens": 3}, "images[0].width"),
    ({"id": "x", "video_frames": -2, "text_tokens": 3}, "video_frames"),
    ({"id": "x", "video_frames": 10**8, "text_tokens": 3}, "video_frames"),
    ({"id": "x", "text_tokens": 3, "label_tokens": 4}, "label_tokens"),
    ({"id": "x", "text_tokens": 3, "source": 1}, "source"),
]


@pytest.mark.parametrize("record, field", BAD_MANIFEST_RECORDS)
def test_bad_manifest_record_names_file_line_and_field(tmp_path: Path, record: dict, field: str, write_jsonl) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"id": "ok", "text_tokens": 1}, record])
    with pytest.raises(DataError) as info:
        read_manifest(path)
    error = info.value
    assert (error.path, error.record, error.record_kind, error.field) == (str(path), 2, "line", field)
    assert str(path) in str(error) and "line 2" in str(error) and f"field {field!r}" in str(error)


@pytest.mark.parametrize(
    "line, reason", [("{not json", "malformed JSON"), ("[1, 2]", "JSON object"), ('"text"', "JSON object")]
)
def test_malformed_lines_name_the_line(tmp_path: Path, line: str, reason: str, write_jsonl) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"id": "ok", "text_tokens": 1}, "", line])
    with pytest.raises(DataError, match=reason) as info:
        read_manifest(path)
    assert (info.value.record, info.value.field) == (3, None)  # blank line 2 skipped, still counted


def test_duplicate_id_is_a_bad_record(tmp_path: Path, write_jsonl) -> None:
    path = write_jsonl(
        tmp_path / "dup.jsonl",
        [{"id": "a", "text_tokens": 1}, {"id": "b", "text_tokens": 1}, {"id": "a", "text_tokens": 2}],
    )
    with pytest.raises(DataError, match="duplicate id, first seen at line 1") as info:
        read_manifest(path)
    assert (info.value.record, info.value.sample_id, info.value.field) == (3, "a", "id")


def test_unreadable_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="cannot read") as info:
        read_manifest(tmp_path / "missing.jsonl")
    assert info.value.record is None and info.value.path.endswith("missing.jsonl")
    broken = tmp_path / "broken.json"
    broken.write_text('[{"id": "a", "text_tokens": 1},\n {"id": ')
    with pytest.raises(DataError, match="invalid JSON array") as info:
        read_manifest(broken)
    assert info.value.record == 2


def test_skip_policy_counts_reports_and_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture, write_jsonl) -> None:
    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            {"id": "a", "text_tokens": 1},
            "{oops",
            {"id": "b", "images": [[0, 4], [-1, 3]], "text_tokens": 1},
            {"id": "c", "text_tokens": 2},
            {"id": "a", "text_tokens": 3},
        ],
    )
    with caplog.at_level(logging.WARNING, logger="dflop_ds.data.records"):
        result = read_manifest(path, on_bad_sample="skip")
    assert [s.sample_id for s in result] == ["a", "c"]
    assert result.record_numbers == [1, 4]
    report = result.report
    assert (report.n_records, report.n_read, report.n_skipped) == (5, 2, 3)
    assert report.skipped_records == [2, 3, 5]
    # Every problem of every skipped record is kept, not only the first.
    assert [(e.record, e.field) for e in report.problems] == [
        (2, None),
        (3, "images[0].width"),
        (3, "images[1].width"),
        (5, "id"),
    ]
    assert "skipped 3 bad record(s)" in caplog.text


def test_bad_on_bad_sample_value(tmp_path: Path, write_jsonl) -> None:
    path = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text_tokens": 1}])
    with pytest.raises(ValueError, match="on_bad_sample"):
        read_manifest(path, on_bad_sample="ignore")


def test_data_error_pickles() -> None:
    error = DataError("bad", path="f.jsonl", record=3, sample_id="x", field="images[0]")
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.record, copy.field) == (str(error), 3, "images[0]")
    assert isinstance(copy, ValueError)


# ---------------------------------------------------------------- LLaVA


def conv(*turns: tuple[str, str]) -> list[dict]:
    return [{"from": role, "value": value} for role, value in turns]


def test_llava_text_and_label_tokens(tmp_path: Path, write_jsonl) -> None:
    path = write_jsonl(
        tmp_path / "l.jsonl",
        [
            {
                "id": "t",
                "conversations": conv(
                    ("human", "what is two plus two"), ("gpt", "four"), ("human", "and three"), ("gpt", "five it is")
                ),
            },
            {
                "id": "i",
                "image": "a.jpg",
                "width": 640,
                "height": 480,
                "conversations": conv(("human", "<image>\ndescribe it"), ("gpt", "a red car")),
            },
        ],
    )
    text, image = read_llava(path, WORDS)
    assert (text.text_tokens, text.label_tokens, text.modality) == (5 + 1 + 2 + 3, 1 + 3, "text")
    assert (image.text_tokens, image.label_tokens) == (2 + 3, 3)  # placeholder not counted
    assert image.image_sizes == ((640, 480),) and image.encoder_tiles == 5


def test_llava_image_list_video_and_json_array(tmp_path: Path) -> None:
    path = tmp_path / "l.json"
    path.write_text(
        json.dumps(
            [
                {
                    "id": 1,
                    "image": ["a.jpg", "b.jpg"],
                    "image_sizes": [[100, 100], [1000, 300]],
                    "conversations": conv(("human", "<image><image> compare"), ("gpt", "same")),
                },
                {
                    "id": "v",
                    "video": "clip.mp4",
                    "frame_count": 300,
                    "conversations": conv(("human", "<video> what happens"), ("assistant", "a dog runs")),
                },
                {
                    "id": "v2",
                    "video": "clip2.mp4",
                    "video_frames": 5,
                    "conversations": conv(("human", "<video> ok"), ("gpt", "yes")),
                },
            ]
        )
    )
    multi, video, short = read_llava(path, WORDS)
    assert multi.sample_id == "1" and multi.image_sizes == ((100, 100), (1000, 300))
    assert multi.encoder_tiles == 1 + WORDS.image_tiles(1000, 300)
    assert (video.video_frames, video.encoder_tiles, video.label_tokens) == (300, 8, 3)
    assert (short.video_frames, short.encoder_tiles) == (5, 5)


def test_llava_side_tables_from_dict_and_file(tmp_path: Path, write_jsonl) -> None:
    path = write_jsonl(
        tmp_path / "l.jsonl",
        [
            {"id": "a", "image": "x.jpg", "conversations": conv(("human", "q"), ("gpt", "a"))},
            {
                "id": "b",
                "image": "y.jpg",
                "width": 50,
                "height": 60,
                "conversations": conv(("human", "q"), ("gpt", "a")),
            },
            {"id": "c", "video": "v.mp4", "conversations": conv(("human", "q"), ("gpt", "a"))},
        ],
    )
    table = tmp_path / "sizes.json"
    table.write_text(json.dumps({"x.jpg": [1200, 800], "y.jpg": [1, 1]}))
    frames = tmp_path / "frames.json"
    frames.write_text(json.dumps({"v.mp4": 77}))
    for image_sizes, video_frames in [(table, frames), ({"x.jpg": [1200, 800], "y.jpg": [1, 1]}, {"v.mp4": 77})]:
        a, b, c = read_llava(path, WORDS, image_sizes=image_sizes, video_frames=video_frames, fallback_size=None)
        assert a.image_sizes == ((1200, 800),)
        assert b.image_sizes == ((50, 60),)  # the record wins over the table
        assert c.video_frames == 77


def test_llava_fallbacks(tmp_path: Path, write_jsonl) -> None:
    records = [
        {"id": str(i), "image": f"img{i}.jpg", "conversations": conv(("human", "q"), ("gpt", "a"))} for i in range(40)
    ]
    path = write_jsonl(tmp_path / "l.jsonl", records)
    with pytest.raises(DataError, match="no size for image 'img0.jpg'"):  # no silent default size
        read_llava(path, WORDS)
    assert {s.image_sizes for s in read_llava(path, WORDS, fallback_size=(10, 20))} == {((10, 20),)}
    draw = SizeDraw([(100, 100), (200, 100), (300, 100)], seed=3)
    drawn = read_llava(path, WORDS, fallback_size=draw)
    assert {s.image_sizes[0] for s in drawn} == {(100, 100), (200, 100), (300, 100)}
    # Order-independent: the same image path gets the same size in a shuffled file.
    reversed_path = write_jsonl(tmp_path / "r.jsonl", records[::-1])
    again = {s.sample_id: s.image_sizes for s in read_llava(reversed_path, WORDS, fallback_size=draw)}
    assert {s.sample_id: s.image_sizes for s in drawn} == again
    other_seed = read_llava(path, WORDS, fallback_size=SizeDraw(draw.sizes, seed=4))
    assert [s.image_sizes for s in other_seed] != [s.image_sizes for s in drawn]
    with pytest.raises(DataError, match="no size for image 'img0.jpg'") as info:
        read_llava(path, WORDS, fallback_size=None)
    assert (info.value.record, info.value.field, info.value.sample_id) == (1, "image", "0")


def test_llava_video_frames_fallback(tmp_path: Path, write_jsonl) -> None:
    path = write_jsonl(
        tmp_path / "l.jsonl", [{"id": "v", "video": "v.mp4", "conversations": conv(("human", "q"), ("gpt", "a"))}]
    )
    with pytest.raises(DataError, match="no frame count") as info:
        read_llava(path, WORDS)
    assert info.value.field == "video"
    assert read_llava(path, WORDS, fallback_frames=64)[0].video_frames == 64


BAD_LLAVA_RECORDS = [
    ({"image": "a.jpg", "conversations": conv(("human", "q"), ("gpt", "a"))}, "id"),
    ({"id": "x"}, "conversations"),
    ({"id": "x", "conversations": []}, "conversations"),
    ({"id": "x", "conversations": ["hi"]}, "conversations[0]"),
    (
        {"id": "x", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": 3}]},
        "conversations[1].value",
    ),
    ({"id": "x", "conversations": [{"value": "q"}]}, "conversations[0].from"),
    ({"id": "x", "image": 5, "conversations": conv(("human", "q"), ("gpt", "a"))}, "image"),
    ({"id": "x", "image": ["a.jpg", ""], "conversations": conv(("human", "q"), ("gpt", "a"))}, "image[1]"),
    (
        {
            "id": "x",
            "image": ["a.jpg", "b.jpg"],
            "image_sizes": [[1, 1]],
            "conversations": conv(("human", "q"), ("gpt", "a")),
        },
        "image_sizes",
    ),
    (
        {
            "id": "x",
            "image": ["a.jpg", "b.jpg"],
            "image_sizes": [[1, 1], [0, 1]],
            "conversations": conv(("human", "q"), ("gpt", "a")),
        },
        "image_sizes[1].width",
    ),
    (
        {
            "id": "x",
            "image": ["a.jpg", "b.jpg"],
            "width": 5,
            "height": 5,
            "conversations": conv(("human", "q"), ("gpt", "a")),
        },
        "width",
    ),
    (
        {"id": "x", "image": "a.jpg", "width": 5, "conversations": conv(("human", "q"), ("gpt", "a"))},
        "width/height.height",
    ),
    ({"id": "x", "video": "", "conversations": conv(("human", "q"), ("gpt", "a"))}, "video"),
    (
        {"id": "x", "video": "v.mp4", "frame_count": 0, "conversations": conv(("human", "q"), ("gpt", "a"))},
        "frame_count",
    ),
    (
        {"id": "x", "video": "v.mp4", "video_frames": "9", "conversations": conv(("human", "q"), ("gpt", "a"))},
        "video_frames",
    ),
]


@pytest.mark.parametrize("record, field", BAD_LLAVA_RECORDS)
def test_bad_llava_record_names_file_index_and_field(tmp_path: Path, record: dict, field: str) -> None:
    path = tmp_path / "bad.json"
    good = {"id": "ok", "conversations": conv(("human", "q"), ("gpt", "a"))}
    path.write_text(json.dumps([good, good | {"id": "ok2"}, record]))
    with pytest.raises(DataError) as info:
        read_llava(path)
    error = info.value
    assert (error.path, error.record, error.record_kind, error.field) == (str(path), 2, "index", field)
    assert "bad.json index 2" in str(error) and f"field {field!r}" in str(error)


@pytest.mark.parametrize("table, key", [({"a.jpg": [1, -1]}, "a.jpg.height"), ({"a.jpg": "big"}, "a.jpg")])
def test_bad_side_table_entries(tmp_path: Path, table: dict, key: str) -> None:
    file = tmp_path / "sizes.json"
    file.write_text(json.dumps(table))
    with pytest.raises(DataError) as info:
        load_size_table(file)
    assert (info.value.path, info.value.field) == (str(file), key)
    with pytest.raises(DataError, match="frame"):
        load_frame_table({"v.mp4": -3})
    file.write_text("[1, 2]")
    with pytest.raises(DataError, match="JSON object"):
        load_size_table(file)


# ---------------------------------------------------------------- dispatch


def test_read_dataset_dispatches_on_content(tmp_path: Path, write_jsonl) -> None:
    manifest = write_jsonl(tmp_path / "a.json", [{"id": "m", "text_tokens": 4}])
    llava = write_jsonl(
        tmp_path / "b.jsonl", [{"id": "l", "image": "z.jpg", "conversations": conv(("human", "q"), ("gpt", "r"))}]
    )
    assert read_dataset(manifest, WORDS, fallback_size=None)[0].text_tokens == 4
    (shape,) = read_dataset(llava, WORDS, image_sizes={"z.jpg": [5, 5]})
    assert (shape.sample_id, shape.text_tokens, shape.image_sizes) == ("l", 2, ((5, 5),))
    assert detect_format(load_records(manifest), manifest) == "manifest"
    neither = write_jsonl(tmp_path / "c.jsonl", ["{bad", {"id": "n", "images": []}])
    with pytest.raises(DataError, match="cannot tell the format") as info:
        read_dataset(neither)
    assert info.value.record == 2


# ---------------------------------------------------------------- bundled data

BUNDLED = ["coco", "llava_pretrain", "scienceqa", "alpaca", "nextqa", "multi_image", "mixture"]


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_manifest_loads_numbers_only(name: str) -> None:
    path = EXAMPLES / f"{name}.jsonl"
    shapes = read_manifest(path, TINY_POLICY)
    assert len(shapes) >= 900 and shapes.report.n_skipped == 0
    for line in path.read_text().splitlines():
        record = json.loads(line)
        assert set(record) <= set(MANIFEST_KEYS)  # no text ships
        if name != "mixture":
            assert record["id"].startswith(f"{name}-") and record["source"] == name


def test_bundled_files_are_small() -> None:
    total = sum(p.stat().st_size for p in EXAMPLES.iterdir() if p.is_file())
    assert total < 2 * 1024 * 1024


def test_bundled_mixture_has_the_advertised_modalities() -> None:
    shapes = read_manifest(EXAMPLES / "mixture.jsonl", TINY_POLICY)
    counts = Counter(s.modality for s in shapes)
    shares = {kind: counts[kind] / len(shapes) for kind in counts}
    assert len(shapes) == 3000
    for kind, share in {"image": 0.40, "text": 0.20, "multi_image": 0.15, "video": 0.25}.items():
        assert shares[kind] == pytest.approx(share, abs=0.02)
    multi = [s for s in shapes if s.modality == "multi_image"]
    assert {len(s.image_sizes) for s in multi} == {2, 3, 4}
    assert all(s.video_frames > TINY_POLICY.max_frames for s in shapes if s.modality == "video")
    sources = Counter(json.loads(line)["source"] for line in (EXAMPLES / "mixture.jsonl").read_text().splitlines())
    assert set(sources) == set(BUNDLED) - {"mixture"}
    assert all(0 <= s.label_tokens <= s.text_tokens for s in shapes)


def test_records_with_nothing_to_learn_are_bad_records(tmp_path: Path, write_jsonl) -> None:
    path = write_jsonl(
        tmp_path / "l.jsonl",
        [
            {"id": "ok", "conversations": conv(("human", "q"), ("gpt", "a"))},
            {"id": "no-answer", "conversations": conv(("human", "what is it"))},
            {"id": "empty", "conversations": conv(("human", "q"), ("gpt", "  "))},
        ],
    )
    with pytest.raises(DataError, match="no assistant turn") as info:
        read_llava(path, WORDS)
    assert (info.value.record, info.value.sample_id, info.value.field) == (2, "no-answer", "conversations")
    kept = read_llava(path, WORDS, on_bad_sample="skip")
    assert [s.sample_id for s in kept] == ["ok"] and kept.report.n_skipped == 2
    messages = [str(p) for p in kept.report.problems]
    assert "l.jsonl line 3 (id 'empty'), field 'conversations': has only empty assistant turns" in messages[-1]
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "m", "text_tokens": 4, "label_tokens": 0}])
    with pytest.raises(DataError, match="'label_tokens': is 0"):
        read_manifest(manifest, TINY_POLICY)
