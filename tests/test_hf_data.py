"""HF LLaVA data: chat template, <image> expansion, exact label counts, dataset + collate contract,
bad images named, and the shape policy stored in and checked against cost models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from PIL import Image  # noqa: E402
from test_costmodel import synthetic_profile  # noqa: E402

from dflop_ds.commands.main import main as cli_main  # noqa: E402
from dflop_ds.cost import (  # noqa: E402
    FittedCostModel,
    check_policy,  # noqa: E402
    load_cost_model,
    save_cost_model,
)
from dflop_ds.data import DataError, read_dataset  # noqa: E402
from dflop_ds.models.hf.base.collate import collate_packed, collate_padded
from dflop_ds.models.hf.base.dataset import MediaDataset, load_llava_records, supervised_targets
from dflop_ds.models.hf.llava.data import LlavaPreprocessor, llava_policy
from dflop_ds.schedule.index import ScheduledIndex  # noqa: E402
from dflop_ds.shapes import DEFAULT_POLICY, TINY_POLICY  # noqa: E402
from dflop_ds.testing import hf_tiny  # noqa: E402

TOKENS_PER_IMAGE = hf_tiny.TOKENS_PER_IMAGE


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_tiny.build_tiny_llava(tmp_path_factory.mktemp("tiny_llava"))


@pytest.fixture(scope="module")
def pre(model_dir: Path) -> LlavaPreprocessor:
    return LlavaPreprocessor.from_pretrained(model_dir)


def turns(*pairs: tuple[str, str]) -> list[dict]:
    return [{"from": role, "value": value} for role, value in pairs]


@pytest.fixture()
def dataset(tmp_path: Path) -> tuple[Path, Path]:
    folder = tmp_path / "images"
    folder.mkdir()
    for name, size in [("a.png", (64, 48)), ("b.jpg", (30, 90)), ("c.png", (200, 33))]:
        Image.new("RGB", size, (len(name) * 40, 20, 150)).save(folder / name)
    records = [
        {
            "id": "one",
            "image": "a.png",
            "conversations": turns(("human", "<image>\nwhat is shown?"), ("gpt", "a red car")),
        },
        {
            "id": "mid",
            "image": "b.jpg",
            "conversations": turns(
                ("Human", "look at this one: <image> describe it"),
                ("GPT", "a road"),
                ("user", "and?"),
                ("Assistant", "hi"),
            ),
        },
        {"id": "text", "conversations": turns(("human", "hello"), ("gpt", "hi there"))},
        {"id": 4, "image": ["a.png", "c.png"], "conversations": turns(("human", "compare"), ("gpt", "the two images"))},
    ]
    data = tmp_path / "train.json"
    data.write_text(json.dumps(records))
    return data, folder


def read(data: Path, pre: LlavaPreprocessor, folder: Path, **kwargs):
    return read_dataset(data, pre.policy(), image_folder=folder, **kwargs)


def test_policy_from_the_processor(pre: LlavaPreprocessor, model_dir: Path) -> None:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    expanded = processor(text="USER: <image> hi", images=[Image.new("RGB", (50, 40))], return_tensors="pt")
    assert pre.image_seq_length == TOKENS_PER_IMAGE == int((expanded["input_ids"] == pre.image_token_id).sum())
    policy = pre.policy()
    assert (policy.max_tiles, policy.tokens_per_tile, policy.image_tiles(4000, 30)) == (1, TOKENS_PER_IMAGE, 1)
    described = policy.describe()
    assert described["name"] == f"llava:{model_dir.name}" and "llava-v1" in described["tokenizer"]
    assert llava_policy(model_dir).describe() == described  # same directory, same fingerprint
    assert llava_policy(model_dir, max_length=64).describe() != described


def test_anyres_processor_is_refused(model_dir: Path) -> None:
    from transformers import AutoTokenizer, LlavaNextImageProcessor, LlavaNextProcessor

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    anyres = LlavaNextProcessor(
        image_processor=LlavaNextImageProcessor(), tokenizer=tokenizer, patch_size=hf_tiny.PATCH_SIZE
    )
    with pytest.raises(ValueError, match="LlavaNextProcessor is not supported: only plain LLaVA"):
        LlavaPreprocessor(anyres)


def test_placeholders_expand_where_the_prompt_puts_them(pre: LlavaPreprocessor) -> None:
    tok = pre.tokenizer
    encoded = pre.encode([("human", "look at this one: <image> describe it"), ("gpt", "a road")], 1)
    ids = encoded.input_ids
    start = ids.index(pre.image_token_id)
    assert ids[start : start + TOKENS_PER_IMAGE] == [pre.image_token_id] * TOKENS_PER_IMAGE
    assert ids.count(pre.image_token_id) == TOKENS_PER_IMAGE
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids[1:start]).endswith("USER: look at this one: ")
    assert tok.decode(ids[start + TOKENS_PER_IMAGE :]).startswith(" describe it ASSISTANT: ")
    labelled = [t for t, s in zip(ids, encoded.supervised) if s]
    assert tok.decode(labelled) == "a road</s>"
    # no placeholder: one per image is prepended to the first human turn, as LLaVA does
    prepended = pre.encode([("human", "compare"), ("gpt", "same")], 2).input_ids
    first = prepended.index(pre.image_token_id)
    assert tok.decode(prepended[1:first]).endswith("USER: ")
    assert prepended[first : first + TOKENS_PER_IMAGE] == [pre.image_token_id] * TOKENS_PER_IMAGE
    assert tok.decode(prepended[first + TOKENS_PER_IMAGE : first + TOKENS_PER_IMAGE + 1]) == "\n"
    assert prepended.count(pre.image_token_id) == 2 * TOKENS_PER_IMAGE


@pytest.mark.parametrize(
    "conversation, n_images, message",
    [
        ([("human", "<image> <image> two?"), ("gpt", "x")], 1, "conversations: 2 <image> placeholder"),
        ([("human", "<image> hi"), ("gpt", "x")], 0, "conversations: 1 <image> placeholder"),
        (
            [("human", "hi"), ("system", "be nice"), ("gpt", "x")],
            0,
            r"conversations\[1\].from: a system turn after the first",
        ),
        ([("narrator", "once"), ("human", "hi"), ("gpt", "x")], 0, r"conversations\[0\].from: unknown role 'narrator'"),
        ([("human", "hi"), ("gpt", "see <image>")], 1, r"conversations\[1\].value: <image> in an assistant turn"),
        ([("human", "<video> what?"), ("gpt", "x")], 0, r"conversations\[0\].value: <video> is not supported"),
    ],
)
def test_bad_conversations_name_the_field(pre: LlavaPreprocessor, conversation, n_images, message) -> None:
    with pytest.raises(ValueError, match=message):
        pre.encode(conversation, n_images)


def test_bad_records_are_named_by_the_shape_reader(pre: LlavaPreprocessor, tmp_path: Path) -> None:
    folder = tmp_path / "images"
    folder.mkdir()
    Image.new("RGB", (10, 10)).save(folder / "x.png")
    data = tmp_path / "bad.jsonl"
    data.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"id": "ok", "image": "x.png", "conversations": turns(("human", "<image>"), ("gpt", "x"))},
                {"id": "two", "image": "x.png", "conversations": turns(("human", "<image><image>"), ("gpt", "x"))},
                {"id": "role", "conversations": turns(("robot", "hi"), ("gpt", "x"))},
            ]
        )
        + "\n"
    )
    with pytest.raises(DataError, match="placeholder") as info:
        read(data, pre, folder)
    assert info.value.sample_id == "two"
    skipped = read(data, pre, folder, on_bad_sample="skip")
    assert [s.sample_id for s in skipped] == ["ok"] and skipped.report.n_skipped == 2


def test_label_counts_of_shapes_equal_the_collated_targets(pre: LlavaPreprocessor, dataset) -> None:
    data, folder = dataset
    shapes = read(data, pre, folder)
    ds = MediaDataset(shapes, load_llava_records(data), pre, folder, source=data)
    inputs, (targets, denominator) = collate_padded([ds[i] for i in range(len(ds))])
    pixel_values, input_ids, seq_lens = inputs
    assert int((targets != -100).sum()) == sum(supervised_targets(s) for s in shapes) > 0
    assert seq_lens.tolist() == [s.llm_tokens for s in shapes]
    assert (
        [int((row == pre.image_token_id).sum()) for row in input_ids]
        == [s.visual_tokens for s in shapes]
        == [TOKENS_PER_IMAGE, TOKENS_PER_IMAGE, 0, 2 * TOKENS_PER_IMAGE]
    )
    assert float(denominator) == float((targets != -100).sum())  # plain ints: the microbatch's own count
    for b in range(len(shapes)):  # targets are input_ids shifted by one where supervised
        where = targets[b] != -100
        assert torch.equal(targets[b][:-1][where[:-1]], input_ids[b][1:][where[:-1]])
        assert not bool(where[seq_lens[b] - 1 :].any())
    answers = pre.tokenizer.decode(targets[1][targets[1] != -100].tolist())
    assert answers == "a road</s>hi</s>"


def test_collate_contract_shapes_and_dtypes(pre: LlavaPreprocessor, dataset) -> None:
    data, folder = dataset
    shapes = read(data, pre, folder)
    ds = MediaDataset(shapes, load_llava_records(data), pre, folder)
    (pixels, input_ids, seq_lens), (targets, denominator) = collate_padded(
        [ds[ScheduledIndex(i, 7.5)] for i in (3, 2, 0)]
    )
    assert pixels.dtype == torch.float32 and pixels.shape == (3, 3, hf_tiny.IMAGE_SIZE, hf_tiny.IMAGE_SIZE)
    assert input_ids.dtype == seq_lens.dtype == targets.dtype == torch.long
    assert input_ids.shape == targets.shape == (3, int(seq_lens.max()))
    assert denominator.dtype == torch.float64 and float(denominator) == 7.5 and denominator.dim() == 0
    short = int(seq_lens.argmin())
    assert bool((input_ids[short, seq_lens[short] :] == pre.pad_token_id).all())
    assert bool((targets[short, seq_lens[short] - 1 :] == -100).all())
    # the images' pixels are the processor's own, in sample order
    expected = pre.image_processor(images=[Image.open(folder / "a.png").convert("RGB")], return_tensors="pt")
    assert torch.allclose(pixels[0], expected["pixel_values"][0].float())
    (text_pixels, *_), _ = collate_padded([ds[2]])
    assert text_pixels.shape == (0, 3, hf_tiny.IMAGE_SIZE, hf_tiny.IMAGE_SIZE)
    # packed: the same samples one after another in one row, the rest unchanged
    (packed_pixels, packed_ids, packed_lens), (packed_targets, packed_denominator) = collate_packed(
        [ds[ScheduledIndex(i, 7.5)] for i in (3, 2, 0)]
    )
    real = torch.arange(input_ids.shape[1])[None, :] < seq_lens[:, None]
    assert torch.equal(packed_pixels, pixels) and torch.equal(packed_lens, seq_lens)
    assert torch.equal(packed_ids, input_ids[real][None]) and torch.equal(packed_targets, targets[real][None])
    assert float(packed_denominator) == 7.5


def test_missing_image_at_load_time_is_named(pre: LlavaPreprocessor, dataset) -> None:
    data, folder = dataset
    shapes = read(data, pre, folder)
    ds = MediaDataset(shapes, load_llava_records(data), pre, folder, source=data)
    (folder / "c.png").unlink()
    with pytest.raises(DataError, match=f"cannot load image {folder / 'c.png'}") as info:
        ds[3]
    assert (info.value.sample_id, info.value.field) == ("4", "image[1]")


def test_shapes_of_another_policy_are_refused(pre: LlavaPreprocessor, dataset) -> None:
    data, folder = dataset
    shapes = read_dataset(data, TINY_POLICY, image_folder=folder)
    ds = MediaDataset(shapes, load_llava_records(data), pre, folder)
    with pytest.raises(DataError, match="made under another policy"):
        ds[0]


def test_too_long_samples_are_refused_or_truncated_never_through_images(model_dir: Path) -> None:
    conversation = [("human", "<image> what is shown in the picture?"), ("gpt", "a red car on a road. " * 4)]
    full = LlavaPreprocessor.from_pretrained(model_dir).encode(conversation, 1)
    limit = len(full.input_ids) - 5
    with pytest.raises(ValueError, match=f"exceed max_length {limit}"):
        LlavaPreprocessor.from_pretrained(model_dir, max_length=limit).encode(conversation, 1)
    cutting = LlavaPreprocessor.from_pretrained(model_dir, max_length=limit, truncation="truncate")
    text, labels = cutting.count(conversation, [TOKENS_PER_IMAGE])
    assert text + TOKENS_PER_IMAGE == limit and labels == full.label_count - 5
    assert cutting.truncated_samples == 1
    with pytest.raises(ValueError, match="would drop image tokens"):
        LlavaPreprocessor.from_pretrained(model_dir, max_length=8, truncation="truncate").encode(conversation, 1)


def test_a_profiled_cost_model_serves_a_truncating_run_but_not_another_tokenization(
    model_dir: Path, pre: LlavaPreprocessor
) -> None:
    """Issue 25: ``profile model`` records no length rule, so a cost model was refused for every
    run that truncates. The length rule decides which shapes occur, not what one costs: accepted.
    What changes the tokens of the same text (here the system message) is still refused."""
    profiled = FittedCostModel().fit(synthetic_profile(), pre.policy())
    truncating = LlavaPreprocessor.from_pretrained(model_dir, max_length=64, truncation="truncate")
    assert truncating.policy().describe()["tokenizer"] != pre.policy().describe()["tokenizer"]
    check_policy(profiled, truncating.policy())
    check_policy(FittedCostModel().fit(synthetic_profile(), truncating.policy()), pre.policy())
    other_system = LlavaPreprocessor.from_pretrained(model_dir, system="Answer in French.", max_length=64)
    with pytest.raises(ValueError, match=r"they differ in tokenizer: '.*system:.*' vs '.*system:"):
        check_policy(profiled, other_system.policy())


def test_cost_model_stores_its_policy_and_refuses_another(
    pre: LlavaPreprocessor, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "cm.json"
    save_cost_model(FittedCostModel().fit(synthetic_profile(), pre.policy()), path)
    loaded = load_cost_model(path)
    assert loaded.shape_policy == pre.policy().describe()
    check_policy(loaded, pre.policy())  # same policy: accepted
    with pytest.raises(
        ValueError,
        match=r"profiled under the shape policy 'llava:.*', but the data is shaped with the policy 'tiny'; "
        r"they differ in .*max_tiles: 1 vs 4.*tokenizer: 'llava-v1",
    ):
        check_policy(loaded, TINY_POLICY)
    with pytest.raises(ValueError, match="shape policy 'tiny'.*policy 'default'.*tokens_per_tile: 16 vs 729"):
        check_policy(FittedCostModel().fit(synthetic_profile(), TINY_POLICY), DEFAULT_POLICY)
    old = json.loads(path.read_text())  # a model that records no policy: checked with a warning
    del old["state"]["shape_policy"]
    path.write_text(json.dumps(old))
    assert load_cost_model(path).shape_policy is None
    check_policy(load_cost_model(path), TINY_POLICY, source="old.json")
    assert "old.json records no shape policy" in caplog.text


def test_cli_reads_with_the_model_policy(model_dir: Path, dataset, capsys: pytest.CaptureFixture) -> None:
    data, folder = dataset
    assert cli_main(["validate", str(data), "--model_name_or_path", str(model_dir), "--image_folder", str(folder)]) == 0
    assert "4 samples, no problems" in capsys.readouterr().out


def test_plan_refuses_a_cost_model_of_another_policy(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cost_model = tmp_path / "tiny_cm.json"
    save_cost_model(FittedCostModel().fit(synthetic_profile(), TINY_POLICY), cost_model)
    data = Path(__file__).resolve().parents[1] / "examples" / "data" / "coco.jsonl"
    argv = [
        "plan",
        "--gpus",
        "2",
        "--global-batch",
        "8",
        "--cost-model",
        str(cost_model),
        "--data",
        str(data),
        "-o",
        str(tmp_path / "plan.json"),
    ]
    assert cli_main(argv + ["--policy", "default"]) != 0
    assert "shape policy 'tiny', but the data is shaped with the policy 'default'" in capsys.readouterr().err


def test_scheduled_denominators_match_the_collated_targets(pre: LlavaPreprocessor, dataset) -> None:
    """Over a global batch, the DFLOP sampler's denominators and the collated targets agree exactly."""
    from dflop_ds.schedule.sampler import DFLOPBatchSampler

    data, folder = dataset
    shapes = read(data, pre, folder)
    ds = MediaDataset(shapes, load_llava_records(data), pre, folder)
    sampler = DFLOPBatchSampler(
        shapes, global_batch_size=4, gradient_accumulation_steps=2, prefetch=0, label_tokens_fn=supervised_targets
    )
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=collate_padded)
    batches = list(loader)
    assert len(batches) == 2
    targets_seen = sum(int((targets != -100).sum()) for _, (targets, _) in batches)
    # each microbatch's denominator is the global batch's target count / (GAS * dp)
    assert {float(den) * 2 for _, (_, den) in batches} == {float(targets_seen)}


