"""Qwen2-VL videos: real video files (PyAV), frame sampling, cached container facts, and the layer
lists vs HF's own forward with ``pixel_values_videos`` / ``video_grid_thw``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("av")

from hf_stage_checks import assert_qwen2_vl_packs, assert_stages_match_hf  # noqa: E402

from dflop_ds.data import DataError, read_dataset  # noqa: E402
from dflop_ds.data.video import (  # noqa: E402
    VideoHeaders,
    decode_frames,
    read_video_info,
    sample_frame_indices,
    sampled_frame_count,
)
from dflop_ds.models.hf.base.dataset import load_llava_records
from dflop_ds.models.hf.base.layers import run_layers  # noqa: E402
from dflop_ds.models.hf.check import random_frames, random_image  # noqa: E402
from dflop_ds.models.hf.qwen2_vl.data import Qwen2VLDataset, Qwen2VLPreprocessor, collate_qwen2_vl  # noqa: E402
from dflop_ds.models.hf.qwen2_vl.model import load_qwen2_vl, qwen2_vl_layers  # noqa: E402
from dflop_ds.models.hf.qwen2_vl.synthetic import (  # noqa: E402
    IMAGE_MARK,
    VIDEO_MARK,
    Qwen2VLInputs,
    qwen2_vl_hf_forward,
    qwen2_vl_hf_positions,
)
from dflop_ds.pipe import token_normalized_loss  # noqa: E402
from dflop_ds.testing.llava_data import write_llava_dataset  # noqa: E402
from dflop_ds.testing.qwen2_vl_tiny import build_tiny_qwen2_vl  # noqa: E402
from dflop_ds.testing.video import add_video_records, write_video  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_and_inputs(tmp_path_factory: pytest.TempPathFactory):
    folder = build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl_video"), seed=5)
    model = load_qwen2_vl(folder).eval()
    return model, Qwen2VLInputs.from_dir(folder, model.config)


def video_microbatches(seed: int = 0) -> list[list[tuple]]:
    rng = random.Random(seed)
    return [
        [
            (f"USER: {VIDEO_MARK} what happens? ASSISTANT:", "a car drives", [], random_frames(rng, 4)),
            (f"USER: {IMAGE_MARK} and this? ASSISTANT:", "a tree", [random_image(rng)]),
            ("USER: hello ASSISTANT:", "hi there", []),
        ],
        [
            (
                f"USER: {IMAGE_MARK} then {VIDEO_MARK} ASSISTANT:",
                "both move",
                [random_image(rng)],
                random_frames(rng, 6),
            ),
            (f"USER: {VIDEO_MARK} ASSISTANT:", "dark", [], random_frames(rng, 2)),
        ],
    ]


def test_video_patches_pair_consecutive_frames(model_and_inputs) -> None:
    """A video of 2k frames gives k frame pairs; a still frame repeated gives the image's own patches."""
    _, inputs_of = model_and_inputs
    frames = random_frames(random.Random(1), 4)
    pixels, grid = inputs_of.video_pixel_values(frames)
    image = inputs_of.image_processor(images=frames[:1], return_tensors="pt")
    image_pixels = image["pixel_values"]
    assert grid[0, 0] == 2 and grid[0, 1:].tolist() == image["image_grid_thw"][0, 1:].tolist()
    assert pixels.shape == (int(grid.prod()), inputs_of.patch_dim)
    still, _ = inputs_of.video_pixel_values([frames[0], frames[0]])
    torch.testing.assert_close(still, image_pixels.float())  # the image processor duplicates a still over time
    with pytest.raises(ValueError, match="not a positive multiple of 2"):
        inputs_of.video_pixel_values(frames[:3])


def test_layer_lists_match_hf_with_videos_for_1_2_3_stages(model_and_inputs) -> None:
    model, inputs_of = model_and_inputs
    encoder, projector, llm = qwen2_vl_layers(model)
    layers = [*encoder, projector, *llm]
    for samples in video_microbatches():
        inputs, labels = inputs_of.microbatch(samples)
        assert inputs[4].shape[0] >= 1
        with torch.no_grad():
            reference = qwen2_vl_hf_forward(model, inputs, labels[0])
        assert_stages_match_hf(layers, len(encoder) + 1, inputs, labels, reference)


