"""Image sizes from real image files' headers, the size cache beside the data file, bad media named,
and every command reading media the same way (no silent default size)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from PIL import Image

from dflop_ds.commands.main import main as cli_main
from dflop_ds.data import DataError, read_dataset, validate_dataset
from dflop_ds.data import headers as headers_module
from dflop_ds.data.headers import cache_path_for
from dflop_ds.models.source import tiny_source
from dflop_ds.shapes import DEFAULT_POLICY, TINY_POLICY
from dflop_ds.testing.video import write_video

ROOT = Path(__file__).resolve().parents[1]
#: (file name, size): PNG and JPEG files of varied sizes and aspect ratios
IMAGES = [("a.png", (640, 480)), ("b.jpg", (333, 500)), ("sub/c.png", (1200, 90)), ("d.jpeg", (37, 41))]
SIZES = dict(IMAGES)


def conv(question: str = "<image>\nwhat is it?", answer: str = "a thing") -> list[dict]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


def write_images(folder: Path) -> None:
    for i, (name, size) in enumerate(IMAGES):
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", size, (40 * i, 90, 200 - 30 * i)).save(path)


@pytest.fixture()
def dataset(tmp_path: Path, write_jsonl) -> tuple[Path, Path]:
    """A LLaVA JSONL without sizes (but one record's) and its image folder."""
    folder = tmp_path / "images"
    write_images(folder)
    records = [
        {"id": "one", "image": "a.png", "conversations": conv()},
        {"id": "two", "image": ["b.jpg", "sub/c.png"], "conversations": conv("<image><image> compare")},
        {"id": "text", "conversations": conv("hello", "hi")},
        {"id": "given", "image": "d.jpeg", "width": 7, "height": 9, "conversations": conv()},
        {"id": "abs", "image": str(folder / "a.png"), "conversations": conv()},
    ]
    return write_jsonl(tmp_path / "train.jsonl", records), folder


def test_sizes_come_from_the_image_headers_and_are_cached(dataset: tuple[Path, Path]) -> None:
    data, folder = dataset
    shapes = {s.sample_id: s for s in read_dataset(data, TINY_POLICY, image_folder=folder)}
    assert shapes["one"].image_sizes == (SIZES["a.png"],)
    assert shapes["two"].image_sizes == (SIZES["b.jpg"], SIZES["sub/c.png"])
    assert shapes["text"].image_sizes == ()
    assert shapes["given"].image_sizes == ((7, 9),)  # the record's own size wins over the header
    assert shapes["abs"].image_sizes == (SIZES["a.png"],)  # absolute paths stay absolute
    assert shapes["two"].encoder_tiles == TINY_POLICY.image_tiles(333, 500) + TINY_POLICY.image_tiles(1200, 90)
    cache = json.loads(cache_path_for(data).read_text())
    assert cache["format_version"] == headers_module.CACHE_VERSION
    assert sorted(cache["entries"]) == sorted(str(folder / n) for n in ("a.png", "b.jpg", "sub/c.png"))


def test_second_read_uses_the_cache_and_a_changed_file_is_read_again(dataset: tuple[Path, Path]) -> None:
    data, folder = dataset
    first = read_dataset(data, TINY_POLICY, image_folder=folder)
    # Garble b.jpg but keep its byte size and modification time: a reader that opened it would fail.
    image = folder / "b.jpg"
    stat = image.stat()
    image.write_bytes(b"\0" * stat.st_size)
    os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert [s.image_sizes for s in read_dataset(data, TINY_POLICY, image_folder=folder)] == [
        s.image_sizes for s in first
    ]
    # A new modification time invalidates the entry: the header is read again, and it is garbage now.
    os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(DataError, match="cannot read the image header of .*b.jpg") as info:
        read_dataset(data, TINY_POLICY, image_folder=folder)
    assert (info.value.sample_id, info.value.field) == ("two", "image[0]")


def test_headers_read_once_per_file_across_objects(tmp_path: Path) -> None:
    folder = tmp_path / "images"
    write_images(folder)
    cache = tmp_path / "cache.json"
    names = [name for name, _ in IMAGES]
    first = headers_module.HeaderSizes(folder, cache)
    first.prefetch(names + names)
    first.save()
    assert first.headers_read == len(IMAGES)
    second = headers_module.HeaderSizes(folder, cache)
    assert [second.size(n) for n in names] == [size for _, size in IMAGES]
    assert second.headers_read == 0
    (folder / "a.png").unlink()  # a file that is gone: named, and its entry dropped from the cache
    third = headers_module.HeaderSizes(folder, cache)
    assert third.size("a.png") == f"image file not found: {folder / 'a.png'}"
    third.save()
    assert str(folder / "a.png") not in json.loads(cache.read_text())["entries"]


def test_missing_and_corrupt_images_are_named_or_skipped_and_counted(dataset: tuple[Path, Path]) -> None:
    data, folder = dataset
    (folder / "sub" / "c.png").unlink()
    (folder / "a.png").write_bytes(b"this is not an image")
    with pytest.raises(DataError) as info:
        read_dataset(data, TINY_POLICY, image_folder=folder)
    assert info.value.sample_id == "one" and info.value.field == "image"
    assert f"cannot read the image header of {folder / 'a.png'}" in str(info.value)
    result = read_dataset(data, TINY_POLICY, image_folder=folder, on_bad_sample="skip")
    assert [s.sample_id for s in result] == ["text", "given"]
    assert result.report.n_skipped == 3
    messages = {(p.sample_id, p.field): p.reason for p in result.report.problems}
    assert messages[("two", "image[1]")] == f"image file not found: {folder / 'sub' / 'c.png'}"
    # validate reads media the same way and reports the same records
    problems = validate_dataset(data, TINY_POLICY, image_folder=folder)
    assert {(p.sample_id, p.field, p.message) for p in problems} == {
        (p.sample_id, p.field, p.reason) for p in result.report.problems
    }


def test_a_given_size_does_not_excuse_a_missing_file(dataset: tuple[Path, Path]) -> None:
    data, folder = dataset
    (folder / "d.jpeg").unlink()
    with pytest.raises(DataError, match="image file not found") as info:
        read_dataset(data, TINY_POLICY, image_folder=folder)
    assert info.value.sample_id == "given"


def test_no_silent_default_size(dataset: tuple[Path, Path]) -> None:
    data, _ = dataset
    with pytest.raises(DataError, match="no image_folder to read its header from, and no fallback_size") as info:
        read_dataset(data, TINY_POLICY)
    assert info.value.sample_id == "one"
    fallback = read_dataset(data, TINY_POLICY, fallback_size=(10, 20))  # asked for explicitly
    assert fallback[0].image_sizes == ((10, 20),)


def test_video_folder_checks_that_videos_exist(tmp_path: Path, write_jsonl) -> None:
    write_video(tmp_path / "clips" / "here.mp4", frames=30, width=16, height=12)
    data = write_jsonl(
        tmp_path / "v.jsonl",
        [
            {"id": "v1", "video": "here.mp4", "video_frames": 30, "conversations": conv("<video> what?")},
            {"id": "v2", "video": "gone.mp4", "video_frames": 30, "conversations": conv("<video> what?")},
        ],
    )
    result = read_dataset(data, TINY_POLICY, video_folder=tmp_path / "clips", on_bad_sample="skip")
    assert [s.sample_id for s in result] == ["v1"] and result[0].video_frames == 30
    (problem,) = result.report.problems
    assert (problem.sample_id, problem.field) == ("v2", "video") and "video file not found" in problem.reason


def test_long_scans_show_progress_on_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, write_jsonl
) -> None:
    folder = tmp_path / "images"
    write_images(folder)
    data = write_jsonl(
        tmp_path / "d.jsonl",
        [{"id": str(i), "image": name, "conversations": conv()} for i, (name, _) in enumerate(IMAGES)],
    )
    read_dataset(data, TINY_POLICY, image_folder=folder)
    assert "reading image headers" not in capsys.readouterr().err  # few files: quiet
    cache_path_for(data).unlink()
    monkeypatch.setattr(headers_module, "PROGRESS_MIN_FILES", 2)
    read_dataset(data, TINY_POLICY, image_folder=folder)
    captured = capsys.readouterr()
    assert "reading image headers" in captured.err and "reading image headers" not in captured.out


