"""DFLOPSFTTrainer: the mixin over TRL's SFTTrainer on a vision dataset (``messages`` + ``images``
rows), shapes from hf_dataset_shapes; runs where the ``trl`` extra is installed."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from dflop_ds.hf_trainer import hf_dataset_shapes  # noqa: E402
from dflop_ds.hf_trainer.sft import DFLOPSFTTrainer  # noqa: E402

#: a plain "ROLE: text" chat template; image parts become the processor's <image> token
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | upper }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    " {% endfor %}"
)
ROWS, GAS = 16, 2


def vision_dataset(rows: dict) -> Any:
    """A ``datasets.Dataset`` of TRL's vision format with an ``Image`` column. Built with a fixed
    fingerprint: ``Dataset.from_dict`` fails to hash its arrow table on this machine (datasets 5.2)."""
    from datasets.table import InMemoryTable

    features = datasets.Features(
        {
            "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
            "images": datasets.Sequence(datasets.Image()),
        }
    )
    table = InMemoryTable.from_pydict(features.encode_batch(rows), schema=features.arrow_schema)
    return datasets.Dataset(table, info=datasets.DatasetInfo(features=features), fingerprint="dflop-sft-test")


@pytest.fixture(scope="module")
def sft_inputs(tmp_path_factory):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from dflop_ds.testing.hf_tiny import build_tiny_llava

    model_dir = build_tiny_llava(tmp_path_factory.mktemp("sft") / "model")
    processor = AutoProcessor.from_pretrained(str(model_dir))
    processor.chat_template = TEMPLATE
    rng = random.Random(0)
    words = "a red car on the road near sea what is shown in picture describe it".split()
    rows = {"messages": [], "images": []}
    for i in range(ROWS):
        n_images = 0 if i % 3 == 0 else rng.randint(1, 2)
        question = " ".join(rng.choices(words, k=rng.randint(3, 30)))
        answer = " ".join(rng.choices(words, k=rng.randint(3, 60)))
        rows["messages"].append([{"role": "user", "content": question}, {"role": "assistant", "content": answer}])
        rows["images"].append(
            [Image.new("RGB", (rng.randint(20, 90), rng.randint(20, 90)), "red") for _ in range(n_images)]
        )
    dataset = vision_dataset(rows)
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir))
    return model, processor, dataset, rows


def test_hf_dataset_shapes_reads_image_headers_and_template_tokens(sft_inputs):
    _, processor, dataset, rows = sft_inputs
    shapes = hf_dataset_shapes(dataset, processor)
    assert [s.image_sizes for s in shapes] == [tuple(image.size for image in images) for images in rows["images"]]
    text = processor.apply_chat_template(rows["messages"][1], tokenize=False)
    assert shapes[1].text_tokens == len(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert [s.visual_tokens for s in shapes] == [16 * len(images) for images in rows["images"]]


@pytest.mark.slow  # about 25 s on 2 shared cores: TRL's SFTTrainer set-up and 4 steps
def test_dflop_sft_trainer_trains_on_gas_microbatches_of_every_row(sft_inputs, tmp_path):
    model, processor, dataset, _ = sft_inputs
    config = trl.SFTConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=GAS,
        num_train_epochs=1,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        max_length=None,
    )
    trainer = DFLOPSFTTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=processor,
        sample_shapes=hf_dataset_shapes(dataset, processor),
    )
    loader = trainer.get_train_dataloader()
    indices = [int(i) for mb in loader.batch_sampler for i in mb]
    assert sorted(indices) == list(range(ROWS)) and len(loader) == ROWS // (2 * GAS) * GAS
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert trainer.state.global_step == ROWS // (2 * GAS) and all(torch.isfinite(torch.tensor(losses)))
    assert any("dflop_predicted_imbalance" in entry for entry in trainer.state.log_history)


def test_hostile_rows_are_refused_naming_the_row(sft_inputs):
    from dflop_ds.data import DataError

    _, processor, _, rows = sft_inputs
    image = rows["images"][1][0]
    structured = [
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "two?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "one"}]},
    ]
    with pytest.raises(DataError, match=r"row 0: its messages hold 2 image parts .* 1 images"):
        hf_dataset_shapes([{"messages": structured, "images": [image]}], processor)
    plain = [{"role": "user", "content": "what?"}, {"role": "assistant", "content": "a car"}]
    with pytest.raises(DataError, match=r"an image given as a str \('photos/cat\.jpg'\)"):
        hf_dataset_shapes([{"messages": plain, "images": ["photos/cat.jpg"]}], processor)
