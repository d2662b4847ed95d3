"""Media that fail when training loads them (truncated images and videos, decompression bombs,
sizes that disagree with the file): a bad record named by file, id, field and media path, and with
``on_bad_sample="skip"`` a stand-in of the same tensor shapes and no targets, so every rank stays
in lockstep (one 2-rank run checks it)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from ds_runs import hf_data_args  # noqa: E402
from PIL import Image  # noqa: E402

from dflop_ds.data import DataError, read_dataset, validate_dataset  # noqa: E402
from dflop_ds.models.hf.base.collate import collate_padded
from dflop_ds.models.hf.base.dataset import MediaDataset, load_llava_records
from dflop_ds.models.hf.llava.data import LlavaPreprocessor
from dflop_ds.models.hf.qwen2_vl.data import Qwen2VLDataset, Qwen2VLPreprocessor, collate_qwen2_vl  # noqa: E402
from dflop_ds.schedule.index import ScheduledIndex  # noqa: E402
from dflop_ds.testing import hf_tiny, qwen2_vl_tiny  # noqa: E402
from dflop_ds.testing.video import write_video  # noqa: E402

IGNORE = -100


def conv(question: str = "<image>\nwhat is it?", answer: str = "a red car on a road") -> list[dict]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


def write_image(path: Path, size: tuple[int, int], seed: int = 0) -> Path:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return path


def cut(path: Path, keep: float = 0.5) -> bytes:
    """Keep the first ``keep`` share of the file's bytes; returns the whole file as it was."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return data


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> LlavaPreprocessor:
    return LlavaPreprocessor.from_pretrained(hf_tiny.build_tiny_llava(tmp_path_factory.mktemp("tiny_llava")))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Qwen2VLPreprocessor:
    folder = qwen2_vl_tiny.build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny_qwen2_vl"))
    return Qwen2VLPreprocessor.from_pretrained(folder, video_fps=2.0, video_max_frames=6)


def llava_data(tmp_path: Path) -> tuple[Path, Path]:
    images = tmp_path / "images"
    write_image(images / "good.png", (64, 48))
    write_image(images / "bad.png", (50, 40), seed=1)
    records = [
        {"id": "good", "image": "good.png", "conversations": conv()},
        {"id": "bad", "image": ["good.png", "bad.png"], "conversations": conv("<image><image> compare")},
    ]
    data = tmp_path / "data.json"
    data.write_text(json.dumps(records))
    return data, images


def test_a_truncated_image_is_a_named_bad_record_at_load_time(llava, tmp_path: Path) -> None:
    data, images = llava_data(tmp_path)
    shapes = read_dataset(data, llava.policy(), image_folder=images)
    cut(images / "bad.png")  # after the header check, as when a file is damaged on disk
    dataset = MediaDataset(shapes, load_llava_records(data), llava, images, source=data)
    with pytest.raises(DataError) as info:
        dataset[1]
    assert (info.value.path, info.value.sample_id, info.value.field) == (str(data), "bad", "image[1]")
    assert f"cannot load image {images / 'bad.png'}" in info.value.reason and "truncated" in info.value.reason


def test_under_skip_a_sample_that_fails_to_load_stands_in_with_the_same_shapes_and_no_targets(
    llava, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data, images = llava_data(tmp_path)
    shapes = read_dataset(data, llava.policy(), image_folder=images)
    records = load_llava_records(data)
    good = MediaDataset(shapes, records, llava, images, source=data)[ScheduledIndex(1, 9.0)]
    cut(images / "bad.png")
    dataset = MediaDataset(shapes, records, llava, images, source=data, on_bad_sample="skip")
    stand_in = dataset[ScheduledIndex(1, 9.0)]
    assert stand_in.pixel_values.shape == good.pixel_values.shape and not stand_in.pixel_values.any()
    assert torch.equal(stand_in.input_ids, good.input_ids) and (good.targets != IGNORE).any()
    assert (stand_in.targets == IGNORE).all() and stand_in.loss_denominator == 9.0
    assert dataset.stand_in_count == 1
    (logged,) = [r.getMessage() for r in caplog.records if "stand-in" in r.getMessage()]
    assert "(id 'bad')" in logged and "image[1]" in logged and "loss denominator" in logged
    # it collates with good samples into the microbatch the schedule planned
    first = dataset[ScheduledIndex(0, 9.0)]
    inputs, (targets, denominator) = collate_padded([first, stand_in])
    assert [t.shape for t in inputs] == [t.shape for t in collate_padded([first, good])[0]]
    assert float(denominator) == 9.0 and int((targets[1] != IGNORE).sum()) == 0
    with pytest.raises(ValueError, match="on_bad_sample must be one of"):
        MediaDataset(shapes, records, llava, images, on_bad_sample="ignore")


def test_stand_ins_made_in_dataloader_workers_are_counted_in_the_training_process(llava, tmp_path: Path) -> None:
    """Workers load the samples: the count the training loop prints is read in the main process."""
    data, images = llava_data(tmp_path)
    shapes = read_dataset(data, llava.policy(), image_folder=images)
    cut(images / "bad.png")
    dataset = MediaDataset(shapes, load_llava_records(data), llava, images, source=data, on_bad_sample="skip")
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, sampler=[1, 0, 1, 1], num_workers=2)
    assert [item.sample_id for item in loader] == ["bad", "good", "bad", "bad"]
    assert dataset.stand_in_count == 3


