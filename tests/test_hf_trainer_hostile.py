"""DFLOPTrainer against hostile input, in one process: a checkpoint it did not write, weights saved
under legacy names, a memory cap the plain batches miss, dflop keys it does not honour, shapes
that do not describe the dataset, and the indices a user's Dataset receives."""

from __future__ import annotations

import collections
import json
import shutil

import numpy as np
import pytest
import test_hf_trainer
import torch
from test_sampler_memory_cap import clip

from dflop_ds.cost import ProxyCost
from dflop_ds.hf_trainer import SAMPLER_STATE, DFLOPTrainer
from dflop_ds.hf_trainer.block_rules import TRAINER_INSTEAD, trainer_block_problems
from dflop_ds.hf_trainer.resume import read_sampler_state, write_sampler_state
from dflop_ds.hf_trainer.sampler import TrainerBatchSampler, epoch_batches_with_tail
from dflop_ds.schedule import DFLOPBatchSampler
from dflop_ds.schedule.fit_batches import MemoryCapError
from dflop_ds.schedule.index import ScheduledIndex
from dflop_ds.schedule.memory import microbatch_bytes, sample_bytes
from dflop_ds.shapes import SampleShape

RECORDS = test_hf_trainer.RECORDS
#: the tiny LLaVA, its LLaVA JSON records and a Trainer's parts over them (test_hf_trainer's fixtures)
llava_inputs, tiny_trainer_parts = test_hf_trainer.llava_inputs, test_hf_trainer.tiny_trainer_parts


class IndexRecorder(torch.utils.data.Dataset):
    """A user's Dataset of ``n`` numbers that records the type of every index it is given."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.types: set[type] = set()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index):
        self.types.add(type(index))
        return torch.tensor([index])


def stack(items):
    return torch.cat(items)


def user_example():
    """examples/hf_trainer.py as a module: a user's LLaVA JSON Dataset and padded collator."""
    import importlib.util
    import sys

    from ds_runs import REPO

    spec = importlib.util.spec_from_file_location("hf_trainer_example", REPO / "examples" / "hf_trainer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


# ---- resume ------------------------------------------------------------------------------------


def test_a_checkpoint_without_the_sampler_state_is_refused_naming_the_file(tiny_trainer_parts, tmp_path):
    model, args, _, good = tiny_trainer_parts
    trainer = DFLOPTrainer(model=model, args=args, train_dataset=IndexRecorder(RECORDS), sample_shapes=good)
    trainer._dflop_resume = str(tmp_path)  # a plain Trainer's checkpoint: no dflop_sampler.json
    with pytest.raises(ValueError, match=rf"{tmp_path / SAMPLER_STATE}: no such file.*plain Trainer's.*start"):
        trainer.get_train_dataloader()


def test_the_sampler_state_is_written_whole_and_names_the_shape_policy(tiny_trainer_parts, tmp_path):
    model, args, _, good = tiny_trainer_parts
    first = DFLOPTrainer(model=model, args=args, train_dataset=IndexRecorder(RECORDS), sample_shapes=good)
    first.get_train_dataloader()
    first._save_sampler_state(str(tmp_path / "checkpoint-3"))
    assert sorted(p.name for p in (tmp_path / "checkpoint-3").iterdir()) == [SAMPLER_STATE]  # no temporary left
    saved = read_sampler_state(tmp_path / "checkpoint-3")
    assert saved["shape_policy"]["name"] == good.policy.name and saved["batches_per_epoch"] == RECORDS // 2
    saved["shape_policy"] = {**saved["shape_policy"], "tokens_per_tile": 1}  # shapes of another processor
    write_sampler_state(tmp_path / "checkpoint-3", saved)
    second = DFLOPTrainer(model=model, args=args, train_dataset=IndexRecorder(RECORDS), sample_shapes=good)
    second._dflop_resume = str(tmp_path / "checkpoint-3")
    with pytest.raises(ValueError, match=r"saved with shape_policy=.*another shape policy"):
        second.get_train_dataloader()


def test_checkpoint_weights_saved_under_legacy_names_are_restored_without_deepspeed(llava_inputs, tmp_path):
    from transformers import AutoModelForImageTextToText, TrainingArguments

    model_dir, data, images = llava_inputs
    trained = AutoModelForImageTextToText.from_pretrained(str(model_dir))
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(0.5)
    checkpoint = tmp_path / "checkpoint-1"
    trained.save_pretrained(checkpoint)  # what the Trainer's save writes: legacy LLaVA key names
    fresh = AutoModelForImageTextToText.from_pretrained(str(model_dir))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trainer = DFLOPTrainer(model=fresh, args=args)
    trainer._load_from_checkpoint(str(checkpoint))
    restored = dict(fresh.named_parameters())
    assert all(torch.equal(restored[name], value) for name, value in trained.named_parameters())
    sharded = tmp_path / "checkpoint-2"
    trained.save_pretrained(sharded, max_shard_size="20KB")  # a large model's layout: an index and shards
    assert (sharded / "model.safetensors.index.json").is_file()
    other = AutoModelForImageTextToText.from_pretrained(str(model_dir))
    DFLOPTrainer(model=other, args=args)._load_from_checkpoint(str(sharded))
    restored = dict(other.named_parameters())
    assert all(torch.equal(restored[name], value) for name, value in trained.named_parameters())
    from safetensors.torch import load_file, save_file

    partial = dict(list(load_file(str(checkpoint / "model.safetensors")).items())[5:])
    save_file(partial, str(checkpoint / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.safetensors: 5 parameters of LlavaForConditionalGeneration"):
        trainer._load_from_checkpoint(str(checkpoint))


@pytest.mark.slow  # a few seconds: two optimizer steps of the tiny LLaVA, saved and resumed
def test_a_resumed_run_finds_its_sampler_state_beside_every_trainer_state(llava_inputs, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainingArguments

    from dflop_ds.hf_trainer import llava_json_shapes

    example = user_example()  # the user's Dataset and collator

    model_dir, data, images = llava_inputs
    processor = AutoProcessor.from_pretrained(str(model_dir))
    dataset = example.LlavaJsonDataset(str(data), str(images), processor)
    shapes = llava_json_shapes(data, str(model_dir), image_folder=images)
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=2,
        max_steps=2, save_steps=1, save_strategy="steps", disable_tqdm=True,
    )  # fmt: skip
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir))
    collator = example.PadCollator(processor.tokenizer.pad_token_id)
    DFLOPTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator, sample_shapes=shapes).train()
    for step in (1, 2):
        assert {SAMPLER_STATE, "trainer_state.json"} <= {p.name for p in (tmp_path / f"checkpoint-{step}").iterdir()}
    plain = tmp_path / "plain"
    shutil.copytree(tmp_path / "checkpoint-1", plain)
    (plain / SAMPLER_STATE).unlink()  # a kill between the two files, or a plain Trainer's checkpoint
    again = DFLOPTrainer(
        model=AutoModelForImageTextToText.from_pretrained(str(model_dir)),
        args=args,
        train_dataset=dataset,
        data_collator=collator,
        sample_shapes=shapes,
    )
    with pytest.raises(ValueError, match=rf"{plain / SAMPLER_STATE}: no such file"):
        again.train(resume_from_checkpoint=str(plain))


