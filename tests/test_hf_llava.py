"""The HF LLaVA adapter: layer lists vs the HF model's own forward (tiny random models, built offline)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from ds_runs import run_pipeline_variants  # noqa: E402
from hf_stage_checks import assert_packed_matches_padded, assert_stages_match_hf  # noqa: E402

from dflop_ds.models.hf.base.layers import (
    TIED_EMBEDDING_KEY,
    run_layers,  # noqa: E402
)
from dflop_ds.models.hf.base.packed import PACKED_ATTENTION, packed_attention, segment_attention  # noqa: E402
from dflop_ds.models.hf.base.synthetic import contract_microbatch, hf_forward  # noqa: E402
from dflop_ds.models.hf.check import random_image, run_stages  # noqa: E402
from dflop_ds.models.hf.llava.model import check_llava_config, llava_layers, load_llava
from dflop_ds.models.hf.llava.processor import processor_image_tokens  # noqa: E402
from dflop_ds.pipe import plan_stage_bounds, token_loss_sum, token_normalized_loss  # noqa: E402
from dflop_ds.testing.hf_tiny import TOKENS_PER_IMAGE, build_tiny_llava  # noqa: E402

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]

# (vision, text, tied, sliding_window): both tower families, the three text families, ties and windows
MODELS = [
    ("clip", "llama", False, None),
    ("siglip", "qwen2", True, None),
    ("clip", "mistral", False, 8),
    ("siglip", "mistral", True, None),
    ("clip", "qwen2", False, 8),
]


def loaded(tmp_path_factory: pytest.TempPathFactory, vision: str, text: str, tied: bool, window: int | None):
    from transformers import AutoProcessor

    folder = build_tiny_llava(
        tmp_path_factory.mktemp(f"{vision}_{text}"),
        vision=vision,
        text=text,
        tie_word_embeddings=tied,
        sliding_window=window,
        seed=3,
    )
    return load_llava(folder), AutoProcessor.from_pretrained(folder), folder


def microbatches(seed: int = 0) -> list[list[tuple]]:
    import random

    rng = random.Random(seed)
    return [
        [
            ("USER: look at <image> what is shown? ASSISTANT:", "a red car on a road", [random_image(rng)]),
            ("USER: hello there, thanks ASSISTANT:", "hi", []),
        ],
        [("USER: hi ASSISTANT:", "hello there", []), ("USER: describe the sea ASSISTANT:", "a road", [])],
        [("USER: compare <image> and <image> please ASSISTANT:", "two images", [random_image(rng), random_image(rng)])],
    ]


@pytest.mark.parametrize("vision,text,tied,window", MODELS)
def test_layer_lists_match_hf_for_1_2_3_stages(tmp_path_factory, vision, text, tied, window) -> None:
    model, processor, _ = loaded(tmp_path_factory, vision, text, tied, window)
    encoder, projector, llm = llava_layers(model)
    layers = [*encoder, projector, *llm]
    for samples in microbatches():
        inputs, labels = contract_microbatch(processor, samples)
        with torch.no_grad():
            reference = hf_forward(model, inputs, labels[0])
        assert_stages_match_hf(layers, len(encoder) + 1, inputs, labels, reference)


@pytest.mark.parametrize(
    "vision,text,tied,window", [MODELS[0], MODELS[1], MODELS[2]], ids=["llama", "qwen2-tied", "mistral-window"]
)
def test_packed_microbatch_gives_the_padded_loss_and_gradients(tmp_path_factory, vision, text, tied, window) -> None:
    """Images and text-only samples of different lengths in one row, at 1 and 2 stages."""
    model, processor, _ = loaded(tmp_path_factory, vision, text, tied, window)
    encoder, projector, llm = llava_layers(model)
    samples = [sample for microbatch in microbatches(4) for sample in microbatch]
    padded, packed = (contract_microbatch(processor, samples, packed=p) for p in (False, True))
    assert_packed_matches_padded([*encoder, projector, *llm], len(encoder) + 1, padded, packed)


def test_packed_attention_costs_the_sum_of_squared_lengths(tmp_path_factory, monkeypatch) -> None:
    """One SDPA per sample (no N x N mask), whatever the model's implementation, which comes back after."""
    model, processor, _ = loaded(tmp_path_factory, "clip", "llama", False, None)
    model.set_attn_implementation("eager")  # HF's own path would then call no SDPA at all
    encoder, projector, llm = llava_layers(model)
    samples = [sample for microbatch in microbatches(5) for sample in microbatch]
    inputs, labels = contract_microbatch(processor, samples, packed=True)
    hidden = run_layers([*encoder, projector], inputs)
    real_sdpa, shapes = torch.nn.functional.scaled_dot_product_attention, []

    def spy(q, k, v, *args, **kwargs):
        shapes.append((q.shape[-2], k.shape[-2]))
        return real_sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    logits = run_layers(llm, hidden)
    lengths = inputs[2].tolist()
    assert len(set(lengths)) > 1 and logits.shape[:2] == (1, sum(lengths))
    assert sum(q * k for q, k in shapes) == (len(llm) - 1) * sum(n * n for n in lengths)
    assert model.config.text_config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="packed microbatches only"):
        segment_attention(llm[0].layer.self_attn, *[hidden[0][:, None]] * 3, torch.ones(1, dtype=torch.bool))


