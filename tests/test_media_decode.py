"""Hostile media files that pass a header check: truncated PNG/JPEG, corrupt and truncated videos,
frame counts that disagree with the file, decompression bombs and 16-bit images. ``validate --deep``
decodes every file and names each bad one; plain ``validate`` decodes a sample."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dflop_ds.commands.main import main as cli_main
from dflop_ds.data import DataError, read_dataset, validate_dataset
from dflop_ds.data.decode import SAMPLED_DECODES
from dflop_ds.data.headers import cache_path_for
from dflop_ds.data.images import MAX_PIXELS_ENV, load_rgb
from dflop_ds.shapes import TINY_POLICY
from dflop_ds.testing.video import write_video


def conv(question: str = "<image>\nwhat is it?") -> list[dict]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": "a thing"}]


def write_image(path: Path, size: tuple[int, int], seed: int = 0) -> Path:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return path


def cut(path: Path, keep: float) -> Path:
    """Keep the first ``keep`` share of the file's bytes (its header survives)."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


@pytest.fixture()
def hostile(tmp_path: Path, write_jsonl):
    """A LLaVA JSONL file whose images and videos all have good headers; records 2, 4, 6 and 7
    hold a truncated PNG, a truncated JPEG, a video with a corrupt stream and a truncated AVI."""
    images, videos = tmp_path / "images", tmp_path / "videos"
    for name in ("good.png", "cut.png", "good.jpg", "cut.jpg"):
        write_image(images / name, (120, 90), seed=len(name))
    cut(images / "cut.png", 0.5)
    cut(images / "cut.jpg", 0.5)
    write_video(videos / "good.mp4", frames=12, width=32, height=24)
    corrupt = write_video(videos / "corrupt.mp4", frames=12, width=32, height=24, seed=1)
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 3 : len(data) // 3 + 1500] = b"\x55" * 1500  # the header (at the end) stays intact
    corrupt.write_bytes(bytes(data))
    cut(write_video(videos / "cut.avi", frames=20, width=32, height=24, seed=2), 0.5)  # header keeps 20
    records = [
        {"id": "a", "image": "good.png", "conversations": conv()},
        {"id": "b", "image": "cut.png", "conversations": conv()},
        {"id": "c", "image": ["good.jpg", "good.png"], "conversations": conv("<image><image> both?")},
        {"id": "d", "image": ["good.png", "cut.jpg"], "conversations": conv("<image><image> both?")},
        {"id": "e", "video": "good.mp4", "conversations": conv("<video> what?")},
        {"id": "f", "video": "corrupt.mp4", "conversations": conv("<video> what?")},
        {"id": "g", "video": "cut.avi", "conversations": conv("<video> what?")},
    ]
    return write_jsonl(tmp_path / "data.jsonl", records), images, videos


def test_headers_pass_but_a_deep_validate_names_every_file_that_does_not_decode(hostile) -> None:
    data, images, videos = hostile
    assert len(read_dataset(data, TINY_POLICY, image_folder=images, video_folder=videos)) == 7  # headers are fine
    problems = validate_dataset(data, TINY_POLICY, image_folder=images, video_folder=videos, decode=None)
    found = {(p.record, p.sample_id, p.field): p.message for p in problems}
    assert set(found) == {(2, "b", "image"), (4, "d", "image[1]"), (6, "f", "video"), (7, "g", "video")}
    assert f"cannot decode image {images / 'cut.png'}" in found[2, "b", "image"]
    assert "truncated" in found[2, "b", "image"] and str(images / "cut.jpg") in found[4, "d", "image[1]"]
    assert f"cannot decode video {videos / 'corrupt.mp4'}" in found[6, "f", "video"]
    assert "decodes to" in found[7, "g", "video"] and "its sample counts 20" in found[7, "g", "video"]
    assert str(problems[0]).startswith(f"{data} line 2 (id 'b'), field 'image': cannot decode image")
    # decode=0 is the header-only check: nothing found
    assert validate_dataset(data, TINY_POLICY, image_folder=images, video_folder=videos, decode=0) == []


def test_plain_validate_decodes_a_sample_spread_over_the_file(tmp_path: Path, write_jsonl) -> None:
    images = tmp_path / "images"
    records = []
    for i in range(3 * SAMPLED_DECODES):
        write_image(images / f"{i}.png", (20, 20), seed=i)
        records.append({"id": f"r{i}", "image": f"{i}.png", "conversations": conv()})
    cut(images / f"{3 * SAMPLED_DECODES - 1}.png", 0.5)  # the last file is always in the sample
    data = write_jsonl(tmp_path / "data.jsonl", records)
    (problem,) = validate_dataset(data, TINY_POLICY, image_folder=images)
    assert (problem.sample_id, problem.field) == (f"r{3 * SAMPLED_DECODES - 1}", "image")
    cut(images / "1.png", 0.5)  # not in the sample: only --deep finds it
    assert len(validate_dataset(data, TINY_POLICY, image_folder=images)) == 1
    assert len(validate_dataset(data, TINY_POLICY, image_folder=images, decode=None)) == 2