# ---- the memory cap ------------------------------------------------------------------------------


def capped_trainer_sampler(cap: float | None, seed: int, shapes: list[SampleShape]) -> TrainerBatchSampler:
    """One rank of two, 8-sample global batches of 2 microbatches per rank, the last 4 samples a
    shorter step of one microbatch per rank."""

    def build(gbs: int, gas: int) -> DFLOPBatchSampler:
        return DFLOPBatchSampler(
            shapes, global_batch_size=gbs, gradient_accumulation_steps=gas, dp_size=2, seed=seed, prefetch=0,
            cost_model=ProxyCost(tile_cost=1.0), memory_cap=cap,
        )  # fmt: skip

    return TrainerBatchSampler(build(8, 2), last_step_sampler=build(4, 1))


def test_the_trainer_trains_the_batches_the_memory_cap_fitted_and_refuses_an_unfit_cap_before_step_0():
    shapes = [clip(f"v{i}", 40, 20) if i < 6 else clip(f"t{i}", 0, 30) for i in range(28)]
    cost = ProxyCost(tile_cost=1.0)
    video = float(sample_bytes(cost, shapes).max())
    cap = 1.01 * microbatch_bytes(cost, [shapes[0], shapes[6]])  # one video per microbatch, with a text
    for seed in range(50):  # a seed whose plain permutation puts 5 videos into one batch of 4 microbatches
        plain = epoch_batches_with_tail(len(shapes), seed, 0, 8, 2)[0]
        if any(len(batch) == 8 and np.sum(batch < 6) > 4 for batch in plain):
            break
    else:
        pytest.fail("no seed crowds the videos: the check is void")
    sampler = capped_trainer_sampler(cap, seed, shapes)
    crowded = next(batch for batch in plain if len(batch) == 8 and np.sum(batch < 6) > 4)
    assert sampler.sampler.fit_under_cap(crowded, cap) is None  # the plain batch the Trainer trained before
    sampler.check_epochs(1)
    microbatches = list(sampler)
    other = capped_trainer_sampler(cap, seed, shapes)
    other.sampler.dp_rank = other.last_step_sampler.dp_rank = 1
    microbatches += list(other)
    counts = collections.Counter(i for mb in microbatches for i in mb)
    assert sorted(counts) == list(range(len(shapes))) and set(counts.values()) == {1}
    assert all(microbatch_bytes(cost, [shapes[i] for i in mb]) <= cap for mb in microbatches if len(mb) > 1)
    assert video < cap
    texts = [clip(f"t{i}", 0, 30) for i in range(28)]
    alone = float(sample_bytes(cost, texts).max())
    with pytest.raises(MemoryCapError, match=r"epoch 0 global batch \d+.*memory cap"):
        capped_trainer_sampler(1.5 * alone, seed, texts).check_epochs(1)  # 8 samples need pairs in 4 microbatches