def test_a_flash_attention_model_keeps_its_own_varlen_path() -> None:
    """Under flash attention transformers reads the packed samples' bounds itself: nothing is swapped."""
    from transformers import LlamaConfig

    config = LlamaConfig()
    config._attn_implementation_internal = "flash_attention_2"
    with packed_attention(config):
        assert config._attn_implementation == "flash_attention_2"
    config._attn_implementation_internal = "sdpa"
    with packed_attention(config):
        assert config._attn_implementation == PACKED_ATTENTION
    assert config._attn_implementation == "sdpa"


def test_global_token_mean_over_microbatches_equals_hf(tmp_path_factory) -> None:
    """Scheduled denominators: the microbatch losses sum to HF's token mean over the whole batch."""
    model, processor, _ = loaded(tmp_path_factory, "clip", "llama", False, None)
    encoder, projector, llm = llava_layers(model)
    layers = torch.nn.Sequential(*encoder, projector, *llm)
    mbs = microbatches(1)
    own = [contract_microbatch(processor, mb) for mb in mbs]
    total = sum(float(labels[1]) for _, labels in own)
    gas = len(mbs)
    summed = (
        sum(
            token_normalized_loss(layers(inputs), (labels[0], torch.tensor(total / gas, dtype=torch.float64)))
            for inputs, labels in own
        )
        / gas
    )  # the engine divides each microbatch loss by GAS
    inputs, labels = contract_microbatch(processor, [s for mb in mbs for s in mb])
    with torch.no_grad():
        hf_loss = hf_forward(model, inputs, labels[0]).loss
    assert float(labels[1]) == total
    torch.testing.assert_close(summed, hf_loss, rtol=1e-5, atol=1e-6)
    # a per-microbatch mean would be a different number on these uneven microbatches
    per_mb = sum(token_loss_sum(layers(inputs), labels[0]) / labels[1] for inputs, labels in own) / gas
    assert abs(float(per_mb.detach()) - float(hf_loss)) > 1e-4


