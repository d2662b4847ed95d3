"""The contract every registered HF model family passes, one parametrised test per check (a family
registers only when it passes them all; tests/family_inputs.py gives each one's tiny checkpoint):

* ``check-model`` at 1-3 stages: the layer lists equal HF's forward, packed microbatches equal padded;
* the family's dataset over LLaVA records (images, several images, text-only, videos where the family
  takes them): each item's tokens and tiles are its shape's, the collated microbatch gives HF's own
  loss, packed equals padded;
* the Trainer's image-free guard: the family's blank image runs the tower and leaves HF's loss as it was;
* slow, on 2 ZeRO-2 ranks: examples/train.py through the DeepSpeed loop (six steps, falling loss,
  the saved model changed; one launch for all families), and a user's ``DFLOPTrainer`` script with
  image-free microbatches beside ones with images, padded and with the family's padding-free
  collator (one launch for all families);
* slow, on 2 pipeline stages: examples/train.py, for the families whose own test files do not
  already run it (:data:`PIPELINE_ELSEWHERE`; one launch).

The shape policy's counts against each family's real processor are in the family's own test file
(each builds its processor by hand: the tiny checkpoints save none).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from conftest import write_ds_config  # noqa: E402
from ds_runs import REPO, run_on_ranks, run_train_batch  # noqa: E402
from family_inputs import FAMILY_BUILDERS, RightPadCollator, image_chats  # noqa: E402
from hf_stage_checks import assert_trained_with_media, media_run_args  # noqa: E402

from dflop_ds.hf_trainer.guard import blank_image_for, with_blank_image  # noqa: E402
from dflop_ds.models.hf.base.synthetic import hf_labels  # noqa: E402
from dflop_ds.models.hf.check import check_model, run_stages  # noqa: E402
from dflop_ds.models.hf.registry import family_of, registered_families, trainer_parts_of  # noqa: E402
from dflop_ds.models.hf.source import hf_source  # noqa: E402
from dflop_ds.pipe.loss import token_normalized_loss  # noqa: E402
from dflop_ds.rank_lifecycle import CLEAN_SHUTDOWN  # noqa: E402
from dflop_ds.testing.llava_data import write_llava_dataset  # noqa: E402

FAMILIES = [family.name for family in registered_families()]
SCRIPT = REPO / "tests" / "ds_scripts" / "family_trainer_check.py"


def test_every_registered_family_has_a_tiny_builder():
    assert sorted(FAMILY_BUILDERS) == sorted(FAMILIES)


@pytest.fixture(scope="module")
def every_family_data(tmp_path_factory) -> dict[str, tuple]:
    """For every family, ``(name, model, data, images, videos)``: its tiny checkpoint, 16 LLaVA
    records (1-3 images, text-only ones) and, where its dataset takes videos, 4 short videos."""
    from dflop_ds.testing.video import add_video_records

    every = {}
    for name in FAMILIES:
        root = tmp_path_factory.mktemp(name.lower().replace("-", "_"))
        model = FAMILY_BUILDERS[name](root / "m")
        data, images = write_llava_dataset(root / "data", 16, seed=6, text_only=0.2)
        videos = root / "videos"
        videos.mkdir()
        if family_of(model).training().dataset.supports_video:
            add_video_records(data, videos, 4, seed=6)
        every[name] = (name, model, data, images, videos)
    return every


@pytest.fixture(scope="module", params=FAMILIES)
def family_data(request, every_family_data):
    """One family's :func:`every_family_data`."""
    return every_family_data[request.param]


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("name", FAMILIES)
def test_check_model_matches_hf_and_packed_equals_padded(name, stages, tmp_path):
    model = FAMILY_BUILDERS[name](tmp_path / "m")
    report = check_model(model, stages=stages)
    assert report.ok and report.max_rel_err <= 1e-4 and report.packed_max_rel_err <= 1e-4, report.line()
    assert len(report.bounds) == stages + 1


