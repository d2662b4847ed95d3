"""Qwen3-VL's own checks beside the family contract (tests/test_family_contract.py): the shape policy
counts as its processor does (images: against the image processor the processor wraps, as its
``replace_image_token`` uses them; videos: below), the M-RoPE positions equal HF's ``get_rope_index``, the deepstack
features reach the decoder and cross any stage boundary with their gradients; videos are written
with their frame groups' timestamps as ``Qwen3VLProcessor.replace_video_token`` writes them. Its
2-stage training through examples/train.py is the family contract's pipeline run."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from dflop_ds.models.hf.base.synthetic import hf_labels  # noqa: E402
from dflop_ds.models.hf.check import random_image, run_stages, synthetic_batches  # noqa: E402
from dflop_ds.models.hf.qwen3_vl.data import SmartResize  # noqa: E402
from dflop_ds.models.hf.qwen3_vl.model import load_qwen3_vl, mrope_position_ids, qwen3_vl_layers  # noqa: E402
from dflop_ds.models.hf.qwen3_vl.synthetic import IMAGE_MARK, Qwen3VLInputs, qwen3_vl_hf_kwargs  # noqa: E402
from dflop_ds.models.hf.source import hf_source  # noqa: E402
from dflop_ds.pipe.loss import token_normalized_loss  # noqa: E402
from dflop_ds.testing.llava_data import write_llava_dataset  # noqa: E402
from dflop_ds.testing.qwen3_vl_tiny import build_tiny_qwen3_vl  # noqa: E402
from dflop_ds.testing.video import add_video_records  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``(dir, model, layers, microbatch builder)`` of the tiny Qwen3-VL."""
    path = build_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl") / "m")
    model = load_qwen3_vl(path).eval()
    encoder, projector, llm = qwen3_vl_layers(model)
    return path, model, [*encoder, projector, *llm], Qwen3VLInputs.from_dir(path, model.config).microbatch


