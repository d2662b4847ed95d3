"""The HF Qwen2-VL adapter: layer lists vs the HF model's own forward (tiny random models, built offline)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from hf_stage_checks import assert_qwen2_vl_packs, assert_stages_match_hf  # noqa: E402

from dflop_ds.commands.main import main  # noqa: E402
from dflop_ds.models.hf.base import mrope  # noqa: E402
from dflop_ds.models.hf.base.layers import run_layers  # noqa: E402
from dflop_ds.models.hf.check import random_image  # noqa: E402
from dflop_ds.models.hf.qwen2_vl import model as qwen2_vl  # noqa: E402
from dflop_ds.models.hf.qwen2_vl.model import load_qwen2_vl, mrope_position_ids, qwen2_vl_layers  # noqa: E402
from dflop_ds.models.hf.qwen2_vl.synthetic import IMAGE_MARK, Qwen2VLInputs, qwen2_vl_hf_forward, qwen2_vl_hf_positions  # noqa: E402
from dflop_ds.pipe import token_normalized_loss  # noqa: E402
from dflop_ds.testing.qwen2_vl_tiny import build_tiny_qwen2_vl  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(
    scope="module",
    params=[("qwen2_vl", False), ("qwen2_vl", True), ("qwen2_5_vl", False)],
    ids=["qwen2_vl", "qwen2_vl-tied", "qwen2_5_vl"],
)
def loaded(request, tmp_path_factory: pytest.TempPathFactory):
    family, tied = request.param
    folder = build_tiny_qwen2_vl(tmp_path_factory.mktemp(family), family=family, tie_word_embeddings=tied, seed=3)
    model = load_qwen2_vl(folder).eval()
    return model, Qwen2VLInputs.from_dir(folder, model.config), folder


def microbatches(seed: int = 0) -> list[list[tuple]]:
    rng = random.Random(seed)
    return [
        [
            (f"USER: look at {IMAGE_MARK} what is shown? ASSISTANT:", "a red car on a road", [random_image(rng)]),
            ("USER: hello there, thanks ASSISTANT:", "hi", []),
        ],
        [("USER: hi ASSISTANT:", "hello there", []), ("USER: describe the sea ASSISTANT:", "a road", [])],
        [
            (
                f"USER: compare {IMAGE_MARK} and {IMAGE_MARK} please ASSISTANT:",
                "two images",
                [random_image(rng), random_image(rng)],
            ),
            (f"{IMAGE_MARK} what is it? ASSISTANT:", "the sea", [random_image(rng)]),
        ],
    ]


def test_images_keep_their_own_grids(loaded) -> None:
    """Images of different sizes in one microbatch give different patch grids and token counts."""
    model, inputs_of, _ = loaded
    inputs, _ = inputs_of.microbatch(microbatches()[2])
    pixel_values, input_ids, _, grid, _ = inputs
    assert grid.shape == (3, 3) and len({tuple(g) for g in grid.tolist()}) == 3
    assert pixel_values.shape[0] == int(grid.prod(-1).sum())
    merge = model.config.vision_config.spatial_merge_size
    assert int((input_ids == model.config.image_token_id).sum()) == int(grid.prod(-1).sum()) // merge**2


def test_layer_lists_match_hf_for_1_2_3_stages(loaded) -> None:
    model, inputs_of, _ = loaded
    encoder, projector, llm = qwen2_vl_layers(model)
    layers = [*encoder, projector, *llm]
    for samples in microbatches():
        inputs, labels = inputs_of.microbatch(samples)
        with torch.no_grad():
            reference = qwen2_vl_hf_forward(model, inputs, labels[0])
        assert_stages_match_hf(layers, len(encoder) + 1, inputs, labels, reference)


def test_gradients_match_hf_and_text_only_microbatches_reach_the_tower(loaded) -> None:
    """Same gradients as HF's backward; a text-only microbatch still gives every vision weight a
    (zero) gradient through the placeholder image, so every ZeRO rank reduces the same tensors."""
    model, inputs_of, _ = loaded
    encoder, projector, llm = qwen2_vl_layers(model)
    layers = torch.nn.Sequential(*encoder, projector, *llm)
    params = dict(model.named_parameters())
    for samples in microbatches(1)[:2]:
        inputs, labels = inputs_of.microbatch(samples)
        model.zero_grad()
        qwen2_vl_hf_forward(model, inputs, labels[0]).loss.backward()
        expected = {name: None if p.grad is None else p.grad.clone() for name, p in params.items()}
        model.zero_grad()
        token_normalized_loss(layers(inputs), labels).backward()
        for name, p in params.items():
            if expected[name] is None:  # HF skips the tower without images; the placeholder's gradient is zero
                assert p.grad is not None and not p.grad.any(), name
            else:
                torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_position_ids_equal_hf(loaded) -> None:
    """The projector's M-RoPE positions are HF's ``get_rope_index`` (images), or 0..S-1 (text only)."""
    model, inputs_of, _ = loaded
    encoder, projector, _ = qwen2_vl_layers(model)
    for samples in microbatches(2):
        inputs, _ = inputs_of.microbatch(samples)
        _, position_ids, _ = run_layers([*encoder, projector], inputs)
        assert position_ids.shape == (3, *inputs[1].shape) and not position_ids.is_floating_point()
        assert torch.equal(position_ids, qwen2_vl_hf_positions(model, inputs))
        if inputs[3].shape[0]:
            assert not torch.equal(position_ids[1], position_ids[2])  # height and width differ on images


def test_packed_microbatch_gives_each_sample_its_own_positions_and_the_padded_loss(loaded) -> None:
    """Images of different sizes and text-only samples in one packed row, at 1 and 2 stages."""
    model, inputs_of, _ = loaded
    assert_qwen2_vl_packs(model, inputs_of, microbatches(3)[0] + microbatches(3)[2])


def test_mrope_refuses_grids_that_do_not_match_the_image_tokens() -> None:
    ids = torch.tensor([[5, 9, 9, 9, 9, 6]])
    grid = torch.tensor([[1, 4, 4]])  # 4 tokens with merge 2: matches
    positions = mrope_position_ids(ids, torch.tensor([6]), grid, image_token_id=9, merge_size=2)
    assert positions[:, 0].tolist() == [[0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 2, 3]]
    with pytest.raises(ValueError, match="run of 4 image tokens at position 1 does not match"):
        mrope_position_ids(ids, torch.tensor([6]), torch.tensor([[1, 2, 4]]), image_token_id=9, merge_size=2)
    with pytest.raises(ValueError, match="1 image grid"):
        mrope_position_ids(ids, torch.tensor([6]), torch.cat([grid, grid]), image_token_id=9, merge_size=2)
    packed = torch.tensor([[5, 9, 9, 9, 9, 6, 7, 7, 5, 9, 9, 9, 9]])  # 3 samples, each counting from 0
    two = torch.cat([grid, grid])
    positions = mrope_position_ids(packed, torch.tensor([6, 2, 5]), two, image_token_id=9, merge_size=2)
    assert positions[:, 0].tolist() == [
        [0, 1, 1, 1, 1, 3, 0, 1, 0, 1, 1, 1, 1],
        [0, 1, 1, 2, 2, 3, 0, 1, 0, 1, 1, 2, 2],
        [0, 1, 2, 1, 2, 3, 0, 1, 0, 1, 2, 1, 2],
    ]
    with pytest.raises(ValueError, match="packed microbatch is one row of sum"):
        mrope_position_ids(packed, torch.tensor([6, 2, 4]), two, image_token_id=9, merge_size=2)


def test_projector_refuses_feature_count_mismatch(loaded) -> None:
    model, inputs_of, _ = loaded
    encoder, projector, _ = qwen2_vl_layers(model)
    inputs, _ = inputs_of.microbatch(microbatches()[0])
    x = inputs
    for layer in encoder:
        x = layer(x)
    vis, input_ids, seq_lens, grid, video_grid = x
    with pytest.raises(ValueError, match="video tokens but its 1 image"):
        projector((vis[:-4], input_ids, seq_lens, grid, video_grid))


@pytest.mark.parametrize("stages", [2, 3])
def test_check_model_passes(loaded, stages: int, capsys) -> None:
    _, _, folder = loaded
    assert main(["check-model", str(folder), "--stages", str(stages)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"{stages} stage(s)" in line and "match HF" in line
    assert float(line.rsplit("max_rel_err=", 1)[1]) <= 1e-4


def test_check_model_names_wrong_positions(tmp_path: Path, capsys, monkeypatch) -> None:
    """Plain 1-D positions instead of M-RoPE: only the microbatches with images or videos differ, at the first
    decoder stage."""
    folder = build_tiny_qwen2_vl(tmp_path / "m", seed=3)
    real = mrope.mrope_position_ids
    monkeypatch.setattr(
        mrope,
        "mrope_position_ids",
        lambda ids, lens, grid, **kw: real(ids, lens, grid[:0], **{**kw, "video_grid_thw": None}),
    )
    assert main(["check-model", str(folder), "--stages", "3"]) == 1
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "DIFFER from HF" in line and "text-only microbatch" not in line
    assert "stage 1 output (layer 5 MRopeDecoderLayer) already differs" in line


def test_check_model_names_a_tower_without_windows(tmp_path: Path, capsys, monkeypatch) -> None:
    """Qwen2.5-VL attending over whole images instead of its windows differs already in the tower."""
    folder = build_tiny_qwen2_vl(tmp_path / "m", family="qwen2_5_vl", seed=3)
    monkeypatch.setattr(qwen2_vl, "window_index", lambda grid, config: None)
    assert main(["check-model", str(folder), "--stages", "3"]) == 1
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "DIFFER from HF" in line and "text-only microbatch" not in line
    assert "stage 0 output (layer 2 VisionBlock) already differs" in line


def test_image_processor_that_disagrees_with_the_model(tmp_path: Path, capsys) -> None:
    from transformers import AutoImageProcessor

    folder = build_tiny_qwen2_vl(tmp_path / "m")
    image_processor = AutoImageProcessor.from_pretrained(folder)
    image_processor.patch_size = 8
    image_processor.save_pretrained(folder)
    assert main(["check-model", str(folder)]) == 1
    err = capsys.readouterr().err
    assert str(folder) in err and "patch_size=8 but the model's vision config has 4" in err