def test_validate_deep_on_the_command_line_shows_progress_and_exits_1(hostile, capsys) -> None:
    data, images, videos = hostile
    args = ["validate", str(data), "--policy", "tiny", "--image-folder", str(images), "--video-folder", str(videos)]
    assert cli_main([*args, "--deep"]) == 1
    out, err = capsys.readouterr()
    assert "decoding media files" in err
    assert "4 problem(s) in 4 record(s)" in out and "line 7 (id 'g'), field 'video'" in out


@pytest.mark.parametrize("key", ["video_frames", "frame_count"])
@pytest.mark.parametrize("recorded", [5, 40])
def test_a_frame_count_that_disagrees_with_the_file_is_refused_naming_both(tmp_path, write_jsonl, key, recorded):
    videos = tmp_path / "videos"
    write_video(videos / "v.mp4", frames=20, width=16, height=12)
    record = {"id": "v", "video": "v.mp4", key: recorded, "conversations": conv("<video> what?")}
    data = write_jsonl(tmp_path / "data.jsonl", [record])
    with pytest.raises(DataError) as info:
        read_dataset(data, TINY_POLICY, video_folder=videos)
    assert (info.value.sample_id, info.value.field) == ("v", "video")
    assert f"the record's {key!r} gives {recorded} frame(s) for video 'v.mp4'" in info.value.reason
    assert f"{videos / 'v.mp4'} has 20" in info.value.reason
    table = tmp_path / "frames.json"
    table.write_text(json.dumps({"v.mp4": recorded}))
    del record[key]
    data = write_jsonl(tmp_path / "data.jsonl", [record])
    with pytest.raises(DataError, match=f"the video_frames table gives {recorded} frame"):
        read_dataset(data, TINY_POLICY, video_folder=videos, video_frames=table)
    assert read_dataset(data, TINY_POLICY, video_folder=videos)[0].video_frames == 20  # no count: the file's


def test_a_decompression_bomb_is_named_with_the_limit_and_how_to_raise_it(tmp_path, write_jsonl, monkeypatch):
    images = tmp_path / "images"
    images.mkdir()
    Image.new("1", (14000, 14000)).save(images / "bomb.png")  # 196 Mpx in a few kilobytes
    data = write_jsonl(tmp_path / "data.jsonl", [{"id": "big", "image": "bomb.png", "conversations": conv()}])
    with pytest.raises(DataError) as info:
        read_dataset(data, TINY_POLICY, image_folder=images)
    assert (info.value.sample_id, info.value.field) == ("big", "image")
    assert "14000x14000 = 196000000 pixels, over the limit of 178956970 pixels" in info.value.reason
    assert MAX_PIXELS_ENV in info.value.reason
    monkeypatch.setenv(MAX_PIXELS_ENV, "200000000")
    assert read_dataset(data, TINY_POLICY, image_folder=images)[0].image_sizes == ((14000, 14000),)
    cache_path_for(data).unlink()  # the size read under the raised limit is cached
    monkeypatch.setenv(MAX_PIXELS_ENV, "lots")
    with pytest.raises(DataError, match=f"{MAX_PIXELS_ENV}='lots': expected a pixel count"):
        read_dataset(data, TINY_POLICY, image_folder=images)


def test_a_16_bit_png_is_scaled_to_8_bits_not_clipped_white(tmp_path: Path) -> None:
    ramp = np.linspace(0, 65535, 64 * 80).reshape(64, 80).astype(np.uint16)
    Image.fromarray(ramp).save(tmp_path / "deep.png")
    with Image.open(tmp_path / "deep.png") as raw:
        assert raw.mode == "I;16"
        assert np.asarray(raw.convert("RGB")).mean() > 250  # PIL's own conversion: nearly all white
    pixels = np.asarray(load_rgb(tmp_path / "deep.png")).astype(np.int64)
    assert pixels.shape == (64, 80, 3) and (pixels[..., 0] == pixels[..., 2]).all()
    assert np.abs(pixels[..., 0] - np.rint(ramp / 257.0)).max() == 0  # 0 -> 0, 65535 -> 255, linear