def test_dataset_microbatches_give_hf_loss_and_packed_equals_padded(family_data):
    name, model, data, images, videos = family_data
    family = family_of(model)
    source = hf_source(str(model), image_folder=str(images), video_folder=str(videos))
    shapes = source.read_shapes(str(data), "error")
    kinds = {shape.modality for shape in shapes}
    videos_too = family.training().dataset.supports_video
    assert kinds == {"text", "image", "multi_image"} | ({"video"} if videos_too else set()), kinds
    dataset = source.make_dataset(shapes, str(data))
    layers = [*source.encoder_layers, source.projector, *source.llm_layers]
    hf_model = source.hf_model.eval()
    hf_kwargs = family.check_parts().hf_kwargs
    by_kind = {kind: [i for i, s in enumerate(shapes) if s.modality == kind] for kind in kinds}
    batches = [[by_kind["image"][0], by_kind["multi_image"][0], by_kind["text"][0]], [by_kind["text"][0]]]
    if videos_too:
        batches.append([by_kind["video"][0], by_kind["image"][-1]])
    for batch in batches:
        items = [dataset[i] for i in batch]
        for i, item in zip(batch, items):
            assert item.input_ids.numel() == shapes[i].llm_tokens, (name, i)
        inputs, labels = source.collate(items)
        logits, _ = run_stages(layers, [0, len(layers)], inputs)
        loss = token_normalized_loss(logits, labels)
        with torch.no_grad():
            reference = hf_model(**hf_kwargs(hf_model, inputs), labels=hf_labels(labels[0])).loss
        assert torch.allclose(loss, reference, rtol=1e-5), (name, batch, float(loss), float(reference))
        packed_inputs, packed_labels = source.packed_collate(items)
        packed_logits, _ = run_stages(layers, [0, len(layers)], packed_inputs)
        assert torch.allclose(token_normalized_loss(packed_logits, packed_labels), loss, rtol=1e-5), (name, batch)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_blank_image_leaves_the_loss_and_gets_the_gradients_an_image_gets(name, tmp_path):
    """The guard's blank image leaves HF's loss as it was and gives gradients to the same
    parameters a real image does (so every rank's ZeRO reduction holds the same tensors)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(FAMILY_BUILDERS[name](tmp_path / "m"))).train()
    parts = trainer_parts_of(model.config)
    blank = blank_image_for(model.config)
    assert parts is not None and blank is not None, name

    def graded(batch: dict) -> tuple[torch.Tensor, set[str]]:
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        return loss.detach(), {n for n, p in model.named_parameters() if p.grad is not None}

    with_image = RightPadCollator(parts.media_keys, parts.padded_keys)(image_chats(model.config, 1))
    _, image_grads = graded(with_image)
    ids = torch.randint(5, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    ids[ids == blank.image_token_id] = blank.image_token_id + 1  # text only
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    plain, text_grads = graded(inputs)
    guarded, blank_grads = graded(with_blank_image(inputs, blank))
    assert torch.allclose(guarded, plain, rtol=1e-6), (name, float(guarded), float(plain))
    assert blank_grads == image_grads and text_grads < image_grads, (name, sorted(image_grads ^ blank_grads)[:5])


#: families whose 2-stage pipeline run through examples/train.py is in their own test files
PIPELINE_ELSEWHERE = {
    "LLaVA": "test_train_hf.py",
    "Qwen2-VL": "test_hf_qwen2_vl_video.py (videos), test_train_hf.py (Qwen2.5-VL)",
}


def train_every_family(
    every_family_data: dict, names: list[str], config: str, root: Path
) -> dict[str, tuple[dict, Path]]:
    """Six steps of examples/train.py with the bundled ``config`` on each family of ``names``, one
    launch for all (its start-up costs more than a family's run): by family, the run's summary and
    the folder its trained model was saved to."""
    runs = {}
    for name in names:
        _, *media = every_family_data[name]
        (root / name).mkdir()
        ds_config = write_ds_config(root / name / "config.json", config, {"steps": 6})
        runs[name] = media_run_args(media, ds_config, root / name / "out")
    summaries = run_train_batch(runs, root)
    return {name: (summaries[name], root / name / "out") for name in names}


@pytest.fixture(scope="module")
def zero2_runs(every_family_data, tmp_path_factory) -> dict[str, tuple[dict, Path]]:
    """Every family on 2 ZeRO-2 ranks (hf_zero2.json), in one launch."""
    return train_every_family(every_family_data, FAMILIES, "hf_zero2.json", tmp_path_factory.mktemp("zero2_runs"))


@pytest.fixture(scope="module")
def pipeline_runs(every_family_data, tmp_path_factory) -> dict[str, tuple[dict, Path]]:
    """The families not in :data:`PIPELINE_ELSEWHERE` on 2 pipeline stages (hf_pp2.json), in one launch."""
    names = [name for name in FAMILIES if name not in PIPELINE_ELSEWHERE]
    return train_every_family(every_family_data, names, "hf_pp2.json", tmp_path_factory.mktemp("pipeline_runs"))


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_trains_through_the_deepspeed_loop_on_two_zero2_ranks(name, every_family_data, zero2_runs):
    """examples/train.py with hf_zero2.json on the family's images, several-image, text-only and
    video records: six steps, falling loss, the saved model changed."""
    _, model, *_ = every_family_data[name]
    run, out = zero2_runs[name]
    assert_trained_with_media(run, model, out, family_of(model).model_types[0], zero_stage=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in FAMILIES if name not in PIPELINE_ELSEWHERE])
def test_trains_on_two_pipeline_stages_through_the_deepspeed_loop(name, every_family_data, pipeline_runs):
    """examples/train.py with hf_pp2.json on the family's images, several-image, text-only and video
    records: six steps, falling loss, the saved model changed (pipeline stages take no ZeRO-2)."""
    _, model, *_ = every_family_data[name]
    run, out = pipeline_runs[name]
    assert_trained_with_media(run, model, out, family_of(model).model_types[0])


def assert_trainer_script_trains(families: list[str], flag: str, tmp_path, *options: str) -> None:
    """Launch tests/ds_scripts/family_trainer_check.py on 2 ranks for ``families`` (one launch: its
    start-up costs more than a family's run) and check, padded and padding-free, 4 finite and
    falling losses, and that some microbatch had ``flag`` ("had_images", "had_videos") on one rank
    and not on the other."""
    models = {name: str(FAMILY_BUILDERS[name](tmp_path / f"m{index}")) for index, name in enumerate(families)}
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    args = [arg for model in models.values() for arg in ("--model", model)] + ["--out", str(tmp_path), *options]
    result = run_on_ranks(SCRIPT, args, extra_env=env, timeout=900)
    assert all(f"{CLEAN_SHUTDOWN} {r}\n" in result.stdout for r in (0, 1)), result.stdout[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for name, model in models.items():
        for run in ("padded", "packed"):
            losses = reports[0][model][run]["losses"]
            assert len(losses) == 4 and all(loss == loss for loss in losses), (name, run, losses)
            assert losses[-1] < losses[0], (name, run, losses)
            flags = [report[model][run][flag] for report in reports]
            assert len(flags[0]) == len(flags[1])
            assert any(a != b for a, b in zip(*flags)), (name, run, f"no microbatch {flag} beside one without")


@pytest.mark.slow
def test_a_trainer_script_trains_image_free_microbatches_padded_and_padding_free_on_two_zero2_ranks(tmp_path):
    """Every family in one launch, image-free microbatches beside ones with images."""
    assert_trainer_script_trains(FAMILIES, "had_images", tmp_path)


@pytest.mark.slow
def test_families_with_a_separate_video_pass_train_images_videos_and_text_on_two_zero3_ranks(tmp_path):
    """Under ZeRO-3 every call of the vision tower gathers its parameters across ranks, and HF's
    Qwen2-VL and LLaVA-OneVision run it apart for images and for videos: a microbatch with a video
    beside one without broke the ranks' collectives (gloo: a size mismatch; a hang) until the guard
    gave every microbatch both. Both families in one launch, padded and padding-free, 4 steps each,
    sub-layer buckets (ds_configs/zero3_small_buckets.json)."""
    assert_trainer_script_trains(["Qwen2-VL", "LLaVA-OneVision"], "had_videos", tmp_path, "--zero3")