def test_packed_videos_and_images_give_the_padded_loss_at_1_and_2_stages(model_and_inputs) -> None:
    """Two videos, two images and a text-only sample packed in one row: per-sample positions, same loss."""
    model, inputs_of = model_and_inputs
    first, second = video_microbatches(4)
    assert_qwen2_vl_packs(model, inputs_of, first + second[:1])


def test_video_position_ids_equal_hf(model_and_inputs) -> None:
    """Video tokens take (frame pair, row, column) positions, as HF's ``get_rope_index`` computes them."""
    model, inputs_of = model_and_inputs
    encoder, projector, _ = qwen2_vl_layers(model)
    for samples in video_microbatches(3):
        inputs, _ = inputs_of.microbatch(samples)
        _, position_ids, _ = run_layers([*encoder, projector], inputs)
        assert torch.equal(position_ids, qwen2_vl_hf_positions(model, inputs))
        video = inputs[1] == model.config.video_token_id
        assert len(set(position_ids[0][video].tolist())) > 1  # the temporal axis moves within a video


def test_frame_sampling_follows_the_recipe() -> None:
    # 40 frames at 10 fps = 4 s; 2 fps -> 8 frames; capped by max_frames and rounded down to pairs
    assert sampled_frame_count(40, 10.0, target_fps=2.0, max_frames=768) == 8
    assert sampled_frame_count(40, 10.0, target_fps=2.0, max_frames=5) == 4
    assert sampled_frame_count(7, 4.0, target_fps=2.0, max_frames=768) == 4  # at least 4 frames
    assert sampled_frame_count(3, 4.0, target_fps=2.0, max_frames=768) == 2  # no more than the video has
    assert sampled_frame_count(1, 4.0, target_fps=2.0, max_frames=768) == 0
    assert sample_frame_indices(40, 8) == [0, 5, 10, 15, 20, 25, 30, 35]
    with pytest.raises(ValueError, match="cannot sample 9 of 8"):
        sample_frame_indices(8, 9)


def test_container_facts_without_decoding_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    video = write_video(tmp_path / "v" / "a.mp4", frames=9, width=36, height=20, fps=6)
    info = read_video_info(video)
    assert (info.frames, info.width, info.height, info.fps) == (9, 36, 20, 6.0)
    assert [image.size for image in decode_frames(video, [0, 4, 8])] == [(36, 20)] * 3
    with pytest.raises(OSError, match="ends before frame 9"):
        decode_frames(video, [2, 9])
    cache = tmp_path / "cache.json"
    first = VideoHeaders(tmp_path / "v", cache)
    assert first.info("a.mp4") == info and first.headers_read == 1
    first.save()
    import dflop_ds.data.video as video_module

    monkeypatch.setattr(video_module, "read_video_info", lambda path: pytest.fail("read again"))
    second = VideoHeaders(tmp_path / "v", cache)
    assert second.info("a.mp4") == info and second.headers_read == 0


