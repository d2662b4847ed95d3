"""InternVL: the tiling rule against the real ``GotOcr2ImageProcessor`` and ``InternVLProcessor``
(built offline in-process), check-model on another checkpoint, the profiling target. The contract
every family passes (check-model at 1-3 stages, the data pipeline against HF's loss, packed against
padded, the image-free guard, 2-rank ZeRO-2 training) is in test_family_contract.py."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from PIL import Image  # noqa: E402
from transformers import InternVLProcessor  # noqa: E402
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil  # noqa: E402

from dflop_ds.models.hf.check import check_model  # noqa: E402
from dflop_ds.models.hf.internvl.shapes import InternVLTileRule  # noqa: E402
from dflop_ds.testing.internvl_tiny import build_internvl_tokenizer, build_tiny_internvl  # noqa: E402


class ImageOnlyProcessor(InternVLProcessor):
    """The real processor without its video processor (which needs torchvision, absent here)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


@pytest.mark.parametrize("tile,min_tiles,max_tiles", [(16, 1, 6), (448, 1, 12), (24, 2, 9), (32, 1, 1)])
def test_tiling_rule_counts_as_the_processor_does(tile, min_tiles, max_tiles):
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": tile, "width": tile}, crop_to_patches=True, min_patches=min_tiles, max_patches=max_tiles
    )
    processor = ImageOnlyProcessor(
        image_processor=image_processor, tokenizer=build_internvl_tokenizer(), video_processor=None, image_seq_length=3
    )
    rule = InternVLTileRule(tile, min_tiles, max_tiles, 3)
    rng = random.Random(tile + max_tiles)
    sizes = [(rng.randint(1, 8 * tile), rng.randint(1, 8 * tile)) for _ in range(80)]
    sizes += [(tile, tile), (1, 1), (10 * tile, tile // 2 or 1), (tile // 3 or 1, 9 * tile), (2 * tile, tile)]
    for width, height in sizes:
        tiles, tokens = rule.image(width, height)
        assert tiles == image_processor.get_number_of_image_patches(height, width, {}), (width, height)
        assert tokens + 2 == processor._get_num_multimodal_tokens(image_sizes=[(height, width)])["num_image_tokens"][0]
        if tile <= 32 and max(width, height) <= 4 * tile:  # the full processor on small images
            out = processor(text=["<IMG_CONTEXT> hi"], images=[Image.new("RGB", (width, height))], return_tensors="pt")
            assert out["pixel_values"].shape[0] == tiles
            assert int((out["input_ids"] == processor.image_token_id).sum()) == tokens


@pytest.mark.parametrize("stages", [3])  # 1-3 stages on the default checkpoint: test_family_contract.py
def test_check_model_matches_hf_on_another_checkpoint(tmp_path, stages):
    model = build_tiny_internvl(tmp_path / "m", min_tiles=2, max_tiles=4, feature_layer=-2, seed=3)
    report = check_model(model, stages=stages)
    assert report.ok and report.max_rel_err <= 1e-4 and report.packed_max_rel_err <= 1e-4, report.line()


@pytest.fixture(scope="module")
def internvl_model(tmp_path_factory):
    """A tiny model with tied embeddings (its data pipeline and 2-rank training: test_family_contract.py)."""
    return build_tiny_internvl(tmp_path_factory.mktemp("internvl") / "m", max_tiles=4, tie_word_embeddings=True)


def test_profiling_target_sweeps_tiles_and_fits_a_cost_model_with_the_family_policy(internvl_model):
    from dflop_ds.cost import FittedCostModel
    from dflop_ds.models.hf.profile import hf_target
    from dflop_ds.profile.model import profile_model

    model = internvl_model
    target = hf_target(str(model))
    x = target.encoder_inputs(5, 2)
    for layer in [*target.encoder_layers, target.projector]:
        x = layer(x)
    assert x[0].shape[:2] == (2, 3 * 4 + 8)  # 3 tiles of 4 pixel-shuffled tokens, 8 text tokens
    profile = profile_model(
        **target.profile_kwargs(), tiles=(1, 4), seq_lens=(16,), batch_sizes=(1,), repeats=1, warmup=0, progress=False
    )
    cost_model = FittedCostModel().fit(profile, target.policy)
    assert cost_model.shape_policy["sample_images"].startswith("InternVLTileRule(")