def test_an_unsplittable_batch_advises_only_keys_that_exist():
    from dflop_ds.schedule.partition import InfeasibleError, partition_batch

    with pytest.raises(InfeasibleError) as caught:
        sizes = np.array([7.0, 7.0, 8.0, 2.0, 1.0, 8.0, 1.0])  # the heuristic's placement misses a cap of 12
        partition_batch(sizes, 3, time_limit_s=0, memory=sizes, memory_cap=12)
    assert "node_limit" not in str(caught.value)
    assert "dflop.sampler.ilp_nodes" in str(caught.value) and "single process" in str(caught.value)


# ---- the dflop block -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("block", "key", "instead"),
    [
        ({"train": {"lr": 0.1}}, "dflop.train.lr", "learning_rate"),
        ({"train": {"steps": 3}}, "dflop.train.steps", "max_steps"),
        ({"model": {"lora": {"r": 8}}}, "dflop.model.lora", "get_peft_model"),
        ({"model": {"encoder": "colocated"}}, "dflop.model.encoder", "colocated"),
        ({"data": {"on_bad_sample": "skip"}}, "dflop.data.on_bad_sample", "drop it"),
        ({"data": {"max_length": 64}}, "dflop.data.max_length", "max_length="),
        ({"data": {"path": "x.json"}}, "dflop.data.path", "train_dataset="),
        ({"plan": {"pipeline_stages": 2}}, "dflop.plan.pipeline_stages", "no pipeline"),
        ({"telemetry": {"enabled": False}}, "dflop.telemetry", "logs dflop_predicted_imbalance"),
        ({"correction": {"enabled": True}}, "dflop.correction", "DeepSpeed loop"),
        ({"sampler": {"memory_cap_bytes": "auto"}}, "dflop.sampler.memory_cap_bytes", "no device budget"),
    ],
)
def test_a_dflop_key_the_trainer_does_not_honour_is_refused_naming_it(tiny_trainer_parts, block, key, instead):
    model, args, dataset, good = tiny_trainer_parts
    with pytest.raises(ValueError, match=rf"(?s)DFLOPTrainer\(dflop=\.\.\.\): DFLOPTrainer does not honour.*{key}.*"):
        DFLOPTrainer(model=model, args=args, train_dataset=dataset, sample_shapes=good, dflop=block)
    assert any(key in line and instead in line for line in trainer_block_problems(block))


def test_the_keys_the_trainer_honours_pass_and_every_other_names_an_alternative():
    honoured = {"sampler": {"kind": "stock", "memory_cap_bytes": "off", "prefetch": 0}, "train": {"seed": 3}}
    assert trainer_block_problems({**honoured, "model": {"packing": False, "freeze_encoder": True}}) == []
    assert all(text.strip() for text in TRAINER_INSTEAD.values())


def test_settings_that_are_not_a_dict_are_refused_naming_the_type(tiny_trainer_parts):
    model, args, dataset, good = tiny_trainer_parts
    with pytest.raises(
        TypeError, match=r"DFLOPTrainer\(dflop=\.\.\.\): the dflop settings must be a dict.*str 'stock'"
    ):
        DFLOPTrainer(model=model, args=args, train_dataset=dataset, sample_shapes=good, dflop="stock")


def test_freeze_encoder_freezes_the_vision_tower_and_nothing_else(tiny_trainer_parts):
    model, args, dataset, good = tiny_trainer_parts
    DFLOPTrainer(
        model=model, args=args, train_dataset=dataset, sample_shapes=good, dflop={"model": {"freeze_encoder": True}}
    )
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all("vision_tower" in name for name in frozen)
    tower = {f"model.vision_tower.{name}" for name, _ in model.model.vision_tower.named_parameters()}
    assert {name for name in tower if "embeddings" in name or ".layers.0." in name} <= frozen  # the layers it runs
    assert all(p.requires_grad for p in model.model.language_model.parameters())
    assert all(p.requires_grad for p in model.model.multi_modal_projector.parameters())


