"""Qwen2-VL data path: shape policy from the image processor, LLaVA records -> contract tensors."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from dflop_ds.data import DataError, read_dataset  # noqa: E402
from dflop_ds.models.hf.base.dataset import load_llava_records
from dflop_ds.models.hf.lora import LoraSettings  # noqa: E402
from dflop_ds.models.hf.qwen2_vl.data import (  # noqa: E402
    Qwen2VLDataset,
    Qwen2VLPreprocessor,
    SmartResize,
    collate_packed_qwen2_vl,
    collate_qwen2_vl,
)
from dflop_ds.models.hf.qwen2_vl.model import load_qwen2_vl, qwen2_vl_layers  # noqa: E402
from dflop_ds.models.hf.qwen2_vl.synthetic import qwen2_vl_hf_forward  # noqa: E402
from dflop_ds.models.hf.source import hf_source  # noqa: E402
from dflop_ds.pipe import token_normalized_loss  # noqa: E402
from dflop_ds.testing.llava_data import write_llava_dataset  # noqa: E402
from dflop_ds.testing.qwen2_vl_tiny import build_tiny_qwen2_vl  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("qwen2_vl_data")
    model_dir = build_tiny_qwen2_vl(root / "model", max_pixels=48 * 48)
    data, images = write_llava_dataset(root / "data", 16, seed=7, text_only=0.3)
    pre = Qwen2VLPreprocessor.from_pretrained(model_dir)
    shapes = list(read_dataset(data, pre.policy(), image_folder=images))
    return model_dir, data, images, pre, shapes


def test_smart_resize_gives_the_image_processors_grid(setup) -> None:
    """The policy's per-image patches and tokens are what the image processor makes of the same size."""
    from PIL import Image

    _, _, _, pre, _ = setup
    rng = random.Random(0)
    for _ in range(25):
        width, height = rng.randint(5, 400), rng.randint(5, 400)
        _, grid = pre.pixel_values([Image.new("RGB", (width, height))])
        t, h, w = grid[0].tolist()
        assert t == 1 and pre.rule(width, height) == (h * w, h * w // 4), (width, height)
    assert pre.rule == SmartResize(patch_size=4, merge_size=2, min_pixels=64, max_pixels=48 * 48)


def test_shapes_follow_each_images_own_size(setup) -> None:
    _, _, _, pre, shapes = setup
    with_images = [s for s in shapes if s.image_sizes]
    assert with_images and len({s.visual_tokens for s in with_images}) > 3
    for shape in with_images:
        per_image = [pre.rule(w, h) for w, h in shape.image_sizes]
        assert shape.encoder_tiles == sum(p for p, _ in per_image)
        assert shape.visual_tokens == sum(t for _, t in per_image)
        assert shape.llm_tokens == shape.visual_tokens + shape.text_tokens
    assert "SmartResize" in pre.policy().describe()["image_rule"]


def test_dataset_tensors_match_their_shapes_and_hf(setup) -> None:
    """Every item has its shape's tokens and targets; a collated microbatch gives HF's loss through the layers."""
    model_dir, data, images, pre, shapes = setup
    dataset = Qwen2VLDataset(shapes, load_llava_records(data), pre, images, source=data)
    items = [dataset[i] for i in range(len(shapes))]
    for shape, item in zip(shapes, items):
        assert item.input_ids.numel() == shape.llm_tokens
        assert int((item.targets != -100).sum()) == shape.label_tokens
        assert int((item.input_ids == pre.image_token_id).sum()) == shape.visual_tokens
        assert item.pixel_values.shape[0] == shape.encoder_tiles == int(item.image_grid_thw.prod(-1).sum())
    model = load_qwen2_vl(model_dir).eval()
    encoder, projector, llm = qwen2_vl_layers(model)
    layers = torch.nn.Sequential(*encoder, projector, *llm)
    text_only = [item for item, shape in zip(items, shapes) if not shape.image_sizes][:2]
    for batch in (items[:4], text_only):
        inputs, labels = collate_qwen2_vl(batch)
        assert inputs[3].shape[0] == sum(item.image_grid_thw.shape[0] for item in batch)
        with torch.no_grad():
            reference = qwen2_vl_hf_forward(model, inputs, labels[0])
            torch.testing.assert_close(token_normalized_loss(layers(inputs), labels), reference.loss)


def test_template_supervises_answers_and_end_of_turn(setup) -> None:
    _, _, _, pre, _ = setup
    encoded = pre.encode([("human", "<image>\nwhat is shown?"), ("gpt", "a red car")], [3])
    text = pre.tokenizer.decode(encoded.input_ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    assert "<|vision_start|>" + "<|image_pad|>" * 3 + "<|vision_end|>\nwhat is shown?<|im_end|>" in text
    supervised = pre.tokenizer.decode([t for t, s in zip(encoded.input_ids, encoded.supervised) if s])
    assert supervised == "a red car<|im_end|>"
    assert pre.count([("human", "<image>\nwhat is shown?"), ("gpt", "a red car")], [3]) == (
        len(encoded.input_ids) - 3,
        encoded.label_count,
    )
    with pytest.raises(ValueError, match="2 <image> placeholder"):
        pre.encode([("human", "<image> <image>"), ("gpt", "x")], [3])


def test_hf_source_dispatches_on_the_model_type(setup, tmp_path: Path) -> None:
    model_dir, data, images, _, shapes = setup
    source = hf_source(str(model_dir), image_folder=str(images))
    assert source.name.startswith("qwen2_vl") and source.collate is collate_qwen2_vl
    assert source.packed_collate is collate_packed_qwen2_vl and source.uses_packing(None)  # HF models pack
    assert list(source.read_shapes(str(data), "error")) == shapes
    cutting = hf_source(str(model_dir), image_folder=str(images), max_length=4096, truncation="truncate")
    assert "max_length:4096 truncation:truncate" in cutting.policy.describe()["tokenizer"]
    limit = sorted(shape.llm_tokens for shape in shapes)[len(shapes) // 2]
    cutting = hf_source(str(model_dir), image_folder=str(images), max_length=limit, truncation="truncate")
    assert source.truncated_samples() == cutting.truncated_samples() == 0
    read = cutting.read_shapes(str(data), "skip")  # what the run summary reports as truncated_samples
    broken = sum("cut through" in problem.reason for problem in read.report.problems)
    assert cutting.truncated_samples() == sum(shape.llm_tokens > limit for shape in shapes) - broken > 0
    missing = tmp_path / "missing"
    (missing).mkdir()
    dataset = source.make_dataset(shapes, str(data))
    dataset.image_folder = missing
    index = next(i for i, s in enumerate(shapes) if s.image_sizes)
    with pytest.raises(DataError, match=shapes[index].sample_id):
        dataset[index]


def test_cli_reads_with_the_qwen2_vl_policy(setup, capsys) -> None:
    from dflop_ds.commands.main import main

    model_dir, data, images, _, shapes = setup
    assert main(["validate", str(data), "--model_name_or_path", str(model_dir), "--image_folder", str(images)]) == 0
    assert f"{len(shapes)} samples, no problems" in capsys.readouterr().out


def test_profile_target_runs_the_real_layers_on_patch_counts(setup, tmp_path: Path) -> None:
    """The encoder factory turns a patch count into images the layer lists accept (rounded up to
    merge blocks, rows without images allowed); the fitted cost model keeps the Qwen2-VL policy."""
    from dflop_ds.cost import FittedCostModel
    from dflop_ds.models.hf.profile import hf_target
    from dflop_ds.models.hf.qwen2_vl.model import Qwen2VLEncoderInputs
    from dflop_ds.profile.model import profile_model

    model_dir, _, _, pre, _ = setup
    target = hf_target(str(model_dir))
    assert isinstance(target.encoder_inputs, Qwen2VLEncoderInputs)
    pixel_values, input_ids, seq_lens, grid, _ = target.encoder_inputs(22, 3)  # 8 + 7 + 7 patches, rounded up
    assert grid.tolist() == [[1, 2, 4], [1, 2, 4], [1, 2, 4]] and pixel_values.shape[0] == 24
    assert (input_ids == pre.image_token_id).sum(1).tolist() == [2, 2, 2] and seq_lens.tolist() == [10, 10, 10]
    x = target.encoder_inputs(2, 4)  # two rows without an image
    assert x[3].tolist() == [[1, 2, 2], [1, 2, 2]] and x[2].tolist() == [9, 9, 8, 8]
    for layer in [*target.encoder_layers, target.projector]:
        x = layer(x)
    assert x[0].shape == (4, 9, 64) and x[1].shape == (3, 4, 9)
    profile = profile_model(
        **target.profile_kwargs(), tiles=(4, 64), seq_lens=(16,), batch_sizes=(1,), repeats=1, warmup=0, progress=False
    )
    assert [point.attention_units for point in profile.encoder] == [4**2, 64**2]  # one image per point
    cost_model = FittedCostModel().fit(profile, target.policy)
    assert "SmartResize" in cost_model.shape_policy["image_rule"]
    assert cost_model.encoder_features == ("1", "T", "A")  # patches and the attention within each image


def test_lora_trains_adapters_and_the_merger_only(setup) -> None:
    model_dir, _, images, _, _ = setup
    source = hf_source(str(model_dir), image_folder=str(images), lora=LoraSettings(r=4, alpha=8))
    trainable = {name for name, p in source.hf_model.named_parameters() if p.requires_grad}
    assert any("lora_" in name and "language_model" in name for name in trainable)
    assert any("visual.merger" in name for name in trainable)
    assert not any("visual.blocks" in name or "patch_embed" in name or "embed_tokens" in name for name in trainable)


@pytest.mark.parametrize(
    "targets, message",
    [
        ([".*"], r"match \d+ module\(s\) of the language model, but \d+ of them are not Linear layers: .*\("),
        (["mlp"], r"are not Linear layers: .*layers\.0\.mlp \(Qwen2MLP\)"),
        (["no_such_layer"], r"no module of the language model matches target_modules \['no_such_layer'\]"),
    ],
)
def test_lora_targets_that_are_not_linear_layers_are_named(setup, targets, message) -> None:
    model_dir, _, images, _, _ = setup
    with pytest.raises(ValueError, match=message):
        hf_source(str(model_dir), image_folder=str(images), lora=LoraSettings.from_dict({"target_modules": targets}))


def test_validate_reads_the_data_as_the_training_config_does(setup, tmp_path: Path, capsys) -> None:
    import argparse
    import json

    from dflop_ds.commands.data import add_read_arguments, policy_from_args
    from dflop_ds.commands.main import main

    model_dir, data, images, _, shapes = setup
    limit = max(shape.llm_tokens for shape in shapes) - 1
    flags = ["--model_name_or_path", str(model_dir), "--image_folder", str(images), "--max-length", str(limit)]
    assert main(["validate", str(data), *flags]) == 1  # Qwen2-VL takes --max-length too
    assert f"exceed max_length {limit}" in capsys.readouterr().out
    assert main(["validate", str(data), *flags, "--truncation", "truncate"]) == 0
    assert f"{len(shapes)} samples, no problems" in capsys.readouterr().out
    # --deepspeed-config: the data file, model, folders and length rule of its "dflop" block
    config = tmp_path / "ds.json"
    data_block = {"path": str(data), "image_folder": str(images), "max_length": limit}
    config.write_text(json.dumps({"dflop": {"data": data_block, "model": {"name_or_path": str(model_dir)}}}))
    assert main(["validate", "--deepspeed-config", str(config)]) == 1
    assert f"exceed max_length {limit}" in capsys.readouterr().out
    assert main(["validate", "--deepspeed-config", str(config), "--truncation", "truncate"]) == 0
    data_block["truncation"] = "truncate"
    config.write_text(json.dumps({"dflop": {"data": data_block, "model": {"name_or_path": str(model_dir)}}}))
    assert main(["validate", "--deepspeed-config", str(config)]) == 0
    # the video rule reaches the policy; a tokenization flag without a HuggingFace model is refused
    parser = argparse.ArgumentParser()
    add_read_arguments(parser)
    video = ["--video-fps", "1.5", "--video-max-frames", "6"]
    rule = policy_from_args(parser.parse_args(["--model_name_or_path", str(model_dir), *video])).video_rule
    assert (rule.fps, rule.max_frames) == (1.5, 6)
    with pytest.raises(ValueError, match="--video-fps, --video-max-frames: these set a HuggingFace model's"):
        policy_from_args(parser.parse_args(video))
