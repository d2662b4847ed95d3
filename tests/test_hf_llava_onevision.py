"""LLaVA-OneVision: the counting rule against the real ``LlavaOnevisionProcessor`` (built offline
in-process), the layer lists against HF's forward at 1-3 stages (check-model), the data pipeline's
microbatches (AnyRes images, several images, videos through PyAV, text-only) against HF's loss,
packed against padded, and two ranks of ZeRO-2 training."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from hf_stage_checks import assert_trains_with_media  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import LlavaOnevisionProcessor  # noqa: E402

from dflop_ds.models.hf.base.synthetic import hf_labels  # noqa: E402
from dflop_ds.models.hf.check import check_model, run_stages  # noqa: E402
from dflop_ds.models.hf.llava_onevision.shapes import OnevisionTokenRule  # noqa: E402
from dflop_ds.models.hf.llava_onevision.synthetic import onevision_hf_kwargs  # noqa: E402
from dflop_ds.models.hf.source import hf_source  # noqa: E402
from dflop_ds.pipe.loss import token_normalized_loss  # noqa: E402
from dflop_ds.shapes import DEFAULT_POLICY  # noqa: E402
from dflop_ds.testing.llava_data import write_llava_dataset  # noqa: E402
from dflop_ds.testing.llava_onevision_tiny import build_onevision_tokenizer, build_tiny_llava_onevision  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "data"
#: another checkpoint than the builder's default: 12 px tiles of 3 px patches, wide and tall grids up to 4 tiles
OTHER_PINPOINTS = ((12, 12), (12, 24), (24, 12), (12, 36), (36, 12), (24, 24), (12, 48), (48, 12))


class ImageOnlyProcessor(LlavaOnevisionProcessor):
    """The real processor without its video processor (which needs torchvision, absent here)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def real_processor(tile: int, patch: int, pinpoints, max_tiles: int) -> LlavaOnevisionProcessor:
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    image_processor = LlavaOnevisionImageProcessorPil(
        size={"height": tile, "width": tile}, image_grid_pinpoints=[list(p) for p in pinpoints]
    )
    return ImageOnlyProcessor(
        image_processor=image_processor,
        tokenizer=build_onevision_tokenizer(),
        video_processor=None,
        num_image_tokens=(tile // patch) ** 2,
        vision_feature_select_strategy="full",
        vision_aspect_ratio=f"anyres_max_{max_tiles}",
    )


@pytest.mark.parametrize(
    "tile,patch,pinpoints,max_tiles",
    [
        (16, 4, tuple((16 * r, 16 * c) for r in range(1, 4) for c in range(1, 4)), 2),
        (12, 3, OTHER_PINPOINTS, 1),
        (384, 14, tuple((384 * r, 384 * c) for r in range(1, 7) for c in range(1, 7)), 9),  # the real checkpoints'
    ],
)
def test_token_rule_counts_as_the_processor_does(tile, patch, pinpoints, max_tiles):
    processor = real_processor(tile, patch, pinpoints, max_tiles)
    rule = OnevisionTokenRule(tile, patch, pinpoints, max_tiles)
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    rng = random.Random(tile)
    scale = 4 * tile
    sizes = [(rng.randint(1, 3 * scale), rng.randint(1, 3 * scale)) for _ in range(80)]
    sizes += [(scale * 5, scale // 4 or 1), (1, 1), (tile, tile), (scale // 7 or 1, scale * 3)]  # extreme ratios
    for width, height in sizes:
        counted = processor._get_num_multimodal_tokens(image_sizes=[(height, width)])["num_image_tokens"][0]
        assert rule.image(width, height)[1] == counted, (width, height)
        if tile <= 16:  # the full processor on the small checkpoints: its tiles and written tokens
            out = processor(text=["<image> hi"], images=[Image.new("RGB", (width, height))], return_tensors="pt")
            written = int((out["input_ids"] == image_id).sum())
            assert rule.image(width, height) == (out["pixel_values"].shape[1], written), (width, height)
    pair = [(50, 20), (20, 70)] if tile <= 16 else [(640, 480), (300, 900)]
    out = processor(text=["<image> a <image>"], images=[[Image.new("RGB", size) for size in pair]], return_tensors="pt")
    assert sum(tokens for _, tokens in rule.images(pair)) == int((out["input_ids"] == image_id).sum())
    assert [tiles for tiles, _ in rule.images(pair)] == [1, 1] and out["pixel_values"].shape[1] == 1
    for frames in (1, 4, 32):
        expected = processor._get_num_multimodal_tokens(video_sizes=[(frames, tile, tile)])["num_video_tokens"][0]
        assert rule.video(frames) == (frames, expected)


def test_the_demo_anyres_policy_tiles_as_the_processor_but_counts_tokens_its_own_way():
    """Item 6: on examples/data's single images the demo policy's tiles are LLaVA-OneVision's
    (its grid rule differs on a few sizes), its tokens never are (no un-padding, newlines or pooling)."""
    pinpoints = tuple((384 * r, 384 * c) for r in range(1, 7) for c in range(1, 7))
    rule = OnevisionTokenRule(384, 14, pinpoints, 9)
    same_tiles = same_tokens = total = 0
    for path in sorted(EXAMPLES.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            images = json.loads(line).get("images") or []
            if len(images) != 1:
                continue
            (width, height), total = images[0], total + 1
            demo, real = DEFAULT_POLICY.image_units(width, height), rule.image(width, height)
            same_tiles += demo[0] == real[0]
            same_tokens += demo[1] == real[1]
    assert total > 1000
    assert same_tiles / total > 0.99 and same_tokens == 0, (same_tiles, same_tokens, total)


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_check_model_matches_hf_on_another_checkpoint(tmp_path, stages):
    model = build_tiny_llava_onevision(tmp_path / "m", pinpoints=OTHER_PINPOINTS, max_tiles=1, tile=12, patch=3, seed=2)
    report = check_model(model, stages=stages)
    assert report.ok and report.max_rel_err <= 1e-4 and report.packed_max_rel_err <= 1e-4, report.line()
    assert len(report.bounds) == stages + 1


@pytest.fixture(scope="module")
def onevision_data(tmp_path_factory):
    """A tiny model, 16 LLaVA records (1-3 images of 24-400 px, text-only ones) and 4 short videos."""
    from dflop_ds.testing.video import add_video_records

    root = tmp_path_factory.mktemp("onevision")
    model = build_tiny_llava_onevision(root / "m", tie_word_embeddings=True)
    data, images = write_llava_dataset(root / "data", 16, seed=5, text_only=0.2)
    add_video_records(data, root / "videos", 4, seed=5)
    return model, data, images, root / "videos"


def test_dataset_microbatches_give_hf_loss_and_packed_equals_padded(onevision_data):
    model, data, images, videos = onevision_data
    source = hf_source(str(model), image_folder=str(images), video_folder=str(videos))
    shapes = source.read_shapes(str(data), "error")
    kinds = {shape.modality for shape in shapes}
    assert kinds == {"text", "image", "multi_image", "video"}, kinds
    dataset = source.make_dataset(shapes, str(data))
    layers = [*source.encoder_layers, source.projector, *source.llm_layers]
    hf_model = source.hf_model.eval()
    by_kind = {kind: [i for i, s in enumerate(shapes) if s.modality == kind] for kind in kinds}
    batches = [
        [by_kind["image"][0], by_kind["multi_image"][0], by_kind["text"][0]],
        [by_kind["text"][0]],
        [by_kind["video"][0], by_kind["image"][-1]],
        [by_kind["video"][1]],
    ]
    for batch in batches:
        items = [dataset[i] for i in batch]
        for i, item in zip(batch, items):
            assert (
                item.pixel_values.shape[0] == shapes[i].encoder_tiles and item.input_ids.numel() == shapes[i].llm_tokens
            )
        inputs, labels = source.collate(items)
        logits, _ = run_stages(layers, [0, len(layers)], inputs)
        loss = token_normalized_loss(logits, labels)
        with torch.no_grad():
            reference = hf_model(**onevision_hf_kwargs(inputs), labels=hf_labels(labels[0])).loss
        assert torch.allclose(loss, reference, rtol=1e-5), (batch, float(loss), float(reference))
        packed_inputs, packed_labels = source.packed_collate(items)
        packed_logits, _ = run_stages(layers, [0, len(layers)], packed_inputs)
        assert torch.allclose(token_normalized_loss(packed_logits, packed_labels), loss, rtol=1e-5)


def test_registry_finds_the_family_and_the_policy_counts_tiles(onevision_data):
    from dflop_ds.models.hf.preprocessor import hf_preprocessor
    from dflop_ds.models.hf.registry import family_of

    model, *_ = onevision_data
    assert family_of(model).name == "LLaVA-OneVision"
    policy = hf_preprocessor(str(model), video_max_frames=3).policy()
    shape = policy.shape("s", image_sizes=[(40, 17)], video_frames=10, text_tokens=5)
    rule_tiles, rule_tokens = policy.sample_images([(40, 17)])[0]  # type: ignore[misc]
    assert shape.encoder_tiles == rule_tiles + 3 and shape.encoder_attention == 0
    assert shape.visual_tokens == rule_tokens + 3 * 4 + 1  # 3 frames of 2 x 2 pooled features, one newline
    assert policy.describe()["sample_images"].startswith("OnevisionTokenRule(")


@pytest.mark.slow
def test_llava_onevision_trains_on_two_ranks_with_zero2(tmp_path, onevision_data, train):
    assert_trains_with_media(
        train, "hf_zero2.json", onevision_data, tmp_path / "trained", "llava_onevision", zero_stage=2
    )


def test_profiling_target_sweeps_tiles_and_fits_a_cost_model_with_the_family_policy(onevision_data):
    from dflop_ds.cost import FittedCostModel
    from dflop_ds.models.hf.profile import hf_target
    from dflop_ds.profile.model import profile_model

    model, *_ = onevision_data
    target = hf_target(str(model))
    x = target.encoder_inputs(5, 2)  # 3 + 2 one-tile images (16 features and a newline each)
    image_id = target.encoder_inputs.image_token_id  # type: ignore[attr-defined]
    assert x[3][:, 0].tolist() == [0, 0, 0, 1, 1] and (x[1] == image_id).sum(1).tolist() == [3 * 17, 2 * 17]
    for layer in [*target.encoder_layers, target.projector]:
        x = layer(x)
    assert x[0].shape[:2] == (2, 3 * 17 + 8)
    profile = profile_model(
        **target.profile_kwargs(), tiles=(1, 4), seq_lens=(16,), batch_sizes=(1,), repeats=1, warmup=0, progress=False
    )
    cost_model = FittedCostModel().fit(profile, target.policy)
    assert cost_model.shape_policy["sample_images"].startswith("OnevisionTokenRule(")