def test_the_shape_rule_counts_patches_and_tokens_as_the_released_image_processor_does():
    """Qwen3-VL's released processor: patch 16, merge 2, temporal patch 2 (its image processor)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2)
    rule = SmartResize.from_image_processor(processor)
    rng = random.Random(0)
    for _ in range(6):
        image = random_image(rng).resize((rng.randint(20, 900), rng.randint(20, 700)))
        grid = processor(images=[image], return_tensors="pt")["image_grid_thw"][0]
        assert rule(*image.size) == (int(grid.prod()), int(grid.prod()) // 4), image.size


def test_the_policy_counts_the_dataset_s_tokens_with_videos_as_the_processor_writes_them(tiny, tmp_path, monkeypatch):
    """Images and videos: every item has its shape's tokens and patches, and a video's block (per
    frame group its timestamp, ``<|vision_start|>``, its tokens, ``<|vision_end|>``) is the one the
    real ``Qwen3VLProcessor`` writes for the same sampled frames (its ``replace_video_token``, given
    the grid and the frames' indices and rate as its video processor reports them)."""
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    from dflop_ds.data.video import sample_frame_indices

    path = tiny[0]
    data, images = write_llava_dataset(tmp_path / "data", 6, seed=2, text_only=0.2)
    videos = tmp_path / "videos"
    videos.mkdir()
    add_video_records(data, videos, 4, seed=2, frames=(4, 40), fps=4)
    source = hf_source(str(path), image_folder=str(images), video_folder=str(videos))
    shapes = source.read_shapes(str(data), "error")
    dataset = source.make_dataset(shapes, str(data))
    pre = dataset.preprocessor
    # the processor's class check of its parts looks the video processor up in a mapping that needs
    # torchvision; the video processor itself, and everything replace_video_token reads, load without it
    monkeypatch.setattr(Qwen3VLProcessor, "check_argument_for_proper_class", lambda *args: None)
    processor = Qwen3VLProcessor(pre.image_processor, pre.tokenizer, Qwen3VLVideoProcessor())
    start, end = (pre.tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    assert sum(1 for shape in shapes if shape.video_frames) == 4
    for i, shape in enumerate(shapes):
        item = dataset[i]
        assert item.input_ids.numel() == shape.llm_tokens, shape.sample_id
        patches = int(item.image_grid_thw.prod(-1).sum()) + int(item.video_grid_thw.prod(-1).sum())
        assert (
            patches
            == shape.encoder_tiles
            == item.pixel_values.shape[0]
            + (0 if item.pixel_values_videos is None else item.pixel_values_videos.shape[0])
        )
        if not shape.video_frames:
            continue
        rule = pre.video_rule
        indices = sample_frame_indices(shape.video_frames, rule.sampled(shape.video_frames, shape.video_fps))
        metadata = VideoMetadata(shape.video_frames, shape.video_fps, frames_indices=indices)
        text = processor.replace_video_token({"video_grid_thw": item.video_grid_thw, "video_metadata": [metadata]}, 0)
        theirs = pre.tokenizer(text, add_special_tokens=False)["input_ids"]
        ours = rule.block(shape.video_frames, *shape.video_size, shape.video_fps)
        assert ours == theirs, (shape.sample_id, pre.tokenizer.decode(ours), text)
        block, ids = [start, *ours, end], item.input_ids.tolist()  # the placeholder's block wraps the groups
        assert any(ids[k : k + len(block)] == block for k in range(len(ids))), shape.sample_id
    with pytest.raises(ValueError, match="a <video> placeholder but the record has no video"):
        pre.encode([("human", "<video> what happens?"), ("gpt", "a car")], [])


@pytest.mark.parametrize("packed", [False, True])
def test_mrope_positions_equal_hf_get_rope_index(tiny, packed):
    _, model, _, microbatch = tiny
    _, samples = synthetic_batches(1, IMAGE_MARK)[2]  # two images in one row + one image
    inputs, _ = microbatch(samples)
    kwargs = qwen3_vl_hf_kwargs(inputs, model.config)
    reference, _ = model.model.get_rope_index(
        kwargs["input_ids"], kwargs["mm_token_type_ids"], kwargs["image_grid_thw"], None, kwargs["attention_mask"]
    )
    config = model.config
    if packed:
        packed_inputs, _ = microbatch(samples, packed=True)
        ours = mrope_position_ids(
            packed_inputs[1], packed_inputs[2], packed_inputs[3], image_token_id=config.image_token_id, merge_size=2
        )
        lengths = inputs[2].tolist()
        assert torch.equal(ours[:, 0], torch.cat([reference[:, row, :n] for row, n in enumerate(lengths)], dim=1))
    else:
        ours = mrope_position_ids(inputs[1], inputs[2], inputs[3], image_token_id=config.image_token_id, merge_size=2)
        assert torch.equal(ours, reference)


def test_deepstack_features_reach_the_decoder_and_cross_every_stage_boundary_with_gradients(tiny):
    """Cut anywhere (inside the tower, between decoder layers that add deepstack chunks) the loss is
    the uncut one and every float crossing the cut is used (``run_stages`` checks it under grad);
    the deepstack mergers get gradients; zeroing them changes the loss, which still equals HF's."""
    _, model, layers, microbatch = tiny
    _, samples = synthetic_batches(0, IMAGE_MARK)[0]  # an image row and a text-only row
    inputs, labels = microbatch(samples)
    whole = token_normalized_loss(run_stages(layers, [0, len(layers)], inputs)[0], labels)
    model.zero_grad(set_to_none=True)
    whole.backward()
    mergers = list(model.model.visual.deepstack_merger_list.parameters())
    assert mergers and all(p.grad is not None and p.grad.abs().sum() > 0 for p in mergers)
    carried = 0
    for cut in range(1, len(layers)):
        received = run_stages(layers, [0, cut], inputs)[0]
        carried += len(received) > 3  # deep carried (the tower also carries the grids)
        loss = token_normalized_loss(run_stages(layers, [0, cut, len(layers)], inputs)[0], labels)
        loss.backward()
        assert torch.allclose(loss, whole, rtol=1e-6), cut
    assert carried >= 4  # the tower's blocks, the projector and the first decoder layer pass deep on
    with torch.no_grad():
        for merger in model.model.visual.deepstack_merger_list:
            merger.linear_fc2.weight.zero_()
            merger.linear_fc2.bias.zero_()
        without = token_normalized_loss(run_stages(layers, [0, len(layers)], inputs)[0], labels)
        reference = model(**qwen3_vl_hf_kwargs(inputs, model.config), labels=hf_labels(labels[0])).loss
    assert not torch.allclose(without, whole), "the deepstack features changed nothing"
    assert torch.allclose(without, reference, rtol=1e-5)
