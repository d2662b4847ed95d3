"""dflop_ds.integrations without the frameworks installed: the shapes each plugin reads, the
refusals it makes before training, and ``dflop-ds plugin-path``. The plugins' training runs
through ms-swift and LLaMA-Factory themselves are ``make test-frameworks`` (tests/frameworks/)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dflop_ds.commands.main import main
from dflop_ds.data import DataError
from dflop_ds.data.images import MAX_PIXELS_ENV
from dflop_ds.integrations.chat import chat_shapes
from dflop_ds.integrations.llamafactory import PackedRowCollator, check_config, packed_row, tokenized_shapes
from dflop_ds.integrations.swift import DFLOPSwiftCallback, refuse_unsupported


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """A tiny HF LLaVA folder and LLaVA records with real images, as chat rows too."""
    from dflop_ds.hf_trainer import llava_json_shapes
    from dflop_ds.testing.hf_tiny import build_tiny_llava
    from dflop_ds.testing.llava_data import write_llava_dataset

    root = tmp_path_factory.mktemp("integrations")
    model = build_tiny_llava(root / "model")
    data, images = write_llava_dataset(root / "data", 12, seed=5, text_only=0.3)
    records = json.loads(data.read_text())
    rows = []
    for record in records:
        names = record.get("image") or []
        names = [names] if isinstance(names, str) else names
        messages = [{"role": t["from"], "content": t["value"]} for t in record["conversations"]]
        rows.append({"messages": messages, "images": [str(images / n) for n in names]})
    return model, rows, llava_json_shapes(data, str(model), image_folder=images)


def test_chat_rows_shape_like_the_llava_records_they_hold(llava):
    from dflop_ds.models.hf.preprocessor import hf_preprocessor

    model, rows, expected = llava
    shapes = chat_shapes(rows, hf_preprocessor(str(model)).policy(), "rows")
    assert len(shapes) == len(rows) and shapes.policy == expected.policy
    for got, want in zip(shapes, expected):
        assert (got.image_sizes, got.text_tokens, got.label_tokens, got.llm_tokens) == (
            want.image_sizes,
            want.text_tokens,
            want.label_tokens,
            want.llm_tokens,
        )
    assert any(s.image_sizes for s in shapes) and any(not s.image_sizes for s in shapes)


def test_chat_rows_with_a_system_message_shape_with_it(llava):
    """ms-swift's and LLaMA-Factory's chat rows often open with a ``system`` message: it is the
    row's system prompt (the template's own is replaced), so every row's text grows by the same
    count and its labels stay."""
    from dflop_ds.models.hf.preprocessor import hf_preprocessor

    model, rows, _ = llava
    policy = hf_preprocessor(str(model)).policy()
    plain = chat_shapes(rows, policy, "rows")
    system = [{**row, "messages": [{"role": "system", "content": "Answer briefly."}, *row["messages"]]} for row in rows]
    told = chat_shapes(system, policy, "rows")
    grown = {t.text_tokens - p.text_tokens for t, p in zip(told, plain)}
    assert len(grown) == 1 and grown != {0}
    assert [t.label_tokens for t in told] == [p.label_tokens for p in plain]


def test_a_bad_chat_row_is_named_by_its_index(llava, tmp_path, monkeypatch):
    from dflop_ds.models.hf.preprocessor import hf_preprocessor

    model, rows, _ = llava
    policy = hf_preprocessor(str(model)).policy()
    missing = [*rows[:3], {**rows[3], "images": [str(tmp_path / "gone.png")]}]
    with pytest.raises(DataError, match=r"3.*images.*cannot read an image header"):
        chat_shapes(missing, policy, "rows")
    with pytest.raises(DataError, match=r"1.*videos"):
        chat_shapes([rows[0], {**rows[1], "videos": ["clip.mp4"]}], policy, "rows")
    with pytest.raises(DataError, match=r"^the rows index 2.*messages\[1\].*must be an object.*got str"):
        chat_shapes([*rows[:2], {**rows[2], "messages": [rows[2]["messages"][0], "hi"]}], policy, "the rows")
    with_image = next(i for i, row in enumerate(rows) if row["images"])
    monkeypatch.setenv(MAX_PIXELS_ENV, "10")  # every image over the pixel limit: named, not PIL's bare error
    with pytest.raises(DataError, match=rf"index {with_image}.*images.*over the limit of 10 pixels.*{MAX_PIXELS_ENV}"):
        chat_shapes(rows, policy, "rows")


def test_an_empty_dataset_is_refused_as_smaller_than_a_global_batch() -> None:
    from dflop_ds.schedule.sampler import SamplerSettings, make_sampler

    with pytest.raises(ValueError, match="dataset has 0 samples, fewer than one global batch"):
        make_sampler(SamplerSettings("dflop"), [], global_batch_size=8, gradient_accumulation_steps=2)


def test_llamafactory_tokenized_rows_count_text_without_the_expanded_image_tokens(llava):
    import datasets
    from transformers import AutoConfig

    model_dir, rows, _ = llava
    config = AutoConfig.from_pretrained(str(model_dir))
    image = int(config.image_token_id)
    with_image = next(row for row in rows if row["images"])
    table = datasets.Dataset.from_list(
        [
            {
                "input_ids": [5, image, image, image, 6, 7],
                "labels": [-100] * 4 + [6, 7],
                "images": with_image["images"],
            },
            {"input_ids": [5, 6, 7, 8], "labels": [-100, 6, 7, 8], "images": []},
        ]
    )
    model = SimpleNamespace(name_or_path=str(model_dir), config=config)
    first, second = tokenized_shapes(table, model)
    assert (first.text_tokens, first.label_tokens, len(first.image_sizes)) == (3, 2, len(with_image["images"]))
    assert first.llm_tokens > first.text_tokens  # the policy's image tokens
    assert (second.text_tokens, second.label_tokens, second.image_sizes) == (4, 3, ())


def test_llamafactory_neat_packing_and_a_config_without_deepspeed_are_refused_by_name(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"dflop": {"sampler": {"kind": "dflop"}}}))
    check_config({"stage": "sft", "deepspeed": str(ds)}, "cfg.yaml")
    check_config({"deepspeed": str(ds), "packing": True}, "cfg.yaml")  # each balanced microbatch packed
    with pytest.raises(ValueError, match="cfg.yaml: neat_packing: true.*use packing: true"):
        check_config({"deepspeed": str(ds), "packing": True, "neat_packing": True}, "cfg.yaml")
    with pytest.raises(ValueError, match="cfg.yaml: no deepspeed"):
        check_config({"stage": "sft"}, "cfg.yaml")
    ds.write_text(json.dumps({"dflop": {"sampler": {"kindd": "dflop"}}}))
    with pytest.raises(ValueError, match="kindd"):
        check_config({"deepspeed": str(ds)}, "cfg.yaml")
    # the DeepSpeed config inline in the YAML, as TrainingArguments.deepspeed takes it
    check_config({"deepspeed": {"dflop": {"sampler": {"kind": "dflop"}}}}, "cfg.yaml")
    with pytest.raises(ValueError, match=r"cfg\.yaml: deepspeed.*kindd"):
        check_config({"deepspeed": {"dflop": {"sampler": {"kindd": "dflop"}}}}, "cfg.yaml")


def test_llamafactory_launch_names_a_process_count_that_is_not_a_number(monkeypatch, tmp_path):
    from dflop_ds.integrations.llamafactory import launch

    monkeypatch.setenv("NPROC_PER_NODE", "two")
    with pytest.raises(ValueError, match="NPROC_PER_NODE='two': expected the number of processes"):
        launch(tmp_path / "cfg.yaml")


#: two tokenized LLaMA-Factory rows: one with two images, one text-only
ROWS = [
    {"input_ids": [1, 9, 9, 2], "attention_mask": [1] * 4, "labels": [-100, -100, 5, 2], "images": ["a", "b"]},
    {"input_ids": [1, 7, 2], "attention_mask": [1] * 3, "labels": [-100, 7, 2], "images": None},
]


def test_a_microbatch_is_packed_into_one_row_as_llamafactory_packs():
    row = packed_row(ROWS, pad_token_id=0)
    assert row["input_ids"] == [1, 9, 9, 2, 1, 7, 2, 0]  # padded to a multiple of 8
    assert row["labels"] == [-100, -100, 5, 2, -100, 7, 2, -100]
    assert row["position_ids"] == [0, 1, 2, 3, 0, 1, 2, 0]  # restarting at each sample
    assert row["attention_mask"] == [1] * 8 and row["images"] == ["a", "b"] and row["videos"] is None
    exact = packed_row(ROWS[::-1], pad_token_id=0, multiple=7)
    assert exact["input_ids"] == [1, 7, 2, 1, 9, 9, 2] and exact["images"] == ["a", "b"]


def test_the_packed_row_collator_hands_llamafactory_one_row_per_microbatch():
    seen = []
    collate = PackedRowCollator(lambda rows: seen.append(rows) or len(rows), pad_token_id=0)
    assert collate(ROWS) == 1 and seen[0][0]["input_ids"][:7] == [1, 9, 9, 2, 1, 7, 2]


def test_swift_options_with_a_sampler_of_their_own_are_refused_naming_the_option():
    trainer = SimpleNamespace(template=SimpleNamespace(sequence_parallel_size=1))
    refuse_unsupported(SimpleNamespace(group_by_length=False), trainer)
    with pytest.raises(ValueError, match="--group_by_length"):
        refuse_unsupported(SimpleNamespace(group_by_length=True), trainer)
    with pytest.raises(ValueError, match="--sequence_parallel_size"):
        refuse_unsupported(
            SimpleNamespace(group_by_length=False), SimpleNamespace(template=SimpleNamespace(sequence_parallel_size=2))
        )


def test_plugin_path_prints_the_file_that_registers_the_swift_callback(capsys):
    assert main(["plugin-path", "swift"]) == 0
    path = capsys.readouterr().out.strip()
    text = open(path).read()
    assert "from dflop_ds.integrations.swift import register" in text and "register()" in text


# ---- the ms-swift callback on a transformers.Trainer dressed as ms-swift's ------------------------


def swift_trainer(model_dir, rows, output_dir, dflop: dict, **training):
    """A ``transformers.Trainer`` over ``rows`` (a datasets.Dataset of chat rows) with the attributes
    the plugin reads of ms-swift's trainer (``template``, ``model_info``) and ms-swift's dict
    ``--deepspeed`` config holding ``dflop``; returns ``(trainer, callback)``."""
    import datasets
    from transformers import AutoModelForImageTextToText, Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(output_dir), use_cpu=True, report_to="none", per_device_train_batch_size=2,
        gradient_accumulation_steps=2, **training,
    )  # fmt: skip
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir))
    trainer = Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows))
    trainer.template = SimpleNamespace(padding_free=False, sequence_parallel_size=1)
    trainer.model_info = SimpleNamespace(model_dir=str(model_dir))
    args.deepspeed = {"dflop": dflop}  # as ms-swift keeps it, set after the Trainer started without DeepSpeed
    return trainer, DFLOPSwiftCallback(args, trainer)


def test_swift_checkpoints_hold_the_sampler_state_and_a_resume_of_another_schedule_is_refused(llava, tmp_path):
    from dflop_ds.hf_trainer import SAMPLER_STATE

    model, rows, _ = llava
    trainer, callback = swift_trainer(model, rows, tmp_path / "run", {"sampler": {"kind": "dflop"}}, data_seed=3)
    trainer.get_train_dataloader()
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    trainer._save_checkpoint(trainer.model, None)  # ms-swift's save, which the plugin wraps
    checkpoint = tmp_path / "run" / "checkpoint-0"
    assert (checkpoint / SAMPLER_STATE).is_file() and (checkpoint / "trainer_state.json").is_file()
    same, callback = swift_trainer(model, rows, tmp_path / "run", {"sampler": {"kind": "dflop"}}, data_seed=3)
    callback._resume = str(checkpoint)  # what trainer.train(checkpoint) records
    same.get_train_dataloader()  # the same schedule resumes
    for changed, training, key in [
        ({"sampler": {"kind": "dflop"}}, {"data_seed": 4}, "seed"),
        ({"sampler": {"kind": "stock"}}, {"data_seed": 3}, "method"),
    ]:
        other, callback = swift_trainer(model, rows, tmp_path / "run", changed, **training)
        callback._resume = str(checkpoint)
        with pytest.raises(ValueError, match=rf"{SAMPLER_STATE}.*{key}"):
            other.get_train_dataloader()
    plain = tmp_path / "plain"
    plain.mkdir()
    other, callback = swift_trainer(model, rows, tmp_path / "run", {"sampler": {"kind": "dflop"}}, data_seed=3)
    callback._resume = str(plain)
    with pytest.raises(ValueError, match=rf"{plain / SAMPLER_STATE}: no such file"):
        other.get_train_dataloader()


def test_swift_refuses_a_memory_cap_a_later_epoch_cannot_meet_before_step_0(llava, tmp_path):
    """Epoch 0 is fitted when the sampler is built; the run's later epochs must be too (as
    DFLOPTrainer's): a cap that epoch 0's batches meet and epoch 1's do not is an error before
    step 0 of a 3-epoch run, and no error for a 1-epoch run."""
    from dflop_ds.compose import RunInputs, TrainerTopology, build_trainer_sampler, run_settings
    from dflop_ds.models.hf.preprocessor import hf_preprocessor
    from dflop_ds.schedule import MemoryCapError

    model, rows, _ = llava
    shapes = chat_shapes(rows, hf_preprocessor(str(model)).policy(), "rows")

    def fails(seed: int, block: dict, epochs: int) -> bool:
        settings = run_settings(block, None)
        inputs = RunInputs(settings.config, shapes, None, seed, "data_seed", settings.sync)
        try:
            build_trainer_sampler(inputs, TrainerTopology(0, 1, 1, 2, 2, False, num_train_epochs=epochs))
        except MemoryCapError:
            return True
        return False

    from dflop_ds.cost import ProxyCost
    from dflop_ds.schedule.memory import sample_bytes

    largest = float(sample_bytes(ProxyCost(), shapes).max())
    blocks = [{"sampler": {"memory_cap_bytes": f / 20 * largest}} for f in range(24, 60)]
    found = next(((s, b) for s in range(20) for b in blocks if not fails(s, b, 1) and fails(s, b, 3)), None)
    assert found, "no seed and cap that only a later epoch misses: the check is void"
    seed, block = found
    one, _ = swift_trainer(model, rows, tmp_path, block, data_seed=seed, num_train_epochs=1)
    assert len(one.get_train_dataloader()) == 6
    three, _ = swift_trainer(model, rows, tmp_path, block, data_seed=seed, num_train_epochs=3)
    with pytest.raises(MemoryCapError, match=r"epoch [12] global batch \d+.*memory cap"):
        three.get_train_dataloader()


@pytest.mark.parametrize("key, option", [("packing", "--padding_free true"), ("freeze_encoder", "--freeze_vit true")])
def test_swift_refuses_the_model_options_ms_swift_has_its_own_of(llava, tmp_path, key, option):
    model, rows, _ = llava
    with pytest.raises(ValueError, match=rf"dflop\.model\.{key}: .*pass {option}"):
        swift_trainer(model, rows, tmp_path, {"model": {key: True}})


def test_swift_padding_free_on_sdpa_balances_each_row_as_one_sequence(llava, tmp_path):
    """ms-swift's ``--padding_free`` rows reach SDPA as one row with a block-diagonal mask, run densely:
    the sampler balances the row cost (RowPackedCost), not the sum of the samples'."""
    from dflop_ds.cost import PackedCost, RowPackedCost

    model, rows, _ = llava
    trainer, _ = swift_trainer(model, rows, tmp_path, {"sampler": {"kind": "dflop"}})
    assert trainer.model.config.get_text_config()._attn_implementation == "sdpa"
    trainer.template.padding_free = True
    cost_model = trainer.get_train_dataloader().batch_sampler.sampler.cost_model
    assert isinstance(cost_model, RowPackedCost)
    trainer.template.padding_free = False
    assert not isinstance(trainer.get_train_dataloader().batch_sampler.sampler.cost_model, PackedCost)