def test_unwritable_cache_is_a_warning_not_an_error(
    dataset: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    data, folder = dataset
    cache_path_for(data).mkdir()  # a directory where the cache file should go: it cannot be written
    shapes = read_dataset(data, TINY_POLICY, image_folder=folder)
    assert shapes[0].image_sizes == (SIZES["a.png"],)
    assert "cannot write image size cache" in caplog.text


def test_commands_take_the_same_media_options(
    dataset: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data, folder = dataset
    missing = f"(id 'one'), field 'image': image file not found: {data.parent / 'a.png'}"
    assert cli_main(["validate", str(data)]) == 1  # by default, as in training: the data file's folder
    assert missing in capsys.readouterr().out
    assert cli_main(["validate", str(data), "--image_folder", str(folder)]) == 0
    assert "5 samples, no problems" in capsys.readouterr().out
    out = tmp_path / "profile.json"
    assert cli_main(["profile", "data", str(data), "-o", str(out)]) != 0
    assert missing in capsys.readouterr().err
    assert cli_main(["profile", "data", str(data), "--image-folder", str(folder), "-o", str(out)]) == 0
    assert json.loads(out.read_text())["n_total"] == 5
    beside = folder / "train.jsonl"  # the data file beside its images: no folder option needed
    beside.write_text(data.read_text())
    assert cli_main(["validate", str(beside)]) == 0
    assert cli_main(["profile", "data", str(beside), "-o", str(out)]) == 0
    assert json.loads(out.read_text())["n_total"] == 5
    trained = tiny_source({}).read_shapes(str(beside), "error")  # and training reads it the same way
    assert [s.image_sizes for s in trained] == [
        s.image_sizes for s in read_dataset(beside, TINY_POLICY, image_folder=folder)
    ]


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "examples" / "data").glob("*.jsonl")))
def test_bundled_data_reads_without_any_fallback(name: str) -> None:
    for policy in (TINY_POLICY, DEFAULT_POLICY):
        result = read_dataset(ROOT / "examples" / "data" / name, policy)
        assert len(result) == result.report.n_records > 0
