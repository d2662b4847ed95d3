"""The analytic reference models of encoder-heavy MLLMs and the shape policies they are paired with."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflop_ds.cost import AnalyticMLLM, reference_model, reference_names, reference_policy
from dflop_ds.cost.analytic import REFERENCE_MLLMS
from dflop_ds.cost.reference_policies import REFERENCE_POLICIES, NativeResolution
from dflop_ds.data import read_manifest
from dflop_ds.plan.projection import encoder_share

ROOT = Path(__file__).resolve().parents[1]


def test_every_reference_model_has_a_policy_and_loads_on_both_gpus() -> None:
    assert set(REFERENCE_POLICIES) == set(REFERENCE_MLLMS)
    for name in reference_names():
        model = reference_model(name)
        assert model.is_analytic and model.name == name
        assert AnalyticMLLM.from_dict(model.to_dict()) == model
        assert reference_policy(name) is REFERENCE_POLICIES[name.rpartition("-")[0]]
    with pytest.raises(KeyError, match="unknown reference model"):
        reference_policy("qwen2-vl-7b-h100")


@pytest.mark.parametrize(
    ("name", "encoder_params", "llm_params", "depths"),
    [
        ("qwen2-vl-2b-h100", (0.60e9, 0.70e9), (1.3e9, 1.8e9), (32, 28)),  # 675M ViT, Qwen2-1.5B
        ("internvl2.5-26b-a100", (5.4e9, 6.0e9), (19.0e9, 20.5e9), (45, 48)),  # InternViT-6B, InternLM2.5-20B
    ],
)
def test_the_new_models_have_their_published_sizes(name, encoder_params, llm_params, depths) -> None:
    model = reference_model(name)
    assert encoder_params[0] < model.param_bytes["encoder"] / 2 < encoder_params[1]
    assert llm_params[0] < model.param_bytes["llm"] / 2 < llm_params[1]
    assert (model.encoder_layers, model.llm_layers) == depths
    assert model.merge == 4


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [
        ("llava-ov-0.5b-h100", 0.57, 0.59),  # 57.9%, as issue 35 states
        ("qwen2-vl-2b-h100", 0.50, 0.65),
        ("internvl2.5-26b-h100", 0.45, 0.60),
        ("llava-ov-7b-h100", 0.10, 0.11),
    ],
)
def test_encoder_shares_of_the_bundled_mixture(name: str, low: float, high: float) -> None:
    shapes = list(read_manifest(ROOT / "examples/data/mixture.jsonl", reference_policy(name)))
    assert low < encoder_share(reference_model(name), shapes) < high


def test_native_resolution_keeps_the_aspect_and_the_pixel_bounds() -> None:
    rule = NativeResolution(patch=14, merge=2, min_pixels=3136, max_pixels=12845056)
    assert rule.grid(640, 480) == (17, 23)  # 476 x 644 px
    assert rule(640, 480) == (17 * 23, 17 * 23)
    rows, cols = rule.grid(8000, 6000)  # 48 Mpx scaled down under max_pixels
    assert rows * cols * 28 * 28 <= 12845056 and abs(cols / rows - 4 / 3) < 0.05
    assert rule.grid(20, 20) == (2, 2)  # raised to min_pixels: 56 x 56 px
    policy = reference_policy("qwen2-vl-2b")
    video = policy.shape("v", video_frames=300, text_tokens=10)
    assert (video.encoder_tiles, video.visual_tokens) == (32 * 128, 32 * 128)