def test_image_features_go_where_the_image_tokens_are(tmp_path_factory) -> None:
    model, processor, _ = loaded(tmp_path_factory, "siglip", "qwen2", True, None)
    encoder, projector, llm = llava_layers(model)
    image = [random_image(__import__("random").Random(2))]
    first = contract_microbatch(processor, [("USER: <image> hello there ASSISTANT:", "hi", image)])
    inside = contract_microbatch(processor, [("USER: hello <image> there ASSISTANT:", "hi", image)])
    ids = inside[0][1][0]
    positions = (ids == model.config.image_token_id).nonzero().flatten()
    assert positions.numel() == TOKENS_PER_IMAGE and int(positions[0]) > 2  # placeholder inside the prompt
    layers = [*encoder, projector]
    hidden_first, hidden_inside = (run_stages(layers, [0, len(layers)], mb[0])[0][0] for mb in (first, inside))
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values=inside[0][0]).pooler_output[0]
    torch.testing.assert_close(hidden_inside[0, positions], features)
    assert not torch.allclose(hidden_first[0, positions], features)
    with pytest.raises(ValueError, match="image tokens"):
        projector((run_stages(encoder, [0, len(encoder)], inside[0])[0][0][:0], ids[None], inside[0][2]))


def test_text_only_microbatch_sends_a_usable_empty_vis(tmp_path_factory) -> None:
    model, processor, _ = loaded(tmp_path_factory, "clip", "mistral", False, 8)
    encoder, projector, llm = llava_layers(model)
    inputs, labels = contract_microbatch(processor, microbatches()[1])
    assert inputs[0].shape[0] == 0
    for cut in range(1, len(encoder) + 1):  # a stage boundary after every encoder layer
        vis, ids, lens = run_stages(encoder[:cut], [0, cut], inputs)[0]
        vis = vis.detach().requires_grad_()
        logits, _ = run_stages(
            [*encoder[cut:], projector, *llm], [0, len(encoder) - cut + 1 + len(llm)], (vis, ids, lens)
        )
        token_normalized_loss(logits, labels).backward()
        assert vis.grad is not None and vis.grad.shape == vis.shape  # the engine's assert passes


def test_sliding_window_is_applied(tmp_path_factory) -> None:
    """With a window of 8 the layers must differ from full attention on long rows (and match HF)."""
    model, processor, _ = loaded(tmp_path_factory, "clip", "mistral", False, 8)
    encoder, projector, llm = llava_layers(model)
    inputs, labels = contract_microbatch(processor, microbatches()[0])
    layers = torch.nn.Sequential(*encoder, projector, *llm)
    windowed = layers(inputs)
    for layer in llm[:-1]:
        layer.kind = "full_attention"
    assert not torch.allclose(windowed, layers(inputs), atol=1e-4)


def test_eager_attention_matches_hf(tmp_path_factory) -> None:
    model, processor, _ = loaded(tmp_path_factory, "siglip", "qwen2", True, None)
    model.set_attn_implementation("eager")
    encoder, projector, llm = llava_layers(model)
    inputs, labels = contract_microbatch(processor, microbatches()[0])
    with torch.no_grad():
        reference = hf_forward(model, inputs, labels[0])
        torch.testing.assert_close(
            torch.nn.Sequential(*encoder, projector, *llm)(inputs), reference.logits, rtol=1e-5, atol=1e-5
        )


def test_tied_embeddings_are_declared_and_shared(tmp_path_factory) -> None:
    model, _, _ = loaded(tmp_path_factory, "siglip", "qwen2", True, None)
    _, projector, llm = llava_layers(model)
    assert projector.tied_weights == {TIED_EMBEDDING_KEY: "embed_tokens.weight"}
    assert llm[-1].tied_weights == {TIED_EMBEDDING_KEY: "lm_head.weight"}
    assert projector.embed_tokens.weight is llm[-1].lm_head.weight
    untied, _, _ = loaded(tmp_path_factory, "clip", "llama", False, None)
    _, projector, llm = llava_layers(untied)
    assert projector.tied_weights == {} and llm[-1].tied_weights == {}


def test_layers_share_the_hf_weights_and_stop_at_the_feature_layer(tmp_path_factory) -> None:
    model, _, _ = loaded(tmp_path_factory, "clip", "llama", False, None)
    encoder, projector, llm = llava_layers(model)
    n_tower = model.config.vision_config.num_hidden_layers
    assert len(encoder) == 1 + n_tower - 1  # vision_feature_layer=-2: the last tower layer is not used
    assert len(llm) == model.config.text_config.num_hidden_layers + 1
    assert encoder[1].layer is model.model.vision_tower.encoder.layers[0]
    assert projector.projector is model.model.multi_modal_projector and llm[-1].lm_head is model.lm_head


