"""InternVL: the tiling rule against the real ``GotOcr2ImageProcessor`` and ``InternVLProcessor``
(built offline in-process), the layer lists against HF's forward at 1-3 stages (check-model), the
data pipeline's microbatches (tiled images, several images, videos through PyAV, text-only) against
HF's loss, packed against padded, and two ranks of ZeRO-2 training."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from hf_stage_checks import assert_trains_with_media  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import InternVLProcessor  # noqa: E402
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil  # noqa: E402

from dflop_ds.models.hf.base.synthetic import hf_labels, hf_model_kwargs  # noqa: E402
from dflop_ds.models.hf.check import check_model, run_stages  # noqa: E402
from dflop_ds.models.hf.internvl.shapes import InternVLTileRule  # noqa: E402
from dflop_ds.models.hf.source import hf_source  # noqa: E402
from dflop_ds.pipe.loss import token_normalized_loss  # noqa: E402
from dflop_ds.testing.internvl_tiny import build_internvl_tokenizer, build_tiny_internvl  # noqa: E402
from dflop_ds.testing.llava_data import write_llava_dataset  # noqa: E402


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


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_check_model_matches_hf_on_another_checkpoint(tmp_path, stages):
    model = build_tiny_internvl(tmp_path / "m", min_tiles=2, max_tiles=4, feature_layer=-2, seed=3)
    report = check_model(model, stages=stages)
    assert report.ok and report.max_rel_err <= 1e-4 and report.packed_max_rel_err <= 1e-4, report.line()


@pytest.fixture(scope="module")
def internvl_data(tmp_path_factory):
    """A tiny model (tied embeddings), 16 LLaVA records (1-3 images, text-only ones) and 4 short videos."""
    from dflop_ds.testing.video import add_video_records

    root = tmp_path_factory.mktemp("internvl")
    model = build_tiny_internvl(root / "m", max_tiles=4, tie_word_embeddings=True)
    data, images = write_llava_dataset(root / "data", 16, seed=6, text_only=0.2)
    add_video_records(data, root / "videos", 4, seed=6)
    return model, data, images, root / "videos"


def test_dataset_microbatches_give_hf_loss_and_packed_equals_padded(internvl_data):
    model, data, images, videos = internvl_data
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
    ]
    for batch in batches:
        items = [dataset[i] for i in batch]
        for i, item in zip(batch, items):
            assert item.pixel_values.shape[0] == shapes[i].encoder_tiles
            assert item.input_ids.numel() == shapes[i].llm_tokens
        inputs, labels = source.collate(items)
        logits, _ = run_stages(layers, [0, len(layers)], inputs)
        loss = token_normalized_loss(logits, labels)
        with torch.no_grad():
            reference = hf_model(**hf_model_kwargs(inputs), labels=hf_labels(labels[0])).loss
        assert torch.allclose(loss, reference, rtol=1e-5), (batch, float(loss), float(reference))
        packed_inputs, packed_labels = source.packed_collate(items)
        packed_logits, _ = run_stages(layers, [0, len(layers)], packed_inputs)
        assert torch.allclose(token_normalized_loss(packed_logits, packed_labels), loss, rtol=1e-5)


@pytest.mark.slow
def test_internvl_trains_on_two_ranks_with_zero2(tmp_path, internvl_data, train):
    assert_trains_with_media(train, "hf_zero2.json", internvl_data, tmp_path / "trained", "internvl", zero_stage=2)


def test_profiling_target_sweeps_tiles_and_fits_a_cost_model_with_the_family_policy(internvl_data):
    from dflop_ds.cost import FittedCostModel
    from dflop_ds.models.hf.profile import hf_target
    from dflop_ds.profile.model import profile_model

    model, *_ = internvl_data
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