@pytest.fixture(scope="module")
def video_data(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("qwen2_vl_video_data")
    model_dir = build_tiny_qwen2_vl(root / "model", max_pixels=48 * 48, seed=2)
    data, images = write_llava_dataset(root / "data", 6, seed=4, text_only=0.3)
    videos = root / "videos"
    video_ids = add_video_records(data, videos, 4, seed=1)
    pre = Qwen2VLPreprocessor.from_pretrained(model_dir, video_fps=2.0, video_max_frames=6)
    shapes = list(read_dataset(data, pre.policy(), image_folder=images, video_folder=videos))
    return model_dir, data, images, videos, pre, shapes, video_ids


def test_video_shapes_follow_frames_and_size(video_data) -> None:
    model_dir, data, images, videos, pre, shapes, video_ids = video_data
    by_id = {shape.sample_id: shape for shape in shapes}
    for sample_id in video_ids:
        shape = by_id[sample_id]
        info = read_video_info(videos / load_llava_records(data)[sample_id]["video"])
        assert shape.modality == "video" and shape.video_frames == info.frames
        assert shape.video_size == (info.width, info.height) and shape.video_fps == info.fps
        t, h, w = pre.video_rule.grid(info.frames, info.width, info.height, info.fps)
        assert t == min(6, info.frames) // 2 and shape.encoder_tiles == t * h * w
        assert shape.visual_tokens == t * h * w // 4
        assert shape.encoder_attention == t * (h * w) ** 2  # each frame pair attends within itself
    for shape in shapes:
        if shape.image_sizes and not shape.video_frames:
            assert shape.encoder_attention == sum(pre.rule(w, h)[0] ** 2 for w, h in shape.image_sizes)
    assert Path(str(data) + ".video_info.cache.json").is_file()
    other = Qwen2VLPreprocessor.from_pretrained(model_dir, video_fps=2.0, video_max_frames=2).policy()
    assert other.describe() != pre.policy().describe()  # the sampling is part of the policy


def test_dataset_with_videos_matches_shapes_and_hf(video_data) -> None:
    model_dir, data, images, videos, pre, shapes, video_ids = video_data
    dataset = Qwen2VLDataset(shapes, load_llava_records(data), pre, images, source=data, video_folder=videos)
    items = [dataset[i] for i in range(len(shapes))]
    for shape, item in zip(shapes, items):
        assert item.input_ids.numel() == shape.llm_tokens
        assert int((item.targets != -100).sum()) == shape.label_tokens
        vision = (item.input_ids == pre.image_token_id) | (item.input_ids == pre.video_token_id)
        assert int(vision.sum()) == shape.visual_tokens
        assert item.pixel_values.shape[0] + item.pixel_values_videos.shape[0] == shape.encoder_tiles
    model = load_qwen2_vl(model_dir).eval()
    encoder, projector, llm = qwen2_vl_layers(model)
    layers = torch.nn.Sequential(*encoder, projector, *llm)
    with_video = [i for i, shape in enumerate(shapes) if shape.video_frames]
    for batch in ([items[i] for i in with_video[:2]] + items[:2], [items[i] for i in with_video[2:]]):
        inputs, labels = collate_qwen2_vl(batch)
        assert inputs[4].shape[0] == sum(item.video_grid_thw.shape[0] for item in batch) > 0
        packed_inputs, packed_labels = collate_qwen2_vl(batch, packed=True)
        assert packed_inputs[1].shape == (1, int(inputs[2].sum()))
        with torch.no_grad():
            reference = qwen2_vl_hf_forward(model, inputs, labels[0])
            torch.testing.assert_close(token_normalized_loss(layers(inputs), labels), reference.loss)
            packed_loss = token_normalized_loss(layers(packed_inputs), packed_labels)
            torch.testing.assert_close(packed_loss, reference.loss, rtol=1e-5, atol=1e-6)


def test_missing_and_unreadable_videos_name_the_record(video_data, tmp_path: Path) -> None:
    model_dir, _, _, _, pre, _, _ = video_data
    videos = tmp_path / "videos"
    videos.mkdir()
    (videos / "broken.mp4").write_bytes(b"not a video at all")
    data = tmp_path / "d.json"
    turns = [{"from": "human", "value": "<video>\nwhat?"}, {"from": "gpt", "value": "a dog"}]
    data.write_text(
        json.dumps(
            [
                {"id": "gone", "video": "missing.mp4", "conversations": turns},
                {"id": "bad", "video": "broken.mp4", "conversations": turns},
            ]
        )
    )
    result = read_dataset(data, pre.policy(), video_folder=videos, on_bad_sample="skip")
    assert len(result) == 0
    problems = {problem.sample_id: problem for problem in result.report.problems}
    assert problems["gone"].field == "video" and "video file not found" in problems["gone"].reason
    assert str(videos / "missing.mp4") in problems["gone"].reason
    assert "cannot read the video header of" in problems["bad"].reason and "broken.mp4" in problems["bad"].reason
    with pytest.raises(DataError, match="needs the video's frame size and rate|no video_folder"):
        read_dataset(data, pre.policy())
    # a video that disappears after its shape was read: the dataset names the record and file
    good = write_video(videos / "ok.mp4", frames=4, width=16, height=16)
    data.write_text(json.dumps([{"id": "late", "video": "ok.mp4", "conversations": turns}]))
    shapes = list(read_dataset(data, pre.policy(), video_folder=videos))
    good.write_bytes(b"truncated")
    dataset = Qwen2VLDataset(shapes, load_llava_records(data), pre, None, source=data, video_folder=videos)
    with pytest.raises(DataError, match="cannot load video .*ok.mp4") as info:
        dataset[0]
    assert info.value.sample_id == "late" and info.value.field == "video"


def test_qwen2_5_vl_videos_are_refused_by_name(tmp_path: Path) -> None:
    model_dir = build_tiny_qwen2_vl(tmp_path / "m", family="qwen2_5_vl")
    data, images = write_llava_dataset(tmp_path / "data", 2, seed=1)
    add_video_records(data, tmp_path / "videos", 1)
    pre = Qwen2VLPreprocessor.from_pretrained(model_dir)
    shapes = list(read_dataset(data, pre.policy(), image_folder=images, video_folder=tmp_path / "videos"))
    with pytest.raises(DataError, match="videos are not supported for qwen2_5_vl"):
        Qwen2VLDataset(shapes, load_llava_records(data), pre, images, source=data, video_folder=tmp_path / "videos")


@pytest.mark.slow
def test_qwen2_vl_trains_on_videos_on_two_ranks_pipelined(tmp_path: Path, train) -> None:
    """examples/train.py, 2 pipeline stages, records mixing short real videos, images and text: the loss falls."""
    model = build_tiny_qwen2_vl(tmp_path / "model")
    data, images = write_llava_dataset(tmp_path / "data", 24, seed=4)
    add_video_records(data, tmp_path / "videos", 16, seed=2)
    trace = tmp_path / "trace.jsonl"
    run = train(
        "hf_pp2.json",
        model,
        data,
        images,
        "--video_folder",
        str(tmp_path / "videos"),
        "--trace",
        str(trace),
        dflop={"steps": 6, "video_fps": 2.0, "video_max_frames": 8},
    )
    losses = [step["loss"] for step in run["steps"]]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    trained = {
        index
        for line in trace.read_text().splitlines()
        for microbatch in json.loads(line)["microbatches"]
        for index in microbatch
    }
    assert len({index for index in trained if index >= 24}) >= 4  # records 24.. are the videos


def test_max_length_refuses_or_truncates_never_through_a_vision_block(video_data) -> None:
    model_dir, data, images, videos, pre, shapes, _ = video_data
    conversation = [("human", "<image>\nwhat is shown in the picture?"), ("gpt", "a red car on a road. " * 4)]
    full = pre.encode(conversation, [3])
    limit = len(full.input_ids) - 5
    with pytest.raises(ValueError, match=f"exceed max_length {limit}"):
        Qwen2VLPreprocessor.from_pretrained(model_dir, max_length=limit).encode(conversation, [3])
    cutting = Qwen2VLPreprocessor.from_pretrained(model_dir, max_length=limit, truncation="truncate")
    assert cutting.count(conversation, [3]) == (limit - 3, sum(full.supervised[1:limit]))
    assert cutting.truncated_samples == 1
    end_of_image = full.input_ids.index(pre.tokenizer.convert_tokens_to_ids("<|vision_end|>"))
    short = Qwen2VLPreprocessor.from_pretrained(model_dir, max_length=end_of_image, truncation="truncate")
    with pytest.raises(ValueError, match="cut through an image's or video's tokens"):
        short.encode(conversation, [3])  # keeps every image token but not the block's end
    video = [("human", "<video>\nwhat happens?"), ("gpt", "nothing")]
    with pytest.raises(ValueError, match="cut through an image's or video's tokens"):
        short.encode(video, [], 40)
    # read and loaded under the rule: cut samples match their shapes; those a cut would break are named
    limit = sorted(shape.llm_tokens for shape in shapes)[len(shapes) // 2]
    rule = Qwen2VLPreprocessor.from_pretrained(
        model_dir, video_fps=2.0, video_max_frames=6, max_length=limit, truncation="truncate"
    )
    result = read_dataset(data, rule.policy(), image_folder=images, video_folder=videos, on_bad_sample="skip")
    assert len(result) + result.report.n_skipped == len(shapes) and len(result) > len(shapes) // 2
    cut_reasons = ("cut through", "every one cut by truncation")  # a broken vision block, or no answer left
    assert all(any(r in problem.reason for r in cut_reasons) for problem in result.report.problems)
    dataset = Qwen2VLDataset(list(result), load_llava_records(data), rule, images, source=data, video_folder=videos)
    for i, shape in enumerate(result):
        assert shape.llm_tokens <= limit and dataset[i].input_ids.numel() == shape.llm_tokens