# ---- shapes and indices ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"), [("text_tokens", float("nan")), ("llm_tokens", float("inf")), ("label_tokens", -1)]
)
def test_shapes_with_a_count_that_is_not_finite_or_negative_are_refused_naming_the_sample(
    tiny_trainer_parts, field, value
):
    import dataclasses

    model, args, dataset, good = tiny_trainer_parts
    bad = list(good)
    bad[7] = dataclasses.replace(bad[7], **{field: value})
    with pytest.raises(ValueError, match=rf"sample_shapes\[7\] \(sample {bad[7].sample_id!r}\): {field}="):
        DFLOPTrainer(model=model, args=args, train_dataset=dataset, sample_shapes=bad)


def test_shapes_given_as_dicts_are_refused_naming_the_entry(tiny_trainer_parts):
    model, args, dataset, good = tiny_trainer_parts
    as_dicts = [{"sample_id": s.sample_id, "text_tokens": s.text_tokens} for s in good]
    with pytest.raises(TypeError, match=r"sample_shapes\[0\] is a dict, not a SampleShape"):
        DFLOPTrainer(model=model, args=args, train_dataset=dataset, sample_shapes=as_dicts)


class RecordsDataset(IndexRecorder):
    """A user's Dataset holding its JSON records (LLaVA-style ``records`` with an ``id``)."""

    def __init__(self, ids: list[str]) -> None:
        super().__init__(len(ids))
        self.records = [{"id": i} for i in ids]


def test_shapes_of_another_order_than_the_datasets_records_are_refused(tiny_trainer_parts):
    model, args, _, good = tiny_trainer_parts
    ids = [s.sample_id for s in good]
    DFLOPTrainer(model=model, args=args, train_dataset=RecordsDataset(ids), sample_shapes=good)  # the same order
    reordered = RecordsDataset(ids[1:] + ids[:1])
    with pytest.raises(ValueError, match=rf"sample_shapes\[0\] is sample {ids[0]!r} but train_dataset\[0\] is"):
        DFLOPTrainer(model=model, args=args, train_dataset=reordered, sample_shapes=good)


def test_a_users_dataset_receives_plain_int_indices(tiny_trainer_parts):
    model, args, _, good = tiny_trainer_parts
    dataset = IndexRecorder(RECORDS)
    trainer = DFLOPTrainer(model=model, args=args, train_dataset=dataset, data_collator=stack, sample_shapes=good)
    fetched = torch.cat(list(trainer.get_train_dataloader())).tolist()
    assert dataset.types == {int} and sorted(fetched) == list(range(RECORDS))


def test_a_scheduled_index_prints_as_its_number():
    index = ScheduledIndex(51, loss_denominator=142.25, batch_id=0)
    assert (str(index), f"{index}", f"{index:03d}", json.dumps(index)) == ("51", "51", "051", "51")
    assert index.loss_denominator == 142.25 and "loss_denominator" in repr(index)


def test_ranks_reading_different_data_files_are_named(llava_inputs, tmp_path):
    from dflop_ds.hf_trainer.agreement import ranks_disagreement, trainer_input_digests
    from dflop_ds.hf_trainer.shapes import ShapeTable

    _, data, images = llava_inputs
    other = tmp_path / "data.json"
    other.write_text(data.read_text() + "\n")  # the same records, other bytes
    shutil.copytree(images, tmp_path / "images")

    def digests(path, folder, rank):
        table = ShapeTable(shapes(4), None, path, folder)  # type: ignore[arg-type]
        return trainer_input_digests(table, None, "proxy", 0, "seed", {}, rank)

    same = ranks_disagreement([digests(data, images, 0), digests(data, images, 1)])
    assert same is None
    report = ranks_disagreement([digests(data, images, 0), digests(other, tmp_path / "images", 1)])
    assert report is not None and "data file" in report and str(other) in report


def shapes(n: int) -> list[SampleShape]:
    return [SampleShape(f"s{i}", text_tokens=10 + i, label_tokens=3, llm_tokens=10 + i) for i in range(n)]


# ---- second hostile pass -------------------------------------------------------------------------