def test_a_decompression_bomb_at_load_time_names_the_record_and_the_limit(llava, tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    Image.new("1", (14000, 14000)).save(images / "bomb.png")
    # the record gives the size, so no header is read before training loads the file
    record = {"id": "big", "image": "bomb.png", "width": 14000, "height": 14000, "conversations": conv()}
    data = tmp_path / "data.json"
    data.write_text(json.dumps([record]))
    shapes = read_dataset(data, llava.policy(), image_folder=images)
    dataset = MediaDataset(shapes, load_llava_records(data), llava, images, source=data)
    with pytest.raises(DataError) as info:
        dataset[0]
    assert (info.value.sample_id, info.value.field) == ("big", "image")
    assert "196000000 pixels, over the limit of 178956970" in info.value.reason
    assert "DFLOP_DS_MAX_IMAGE_PIXELS" in info.value.reason


@pytest.mark.parametrize(
    "sizes,field,given_by",
    [
        ({"width": 64, "height": 48}, "width/height", "the record's 'width'/'height'"),
        ({"image_sizes": [[64, 48]]}, "image_sizes[0]", "the record's 'image_sizes'"),
    ],
)
def test_qwen2_vl_refuses_a_recorded_size_that_is_not_the_file_s(qwen, tmp_path, sizes, field, given_by) -> None:
    images = tmp_path / "images"
    write_image(images / "small.png", (32, 32))
    data = tmp_path / "data.json"
    data.write_text(json.dumps([{"id": "w", "image": "small.png", **sizes, "conversations": conv()}]))
    shapes = read_dataset(data, qwen.policy(), image_folder=images)
    dataset = Qwen2VLDataset(shapes, load_llava_records(data), qwen, images, source=data)
    with pytest.raises(DataError) as info:
        dataset[0]
    assert (info.value.sample_id, info.value.field) == ("w", field)
    assert f"{given_by} gives 64x48 for image 'small.png', but the file {images / 'small.png'} is 32x32" in str(
        info.value
    )
    assert "another policy" not in str(info.value)
    (problem,) = validate_dataset(data, qwen.policy(), image_folder=images)  # the decode sample finds it too
    assert problem.sample_id == "w" and f"{given_by} gives 64x48 for image 'small.png'" in problem.message


def test_qwen2_vl_video_that_fails_to_load_stands_in_with_its_planned_grid(qwen, tmp_path: Path) -> None:
    images, videos = tmp_path / "images", tmp_path / "videos"
    write_image(images / "a.png", (40, 30))
    write_video(videos / "clip.avi", frames=12, width=32, height=24)
    records = [
        {"id": "img", "image": "a.png", "conversations": conv()},
        {"id": "vid", "video": "clip.avi", "conversations": conv("<video> what happens?")},
    ]
    data = tmp_path / "data.json"
    data.write_text(json.dumps(records))
    shapes = read_dataset(data, qwen.policy(), image_folder=images, video_folder=videos)
    by_id = load_llava_records(data)
    good = Qwen2VLDataset(shapes, by_id, qwen, images, source=data, video_folder=videos)[1]
    cut(videos / "clip.avi")  # the header still says 12 frames; the sampled ones are gone
    failing = Qwen2VLDataset(shapes, by_id, qwen, images, source=data, video_folder=videos)
    with pytest.raises(DataError) as info:
        failing[1]
    assert (info.value.sample_id, info.value.field) == ("vid", "video")
    assert f"cannot load video {videos / 'clip.avi'}" in info.value.reason
    skipping = Qwen2VLDataset(shapes, by_id, qwen, images, source=data, video_folder=videos, on_bad_sample="skip")
    stand_in = skipping[1]
    assert torch.equal(stand_in.video_grid_thw, good.video_grid_thw)
    assert stand_in.pixel_values_videos.shape == good.pixel_values_videos.shape
    assert torch.equal(stand_in.input_ids, good.input_ids) and (stand_in.targets == IGNORE).all()
    inputs, _ = collate_qwen2_vl([skipping[0], stand_in])
    assert [t.shape for t in inputs] == [t.shape for t in collate_qwen2_vl([skipping[0], good])[0]]


@pytest.mark.slow
def test_two_ranks_stay_in_lockstep_when_samples_fail_to_load_under_skip(tmp_path: Path, ds_config, run_train):
    """A whole epoch (16 samples, global batches of 8) on 2 ranks with ZeRO-2, two of its images cut
    after validation: the run finishes on both ranks, names both records, and trains every step."""
    from dflop_ds.testing.llava_data import write_llava_dataset

    model = hf_tiny.build_tiny_llava(tmp_path / "model")
    data, images = write_llava_dataset(tmp_path / "data", 16, seed=5, text_only=0.0)
    records = json.loads(data.read_text())
    bad = [records[3], records[11]]
    for record in bad:
        paths = record["image"] if isinstance(record["image"], list) else [record["image"]]
        cut(images / paths[0])
    summary = tmp_path / "summary.json"
    config = ds_config("hf_zero2.json", {"steps": 2, "on_bad_sample": "skip", "max_samples": 16})
    run = run_train(
        config,
        *hf_data_args(model, data, images, "--summary", summary),
        timeout=500,
    )
    output = run.stdout + run.stderr
    for record in bad:
        assert f"(id {str(record['id'])!r})" in output and "trained as a stand-in" in output, output[-3000:]
    counted = re.findall(r"rank \d: (\d+) sample\(s\) whose media failed to load trained as stand-ins", output)
    assert sum(map(int, counted)) == 2, output[-3000:]  # each rank prints what its loader made
    steps = json.loads(summary.read_text())["steps"]
    assert len(steps) == 2 and sum(step["samples"] for step in steps) == 16
    assert all(np.isfinite(step["loss"]) for step in steps)
