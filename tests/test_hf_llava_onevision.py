"""LLaVA-OneVision: the counting rule against the real ``LlavaOnevisionProcessor`` (built offline
in-process), check-model on another checkpoint, the registry and the profiling target. The contract
every family passes (check-model at 1-3 stages, the data pipeline against HF's loss, packed against
padded, the image-free guard, 2-rank ZeRO-2 training) is in test_family_contract.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from PIL import Image  # noqa: E402
from transformers import LlavaOnevisionProcessor  # noqa: E402

from dflop_ds.models.hf.check import check_model  # noqa: E402
from dflop_ds.models.hf.llava_onevision.shapes import OnevisionTokenRule  # noqa: E402
from dflop_ds.shapes import DEFAULT_POLICY  # noqa: E402
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


@pytest.mark.parametrize("stages", [3])  # 1-3 stages on the default checkpoint: test_family_contract.py
def test_check_model_matches_hf_on_another_checkpoint(tmp_path, stages):
    model = build_tiny_llava_onevision(tmp_path / "m", pinpoints=OTHER_PINPOINTS, max_tiles=1, tile=12, patch=3, seed=2)
    report = check_model(model, stages=stages)
    assert report.ok and report.max_rel_err <= 1e-4 and report.packed_max_rel_err <= 1e-4, report.line()
    assert len(report.bounds) == stages + 1


@pytest.fixture(scope="module")
def onevision_model(tmp_path_factory):
    """A tiny model with tied embeddings (its data pipeline and 2-rank training: test_family_contract.py)."""
    return build_tiny_llava_onevision(tmp_path_factory.mktemp("onevision") / "m", tie_word_embeddings=True)


def test_registry_finds_the_family_and_the_policy_counts_tiles(onevision_model):
    from dflop_ds.models.hf.preprocessor import hf_preprocessor
    from dflop_ds.models.hf.registry import family_of

    model = onevision_model
    assert family_of(model).name == "LLaVA-OneVision"
    policy = hf_preprocessor(str(model), video_max_frames=3).policy()
    shape = policy.shape("s", image_sizes=[(40, 17)], video_frames=10, text_tokens=5)
    rule_tiles, rule_tokens = policy.sample_images([(40, 17)])[0]  # type: ignore[misc]
    assert shape.encoder_tiles == rule_tiles + 3 and shape.encoder_attention == 0
    assert shape.visual_tokens == rule_tokens + 3 * 4 + 1  # 3 frames of 2 x 2 pooled features, one newline
    assert policy.describe()["sample_images"].startswith("OnevisionTokenRule(")


def test_profiling_target_sweeps_tiles_and_fits_a_cost_model_with_the_family_policy(onevision_model):
    from dflop_ds.cost import FittedCostModel
    from dflop_ds.models.hf.profile import hf_target
    from dflop_ds.profile.model import profile_model

    model = onevision_model
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