def test_a_resume_under_another_memory_cap_or_sampler_kind_is_refused(tiny_trainer_parts, tmp_path):
    """The Trainer resumes by its step count; a cap or kind that moves samples between the epoch's
    batches would train the rest of the epoch from other batches (samples twice or never)."""
    video = [clip(f"v{i}", 40, 20) if i < 6 else clip(f"t{i}", 0, 30) for i in range(28)]
    cap = 1.01 * microbatch_bytes(ProxyCost(tile_cost=1.0), [video[0], video[6]])

    def differ(seed: int) -> bool:
        fitted, plain = (capped_trainer_sampler(c, seed, video).batches(0) for c in (cap, None))
        return not all(np.array_equal(a, b) for a, b in zip(fitted, plain, strict=True))

    moved = [seed for seed in range(50) if differ(seed)]
    assert moved, "no seed where the cap moves samples: the check is void"
    seed = moved[0]
    fitted, plain = (
        capped_trainer_sampler(cap, seed, video).batches(0),
        capped_trainer_sampler(None, seed, video).batches(0),
    )
    step = next(k for k in range(len(fitted)) if not np.array_equal(fitted[k], plain[k])) + 1
    mixed = collections.Counter(np.concatenate(fitted[:step] + plain[step:]).tolist())
    assert set(mixed.values()) != {1}  # resuming under the other cap would repeat and miss samples
    model, args, _, good = tiny_trainer_parts
    first = DFLOPTrainer(model=model, args=args, train_dataset=IndexRecorder(RECORDS), sample_shapes=good)
    first.get_train_dataloader()
    first._save_sampler_state(str(tmp_path / "checkpoint-1"))
    for block, key in [
        ({"sampler": {"memory_cap_bytes": 1e12}}, "memory_cap"),
        ({"sampler": {"kind": "stock"}}, "method"),
    ]:
        again = DFLOPTrainer(
            model=model, args=args, train_dataset=IndexRecorder(RECORDS), sample_shapes=good, dflop=block
        )
        again._dflop_resume = str(tmp_path / "checkpoint-1")
        with pytest.raises(ValueError, match=rf"{SAMPLER_STATE}: saved with {key}=.*changed"):
            again.get_train_dataloader()


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: {**s, "sampler": []}, r"'sampler' must be the sampler's state object, got list"),
        (lambda s: {**s, "sampler": {**s["sampler"], "epoch": None}}, r"cannot resume this run from it: int\(\)"),
        (lambda s: {k: v for k, v in s.items() if k != "shape_policy"}, r"no shape_policy in it"),
        (lambda s: {**s, "sampler": {k: v for k, v in s["sampler"].items() if k != "dataset_fingerprint"}},
         r"no dataset_fingerprint in it"),
    ],
)  # fmt: skip
def test_a_sampler_state_that_cannot_be_compared_whole_is_refused_naming_the_file(
    tiny_trainer_parts, tmp_path, edit, message
):
    model, args, _, good = tiny_trainer_parts
    first = DFLOPTrainer(model=model, args=args, train_dataset=IndexRecorder(RECORDS), sample_shapes=good)
    first.get_train_dataloader()
    first._save_sampler_state(str(tmp_path))
    write_sampler_state(tmp_path, edit(read_sampler_state(tmp_path)))
    again = DFLOPTrainer(model=model, args=args, train_dataset=IndexRecorder(RECORDS), sample_shapes=good)
    again._dflop_resume = str(tmp_path)
    with pytest.raises(ValueError, match=rf"{tmp_path / SAMPLER_STATE}: .*{message}"):
        again.get_train_dataloader()


def test_an_empty_dataset_is_refused_by_name(tiny_trainer_parts):
    model, args, _, _ = tiny_trainer_parts
    with pytest.raises(ValueError, match=r"train_dataset \(IndexRecorder\) has no samples"):
        DFLOPTrainer(model=model, args=args, train_dataset=IndexRecorder(0), sample_shapes=[])


def test_the_padding_free_collator_names_an_item_it_cannot_pack(tiny_trainer_parts):
    """Labels shorter than the tokens were packed misaligned; a list or a [1, n] tensor gave an AttributeError."""
    from dflop_ds.hf_trainer import padding_free_collator

    collate = padding_free_collator(tiny_trainer_parts[0])
    good = {"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor([-100, 2, 3])}
    assert collate([good, good])["labels"].shape == (1, 6)
    short = {"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor([2, 3])}
    with pytest.raises(ValueError, match=r"batch item 1 has 3 input_ids but 2 labels"):
        collate([good, short])
    for bad in (
        {"input_ids": [1, 2], "labels": [1, 2]},
        {"input_ids": torch.tensor([[1, 2]]), "labels": good["labels"]},
    ):
        with pytest.raises(ValueError, match=r"batch item 1 needs 'input_ids' as a 1-D tensor"):
            collate([good, bad])