def test_unsupported_configs_are_named(tmp_path_factory) -> None:
    from types import SimpleNamespace

    _, _, folder = loaded(tmp_path_factory, "clip", "llama", False, None)

    def config(**changes):
        fields = dict(
            model_type="llava",
            vision_feature_layer=-2,
            vision_feature_select_strategy="default",
            vision_config=SimpleNamespace(model_type="clip_vision_model", num_hidden_layers=3),
            text_config=SimpleNamespace(model_type="llama"),
        )
        return SimpleNamespace(**{**fields, **changes})

    check_llava_config(config())
    with pytest.raises(ValueError, match="several layers"):
        check_llava_config(config(vision_feature_layer=[-2, -1]))
    with pytest.raises(ValueError, match="outside the tower's 3 layers"):
        check_llava_config(config(vision_feature_layer=-5))
    with pytest.raises(ValueError, match="'cls' is not supported"):
        check_llava_config(config(vision_feature_select_strategy="cls"))
    with pytest.raises(ValueError, match=r"text model 'gemma' is not supported \(supported: \['llama'"):
        check_llava_config(config(text_config=SimpleNamespace(model_type="gemma")))
    with pytest.raises(ValueError, match="vision tower 'pixtral' is not supported"):
        check_llava_config(config(vision_config=SimpleNamespace(model_type="pixtral", num_hidden_layers=3)))
    with pytest.raises(ValueError, match="model type 'qwen2_vl' is not supported"):
        check_llava_config(config(model_type="qwen2_vl"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_llava(folder / "missing")


def test_tiny_builder_round_trips_offline(tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = build_tiny_llava(tmp_path / "m", vision="siglip", text="qwen2")
    again = build_tiny_llava(tmp_path / "n", vision="siglip", text="qwen2")  # cached: identical files
    assert (folder / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True)
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    tok = processor.tokenizer
    assert tok.pad_token_id is not None and tok.eos_token_id is not None and tok.bos_token_id is not None
    assert processor_image_tokens(processor, model.config) == TOKENS_PER_IMAGE  # <image> expands to 16 tokens
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<image>")


def test_import_dflop_ds_does_not_import_transformers() -> None:
    code = (
        "import sys, dflop_ds, dflop_ds.commands.main, dflop_ds.models.hf; dflop_ds.commands.main.build_parser(); "
        "print('transformers' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.stdout.strip() == "False"


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory) -> dict:
    """One launch of ds_scripts/hf_pipe_check.py training two LLaVAs one after the other: ``tied``
    (encoder + projector with the embedding on stage 0, decoder + tied lm_head on stage 1) and
    ``frozen`` (the frozen tower alone on stage 0). Each run's reports, model folder and output."""
    root = tmp_path_factory.mktemp("hf_pipe")
    tied = build_tiny_llava(root / "tied", vision="clip", text="qwen2", tie_word_embeddings=True)
    frozen = build_tiny_llava(root / "frozen", vision="siglip", text="mistral", sliding_window=8)
    variants = {
        "tied": ["--model-dir", str(tied)],
        "frozen": ["--model-dir", str(frozen), "--freeze", "--bounds", "0,3,8"],
    }
    script = REPO / "tests" / "ds_scripts" / "hf_pipe_check.py"
    reports = run_pipeline_variants(script, root / "out", ["--out", root / "out"], variants, timeout=900)
    for results in reports.values():
        for r in results:
            assert r["images_per_microbatch"] == [1, 0, 2]  # a microbatch without any image was trained
            assert r["losses"] == results[0]["losses"] and r["losses"][-1] < r["losses"][0]
            # the engine's step-1 loss is the single-process layer-list loss and HF's own token mean
            assert r["losses"][0] == pytest.approx(r["ref_loss"], rel=1e-5)
            assert r["hf_loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
            assert r["step1_max_param_diff"] <= 1e-6 + 1e-4 * r["step1_max_param_change"], r
    return {"reports": reports, "models": {"tied": tied, "frozen": frozen}, "out": root / "out"}


@pytest.mark.slow
def test_pp2_tied_embeddings_stay_equal(pipeline_runs) -> None:
    """Encoder + projector (embedding) on stage 0, decoder + head (tied lm_head) on stage 1."""
    results = pipeline_runs["reports"]["tied"]
    assert all(r["tied_keys"] == [TIED_EMBEDDING_KEY] for r in results)
    assert results[0]["parts"] == [0, 4, 8]
    embedding, lm_head = (torch.load(pipeline_runs["out"] / "tied" / f"tied{r}.pt") for r in (0, 1))
    initial = load_llava(pipeline_runs["models"]["tied"]).lm_head.weight.detach()
    assert torch.equal(embedding, lm_head) and not torch.equal(embedding, initial)


@pytest.mark.slow
def test_pp2_frozen_tower_alone_on_stage0(pipeline_runs) -> None:
    stage0, stage1 = pipeline_runs["reports"]["frozen"]
    assert stage0["parts"] == [0, 3, 8]
    assert stage0["n_frozen"] == stage0["n_params"] > 0 and not stage0["frozen_moved"]
    assert stage0["step1_max_param_change"] == 0.0 and stage1["n_frozen"] == 0


def test_stage_bounds_from_a_profile_of_the_real_layers(tmp_path_factory) -> None:
    """The profiler times the HF layers through the input factories; the cost model's split is a
    valid split of the flat list that still matches HF."""
    from dflop_ds.cost import FittedCostModel
    from dflop_ds.models.hf.llava.model import llava_input_factories
    from dflop_ds.plan.stages import cost_balanced_bounds
    from dflop_ds.profile.model import profile_model
    from dflop_ds.shapes import SampleShape

    model, processor, _ = loaded(tmp_path_factory, "clip", "qwen2", False, 8)
    encoder, projector, llm = llava_layers(model)
    encoder_inputs, llm_inputs = llava_input_factories(model)
    pixel_values, input_ids, seq_lens = encoder_inputs(3, 2)
    assert pixel_values.shape[0] == 3 and int((input_ids == model.config.image_token_id).sum()) == 3 * TOKENS_PER_IMAGE
    profile = profile_model(
        encoder,
        llm,
        encoder_inputs=encoder_inputs,
        llm_inputs=llm_inputs,
        projector=projector,
        tiles=(1, 2, 4),
        seq_lens=(16, 32, 64),
        batch_sizes=(1, 2),
        warmup=0,
        repeats=1,
        progress=False,
    )
    assert profile.encoder_layers == len(encoder) and profile.llm_layers == len(llm)
    # grouped-query attention was switched off and timed (its share may round to 0 s on a tiny layer)
    assert profile.llm and all(m.attention_s is not None and m.attention_s >= 0 for m in profile.llm)
    shapes = [
        SampleShape(
            f"s{i}",
            encoder_tiles=1,
            visual_tokens=TOKENS_PER_IMAGE,
            text_tokens=24,
            llm_tokens=TOKENS_PER_IMAGE + 24,
            label_tokens=8,
        )
        for i in range(4)
    ]
    layers = [*encoder, projector, *llm]
    bounds = cost_balanced_bounds(FittedCostModel().fit(profile), shapes, 3)
    assert bounds == plan_stage_bounds(len(layers), len(encoder) + 1, 3, stage_bounds=bounds)
    inputs, labels = contract_microbatch(processor, microbatches()[0])
    logits = run_stages(layers, bounds, inputs)[0]
    with torch.no_grad():
        torch.testing.assert_close(logits, hf_forward(model, inputs, labels[0]).logits, rtol=1e-5, atol=1e-5)