def test_records_whose_labels_are_all_cut_are_bad_records(model_dir: Path, tmp_path: Path) -> None:
    long_question = ("human", "<image> " + "tell me what is shown in this picture " * 3)
    answered = [long_question, ("gpt", "a car")]
    first_label = LlavaPreprocessor.from_pretrained(model_dir).encode(answered, 1).supervised.index(True)
    records = [
        {"id": "cut", "conversations": turns(*answered)},
        {"id": "no-answer", "conversations": turns(("human", "hello"))},
        {"id": "ok", "conversations": turns(("human", "hi"), ("gpt", "yes"))},
    ]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({**r, "image": "x.png"} if r["id"] == "cut" else r) + "\n" for r in records))
    Image.new("RGB", (10, 10)).save(tmp_path / "x.png")
    cutting = LlavaPreprocessor.from_pretrained(model_dir, max_length=first_label, truncation="truncate")
    with pytest.raises(DataError, match="every one cut by truncation at max_length") as info:
        read(data, cutting, tmp_path)
    assert (info.value.record, info.value.sample_id, info.value.field) == (1, "cut", "conversations")
    kept = read(data, cutting, tmp_path, on_bad_sample="skip")
    assert [s.sample_id for s in kept] == ["ok"] and kept.report.n_skipped == 2
    assert "line 2 (id 'no-answer'), field 'conversations': has no assistant turn" in str(kept.report.problems[1])
