"""dflop_ds.hf_trainer: DFLOP's sampler inside ``transformers.Trainer``.

In-process: the window arithmetic, the blank-image guard against the real tiny LLaVA, the shapes
helper, and the errors raised before training. On 2 DeepSpeed ranks (one launch of
ds_scripts/hf_trainer_checks.py, a Trainer script written as a user writes one): ZeRO-2 training
killed and resumed, one SGD step against the whole global batch in one process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from ds_runs import REPO, repo_first_pythonpath, run_on_ranks, run_with_accelerate
from family_inputs import FAMILY_BUILDERS, RightPadCollator, image_chats

from dflop_ds.hf_trainer import (
    SAMPLER_STATE,
    SUPPORTED,
    DFLOPTrainer,
    check_transformers_version,
    dflop_settings,
    llava_json_shapes,
)
from dflop_ds.hf_trainer.agreement import ranks_disagreement, trainer_input_digests
from dflop_ds.hf_trainer.guard import blank_image_for, has_images, with_blank_image
from dflop_ds.hf_trainer.packing import concatenated_media
from dflop_ds.hf_trainer.sampler import (
    TrainerBatchSampler,
    epoch_batches_with_tail,
    last_step_microbatches,
    trainer_data_parallel_coords,
)
from dflop_ds.models.hf.registry import trainer_parts_of
from dflop_ds.rank_lifecycle import CLEAN_SHUTDOWN
from dflop_ds.schedule import DFLOPBatchSampler
from dflop_ds.shapes import SampleShape

SCRIPT = Path(__file__).parent / "ds_scripts" / "hf_trainer_checks.py"
GAS = 2
RECORDS = 28


@pytest.fixture(scope="module")
def llava_inputs(tmp_path_factory):
    """A tiny HF LLaVA and 28 LLaVA JSON records (30% text-only) with real image files: 3 global
    batches of 8 and a short one of 4 per epoch on 2 ranks with 2 microbatches each."""
    from dflop_ds.testing.hf_tiny import build_tiny_llava
    from dflop_ds.testing.llava_data import write_llava_dataset

    root = tmp_path_factory.mktemp("hf_trainer")
    model = build_tiny_llava(root / "model")
    data, images = write_llava_dataset(root / "data", RECORDS, seed=1, text_only=0.3, answer_words=(3, 20))
    return model, data, images


def shapes(n: int) -> list[SampleShape]:
    return [SampleShape(f"s{i}", text_tokens=10 + i, label_tokens=3, llm_tokens=10 + i) for i in range(n)]


# ---- the sampler as the Trainer sees it ----------------------------------------------------------


def test_epoch_keeps_a_short_last_batch_that_fills_a_step_and_drops_a_smaller_one():
    batches, dropped = epoch_batches_with_tail(10, 0, 3, 4, min_batch=2)
    assert [len(b) for b in batches] == [4, 4, 2] and dropped == 0
    assert sorted(np.concatenate(batches).tolist()) == list(range(10))
    batches, dropped = epoch_batches_with_tail(10, 0, 3, 4, min_batch=4)
    assert [len(b) for b in batches] == [4, 4] and dropped == 2
    assert [len(b) for b in epoch_batches_with_tail(10, 0, 3, 4, min_batch=2, drop_last=True)[0]] == [4, 4]


def test_trainer_epochs_train_every_sample_once_in_gas_microbatches_and_restart_anywhere():
    n, dp, gas = 10, 2, 1
    ranks = [
        TrainerBatchSampler(
            DFLOPBatchSampler(shapes(n), global_batch_size=4, gradient_accumulation_steps=gas, dp_rank=r, dp_size=dp)
        )
        for r in range(dp)
    ]
    assert ranks[0].batches_per_epoch == 3 and len(ranks[0]) == 3 * gas  # 4 + 4 + the last 2
    per_epoch = {}
    for epoch in range(3):
        seen: list[int] = []
        for r, rank in enumerate(ranks):
            rank.set_epoch(epoch)
            microbatches = [[int(i) for i in mb] for mb in rank]
            assert len(microbatches) == len(rank) and all(microbatches)
            per_epoch[epoch, r] = microbatches
            seen += [i for mb in microbatches for i in mb]
        assert sorted(seen) == list(range(n))  # each sample once per epoch, over both ranks
    assert per_epoch[0, 0] != per_epoch[1, 0]  # a fresh order each epoch
    again = ranks[1]
    again.set_epoch(1)  # a restart at any epoch yields the same microbatches
    assert [[int(i) for i in mb] for mb in again] == per_epoch[1, 1]


def test_the_last_step_of_an_epoch_has_one_sample_per_microbatch_or_fewer_microbatches():
    assert [last_step_microbatches(n, 8, 2, 2) for n in (16, 20, 19, 18, 17)] == [2, 2, 1, 1, 2]
    assert last_step_microbatches(20, 8, 2, 2, drop_last=True) == 2  # the rest is dropped: a full last step
    assert [last_step_microbatches(n, 9, 3, 1) for n in (28, 29, 27)] == [1, 2, 3]


def test_a_short_rest_is_a_last_step_of_fewer_microbatches_on_every_rank_and_each_sample_trains_once():
    def ranks(n: int, last_step: bool = True) -> list[TrainerBatchSampler]:
        def sampler(gbs: int, gas: int, rank: int) -> DFLOPBatchSampler:
            return DFLOPBatchSampler(
                shapes(n), global_batch_size=gbs, gradient_accumulation_steps=gas, dp_rank=rank, dp_size=2
            )

        return [
            TrainerBatchSampler(
                sampler(8, 2, r), last_step_sampler=sampler(n % 8, 1, r) if last_step and n % 8 >= 2 else None
            )
            for r in range(2)
        ]

    for n, dropped in ((18, 0), (17, 1)):  # a rest of 2: one microbatch of 1 per rank; of 1: fewer than the ranks
        both = ranks(n)
        assert [len(rank) for rank in both] == [2 * 2 + (1 - dropped)] * 2 and both[0].dropped_per_epoch == dropped
        for epoch in range(2):
            seen = []
            for rank in both:
                rank.set_epoch(epoch)
                microbatches = [[int(i) for i in mb] for mb in rank]
                assert len(microbatches) == len(rank) and all(microbatches)
                seen += [i for mb in microbatches for i in mb]
            assert len(seen) == len(set(seen)) == n - dropped
    with pytest.raises(ValueError, match=r"the last 2 samples of an epoch fill 1 microbatches per rank, not 2"):
        ranks(18, last_step=False)


def test_tensor_parallel_peers_share_a_data_parallel_rank():
    assert [trainer_data_parallel_coords(r, 4, 2) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    with pytest.raises(ValueError, match="not a multiple"):
        trainer_data_parallel_coords(0, 3, 2)


def test_ranks_that_would_train_different_splits_are_named_before_the_first_step():
    settings = {"kind": "dflop", "global_batch_size": 8, "gradient_accumulation_steps": 2, "dp_size": 2}

    def digests(rank, table, seed, cost_model=None):
        return trainer_input_digests(
            table, cost_model, "costmodel.json", seed, "TrainingArguments.seed", settings, rank
        )

    same = [digests(0, shapes(12), 3), digests(1, shapes(12), 3)]
    assert ranks_disagreement(same) is None
    reordered = shapes(12)[::-1]  # e.g. a rank whose dataset listed the files in another order
    report = ranks_disagreement([digests(0, shapes(12), 3), digests(1, reordered, 4)])
    assert report is not None
    assert "rank 1: its shape table differs from rank 0's" in report and "sample_shapes= on rank 1" in report
    assert "rank 1: its data-order seed differs from rank 0's" in report
    from dflop_ds.cost import ProxyCost

    other_cost = ranks_disagreement([digests(0, shapes(12), 3), digests(1, shapes(12), 3, ProxyCost())])
    assert other_cost is not None and "its cost model differs" in other_cost


# ---- the blank image of image-free microbatches ----------------------------------------------------


def test_blank_image_leaves_loss_and_gradients_unchanged_and_runs_the_tower(llava_inputs):
    from transformers import AutoModelForImageTextToText

    model_dir, _, _ = llava_inputs
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir))
    blank = blank_image_for(model.config)
    assert blank is not None and blank.tokens == 16 and blank.pixel_shape == (1, 3, 32, 32)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 300, (2, 9), generator=generator)
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    batch["attention_mask"][1, 6:] = 0
    batch["labels"][1, 6:] = -100
    guarded = with_blank_image(batch, blank)
    assert not has_images(batch) and has_images(guarded)
    assert guarded["input_ids"].shape == (2, 25) and int((guarded["input_ids"] == blank.image_token_id).sum()) == 16

    def run(inputs):
        model.zero_grad()
        loss = model(**inputs).loss
        loss.backward()
        return loss.detach(), {k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()}

    loss, grads = run(batch)
    guarded_loss, guarded_grads = run(guarded)
    assert torch.allclose(loss, guarded_loss, atol=1e-6)
    tower = [k for k in grads if "vision_tower" in k]
    assert all(grads[k] is None for k in tower)  # no image: the tower takes no part
    # control: the same image, visible and predicted from, gives the tower gradients that are not zero
    image = {
        **guarded,
        "pixel_values": torch.rand(blank.pixel_shape, generator=generator),
        "attention_mask": torch.ones_like(guarded["input_ids"]),
        "labels": guarded["input_ids"].clone(),
    }
    _, image_grads = run(image)
    used = [k for k in tower if image_grads[k] is not None]
    assert used and [k for k in tower if guarded_grads[k] is not None] == used  # the tower ran as with an image
    assert all(not guarded_grads[k].any() for k in used) and any(image_grads[k].any() for k in used)
    for k, g in grads.items():
        if g is not None:
            assert torch.allclose(g, guarded_grads[k], atol=1e-6), k


def test_qwen2_vl_blank_image_runs_the_tower_and_leaves_loss_and_gradients_unchanged(tmp_path):
    """Qwen2-VL: an image-free microbatch skips the visual module (no gradient there, which splits
    ZeRO-2's reduction across ranks); the guarded one runs it with zero gradients, the same loss and
    the same gradients elsewhere, padded (M-RoPE from ``mm_token_type_ids``) or padding-free
    (``position_ids [4, 1, L]``, no mask; then with the samples' bounds and the project's
    per-sample attention, ``use_segment_attention``)."""
    from transformers import AutoModelForImageTextToText

    from dflop_ds.hf_trainer import use_segment_attention
    from dflop_ds.testing.qwen2_vl_tiny import build_tiny_qwen2_vl

    model = AutoModelForImageTextToText.from_pretrained(str(build_tiny_qwen2_vl(tmp_path / "qwen2_vl")))
    model.config.text_config.use_cache = False  # else no per-sample attention mask for packed position_ids
    blank = blank_image_for(model.config)
    assert blank is not None and blank.tokens == 1 and blank.grid_thw == (1, 2, 2)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 200, (2, 9), generator=generator)
    padded = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    padded["attention_mask"][1, 6:] = 0
    padded["labels"][1, 6:] = -100
    flat_ids = ids.reshape(1, -1)
    text_positions = torch.arange(9).repeat(2).reshape(1, -1)  # two packed sequences of 9
    flat = {"input_ids": flat_ids, "labels": flat_ids.clone(), "position_ids": text_positions.expand(4, 1, -1)}
    bounds = torch.tensor([0, 9, 18], dtype=torch.int32)
    flat_bounds = {**flat, "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": 9, "max_length_k": 9}

    def run(inputs):
        model.zero_grad()
        loss = model(**inputs).loss
        loss.backward()
        return loss.detach(), {k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()}

    for batch in (padded, flat, flat_bounds):
        if batch is flat_bounds:
            assert use_segment_attention(model) == "dflop_segments"
        guarded = with_blank_image(batch, blank)
        assert has_images(guarded) and int((guarded["input_ids"] == blank.image_token_id).sum()) == 1
        assert guarded["mm_token_type_ids"][0, -1] == 1 and not guarded["mm_token_type_ids"][:, :-1].any()
        loss, grads = run(batch)
        guarded_loss, guarded_grads = run(guarded)
        assert torch.allclose(loss, guarded_loss, atol=1e-6)
        visual = [k for k in grads if ".visual." in k]
        assert visual and all(grads[k] is None for k in visual)  # no image: the visual module takes no part
        assert all(guarded_grads[k] is not None and not guarded_grads[k].any() for k in visual)
        for k, g in grads.items():
            if g is not None:
                assert torch.allclose(g, guarded_grads[k], atol=1e-6), k


@pytest.mark.parametrize("family", ["Qwen2-VL", "Qwen3-VL", "LLaVA-OneVision"])
def test_under_per_call_gathers_every_microbatch_runs_the_tower_for_images_then_videos(family, tmp_path):
    """Qwen2-VL, Qwen3-VL and LLaVA-OneVision run their tower once for images and once more for videos: under
    ZeRO-3 a rank with both gathers the tower twice, a rank with images alone once, and the ranks'
    collectives no longer match. With per-call gathers the guard completes the pair (a blank
    video, a blank image, or both), each masked out: the same loss and gradients, and two tower runs."""
    from transformers import AutoModelForImageTextToText

    from dflop_ds.hf_trainer.guard import guarded_batch

    model = AutoModelForImageTextToText.from_pretrained(str(FAMILY_BUILDERS[family](tmp_path / "m")))
    model.train()
    blank = blank_image_for(model.config)
    assert blank is not None and blank.video is not None and blank.video.token_id == model.config.video_token_id
    video = blank.video
    parts = trainer_parts_of(model.config)
    assert parts is not None
    collate = RightPadCollator(parts.media_keys, parts.padded_keys)
    image, with_video, text = image_chats(model.config, 3, every=3, video_every=3)  # media among real tokens
    batches = {kind: collate([item]) for kind, item in (("image", image), ("video", with_video), ("text", text))}
    assert has_images(batches["image"]) and "pixel_values" not in batches["video"] and not has_images(batches["text"])
    calls: list[int] = []
    tower = getattr(model.model, "visual", None) or model.model.vision_tower
    tower.register_forward_hook(lambda *_: calls.append(1))

    def run(inputs):
        model.zero_grad()
        calls.clear()
        loss = model(**inputs).loss
        loss.backward()
        return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    for kind, batch in batches.items():
        length = batch["input_ids"].shape[1]
        if kind != "text":
            assert guarded_batch(model, batch, blank) is batch  # gathered once per step: nothing to pair
        guarded = guarded_batch(model, batch, blank, pair_videos=True)
        assert all(guarded[key].numel() for key in ("pixel_values", "pixel_values_videos")), kind
        added = guarded["input_ids"][0, length:].tolist()
        blank_image, blank_video = [blank.image_token_id] * blank.tokens, [video.token_id] * video.tokens
        expected = {"image": blank_video, "video": blank_image, "text": blank_image + blank_video}[kind]
        assert added == expected, kind
        # the blank media are masked out of attention and of the loss
        assert not guarded["attention_mask"][:, length:].any() and (guarded["labels"][:, length:] == -100).all()
        loss, grads = run(batch)
        assert len(calls) == (0 if kind == "text" else 1)
        guarded_loss, guarded_grads = run(guarded)
        assert len(calls) == 2, kind  # the tower ran for the images, then for the videos
        assert torch.allclose(loss, guarded_loss, atol=1e-6), kind
        for k, g in grads.items():
            assert torch.allclose(g, guarded_grads[k], atol=1e-6), (kind, k)


def test_a_qwen2_vl_video_needs_no_blank_image():
    assert has_images({"pixel_values_videos": torch.zeros(8, 96)}) and not has_images({"pixel_values": torch.zeros(0)})


def test_no_blank_image_for_a_model_no_family_registers():
    from transformers import LlamaConfig

    assert blank_image_for(LlamaConfig()) is None


# ---- shapes and bad input ------------------------------------------------------------------------


def test_llava_json_shapes_cover_every_record_from_headers(llava_inputs):
    model_dir, data, images = llava_inputs
    records = json.loads(Path(data).read_text())
    got = llava_json_shapes(data, str(model_dir), image_folder=images)
    assert [s.sample_id for s in got] == [r["id"] for r in records]
    n_images = [0 if "image" not in r else 1 if isinstance(r["image"], str) else len(r["image"]) for r in records]
    assert [s.encoder_tiles for s in got] == n_images
    assert all(s.visual_tokens == 16 * k for s, k in zip(got, n_images))


def test_dflop_block_comes_from_the_deepspeed_config_and_bad_keys_are_named(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"dflop": {"sampler": {"kind": "stock"}}}))
    assert dflop_settings(None, str(config)).sampler.kind == "stock"
    assert dflop_settings({"sampler": {"kind": "verl"}}, str(config)).sampler.kind == "verl"
    assert dflop_settings(None, {"dflop": {"sampler": {"prefetch": 0}}}).sampler.prefetch == 0
    config.write_text(json.dumps({"dflop": {"sampler": {"kindd": "dflop"}}}))
    with pytest.raises(ValueError, match=r"ds\.json: unknown key dflop\.sampler\.kindd"):
        dflop_settings(None, str(config))


def test_transformers_outside_the_tested_ranges_is_refused_naming_them():
    for low, _ in SUPPORTED:
        assert check_transformers_version(str(low)) == str(low)
    named = ".*".join(rf"'transformers>={low},<{high}'" for low, high in SUPPORTED)
    for bad in ("4.57.0", "5.7.0", "5.18.2", "5.20.0", "5.25.0"):
        with pytest.raises(RuntimeError, match=rf"supports transformers {named}.*{bad} is installed"):
            check_transformers_version(bad)


def test_a_release_whose_resumed_epoch_misses_the_sampler_gets_the_epoch_from_the_trainer_state():
    from types import SimpleNamespace

    from dflop_ds.hf_trainer.version import ResumedEpochCallback, epoch_adapters

    split = DFLOPBatchSampler(shapes(RECORDS), global_batch_size=8, gradient_accumulation_steps=2, dp_size=2)
    sampler = TrainerBatchSampler(split)
    assert epoch_adapters(lambda: sampler, "5.19.0") == [] and epoch_adapters(lambda: sampler, "5.24.0") == []
    (adapter,) = epoch_adapters(lambda: sampler, "5.6.0")
    assert isinstance(adapter, ResumedEpochCallback)
    # resumed mid epoch 1 (the checkpoint's state.epoch is 1.5), then epoch 2 starts at exactly 2.0
    for progress, epoch in ((1.5, 1), (2.0, 2), (0.0, 0)):
        adapter.on_epoch_begin(None, SimpleNamespace(epoch=progress), None)
        assert sampler.epoch == epoch


@pytest.fixture
def tiny_trainer_parts(llava_inputs, tmp_path):
    from transformers import AutoModelForImageTextToText, TrainingArguments

    model_dir, data, images = llava_inputs
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=2)
    dataset = torch.utils.data.TensorDataset(torch.zeros(RECORDS, 3))
    return model, args, dataset, llava_json_shapes(data, str(model_dir), image_folder=images)


def test_wrong_shapes_and_bad_settings_are_refused_before_training(tiny_trainer_parts):
    model, args, dataset, good = tiny_trainer_parts
    with pytest.raises(
        ValueError, match=rf"sample_shapes has {RECORDS - 1} shapes but train_dataset \(TensorDataset\) has {RECORDS}"
    ):
        DFLOPTrainer(model=model, args=args, train_dataset=dataset, sample_shapes=good[:-1])
    with pytest.raises(ValueError, match=r"dflop\.sampler\.prefetch"):
        DFLOPTrainer(
            model=model, args=args, train_dataset=dataset, sample_shapes=good, dflop={"sampler": {"prefetch": -1}}
        )
    args.average_tokens_across_devices = False
    with pytest.raises(ValueError, match=r"average_tokens_across_devices=True"):
        DFLOPTrainer(model=model, args=args, train_dataset=dataset, sample_shapes=good)
    args.average_tokens_across_devices = True
    trainer = DFLOPTrainer(model=model, args=args, train_dataset=dataset)
    with pytest.raises(ValueError, match="needs sample_shapes="):
        trainer.get_train_dataloader()


def test_under_per_call_gathers_only_data_with_videos_pairs_a_blank_video(tiny_trainer_parts, monkeypatch):
    """A shape table from the shape helpers that counts no video spares every microbatch the blank
    video (a second tower call); one with a video, or shapes of unknown origin, keep the pairing."""
    import dataclasses

    from dflop_ds.hf_trainer.shapes import ShapeTable

    model, args, dataset, good = tiny_trainer_parts
    monkeypatch.setattr("dflop_ds.hf_trainer.guard.gathers_parameters_per_call", lambda trainer: True)
    with_video = ShapeTable([*good[:-1], dataclasses.replace(good[-1], video_frames=8)], good.policy)
    pairs = {
        name: DFLOPTrainer(model=model, args=args, train_dataset=dataset, sample_shapes=table)._pair_videos
        for name, table in (("no video", good), ("a video", with_video), ("a plain list", list(good)))
    }
    assert pairs == {"no video": False, "a video": True, "a plain list": True}


def test_single_process_loader_yields_gas_microbatches_of_the_global_batch(tiny_trainer_parts):
    model, args, dataset, good = tiny_trainer_parts
    args.gradient_accumulation_steps = GAS
    dataset = torch.utils.data.TensorDataset(torch.arange(RECORDS))
    collate = lambda items: torch.stack([item[0] for item in items])  # noqa: E731
    trainer = DFLOPTrainer(model=model, args=args, train_dataset=dataset, data_collator=collate, sample_shapes=good)
    loader = trainer.get_train_dataloader()
    assert len(loader) == RECORDS // (2 * GAS) * GAS  # 7 steps of GAS microbatches: the Trainer's epoch
    batches = list(loader)
    assert len(batches) == len(loader)
    assert sorted(torch.cat(batches).tolist()) == list(range(RECORDS))


def test_the_loader_trains_a_short_rest_in_a_last_step_of_fewer_microbatches(tiny_trainer_parts):
    model, args, _, good = tiny_trainer_parts
    args.per_device_train_batch_size, args.gradient_accumulation_steps = 3, 3  # 28 = 3 x 9 + 1
    dataset = torch.utils.data.TensorDataset(torch.arange(RECORDS))
    collate = lambda items: torch.stack([item[0] for item in items])  # noqa: E731
    trainer = DFLOPTrainer(model=model, args=args, train_dataset=dataset, data_collator=collate, sample_shapes=good)
    loader = trainer.get_train_dataloader()
    assert len(loader) == 3 * 3 + 1  # the Trainer's last update step takes len % gas = 1 microbatch
    batches = list(loader)
    assert len(batches) == len(loader) and batches[-1].tolist() != []
    assert sorted(torch.cat(batches).tolist()) == list(range(RECORDS))


def test_explicit_batch_keys_must_equal_training_arguments_from_either_launcher(llava_inputs, tmp_path, monkeypatch):
    from transformers import AutoModelForImageTextToText, TrainingArguments

    model_dir, data, images = llava_inputs
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir))
    dataset = torch.utils.data.TensorDataset(torch.zeros(RECORDS, 3))
    good = llava_json_shapes(data, str(model_dir), image_folder=images)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")  # undone after the test, as the Trainer sets it
    base = json.loads((REPO / "ds_configs" / "hf_trainer_zero2.json").read_text())
    explicit = {**base, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "train_batch_size": 4}
    explicit["dflop"] = {"sampler": {"kind": "stock"}}

    def trainer(deepspeed=None, gas=2):
        args = TrainingArguments(
            output_dir=str(tmp_path), use_cpu=True, report_to="none", deepspeed=deepspeed,
            per_device_train_batch_size=2, gradient_accumulation_steps=gas,
        )  # fmt: skip
        return DFLOPTrainer(model=model, args=args, train_dataset=dataset, sample_shapes=good)

    assert trainer(explicit).dflop_settings.sampler.kind == "stock"  # numbers that agree, and the block is read
    assert trainer(base).is_deepspeed_enabled  # "auto" keys
    with pytest.raises(
        ValueError,
        match=r"(?s)DeepSpeed config TrainingArguments\.deepspeed disagrees.*"
        r"ds gradient_accumulation_steps=2 vs hf gradient_accumulation_steps=4",
    ):
        trainer(explicit, gas=4)
    # accelerate launch --config_file <a DeepSpeed plugin config>: the config comes from the plugin
    path = tmp_path / "plugin.json"
    path.write_text(json.dumps({**explicit, "train_micro_batch_size_per_gpu": 4}))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
    with pytest.raises(
        ValueError,
        match=rf"(?s)ACCELERATE_DEEPSPEED_CONFIG_FILE={path}\) disagrees.*"
        r"ds train_micro_batch_size_per_gpu=4 vs hf per_device_train_batch_size=2",
    ):
        trainer()
    path.write_text(json.dumps(explicit))
    assert trainer().dflop_settings.sampler.kind == "stock"  # the plugin config's "dflop" block


@pytest.mark.parametrize("accelerate_stage, sync", [(None, "module"), ("1", "boundary")])
def test_an_auto_zero_stage_is_the_one_accelerate_fills_in(llava_inputs, tmp_path, monkeypatch, accelerate_stage, sync):
    """A DeepSpeed config with HF-style ``"stage": "auto"`` trains: accelerate's DeepSpeed plugin
    fills the stage (its default 2, or ``ACCELERATE_DEEPSPEED_ZERO_STAGE``) and the sampler splits
    for how those ranks meet, read from the filled config."""
    from transformers import AutoModelForImageTextToText, TrainingArguments

    model_dir, data, images = llava_inputs
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir))
    dataset = torch.utils.data.TensorDataset(torch.zeros(RECORDS, 3))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")  # undone after the test, as the Trainer sets it
    if accelerate_stage is not None:
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", accelerate_stage)
    config = json.loads((REPO / "ds_configs" / "hf_trainer_zero2.json").read_text())
    config["zero_optimization"] = {"stage": "auto"}
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", deepspeed=config, per_device_train_batch_size=2
    )
    trainer = DFLOPTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        sample_shapes=llava_json_shapes(data, str(model_dir), image_folder=images),
    )
    assert trainer.dflop_sync.value == sync


def test_resume_from_a_checkpoint_of_another_dataset_is_refused(tiny_trainer_parts, tmp_path):
    model, args, _, good = tiny_trainer_parts
    dataset = torch.utils.data.TensorDataset(torch.arange(RECORDS))
    first = DFLOPTrainer(model=model, args=args, train_dataset=dataset, sample_shapes=good)
    first.get_train_dataloader()
    first._save_sampler_state(str(tmp_path))
    saved = json.loads((tmp_path / SAMPLER_STATE).read_text())
    assert saved["batches_per_epoch"] == RECORDS // 2  # global batches of 2
    other = DFLOPTrainer(model=model, args=args, train_dataset=dataset, sample_shapes=good[::-1])
    other._dflop_resume = str(tmp_path)  # what train(resume_from_checkpoint=tmp_path) records
    with pytest.raises(ValueError, match=rf"{SAMPLER_STATE}: cannot resume this run from it: .*another dataset"):
        other.get_train_dataloader()


def test_an_explicit_dflop_seed_of_zero_wins_over_the_trainers_seed(tiny_trainer_parts):
    model, args, dataset, good = tiny_trainer_parts
    args.seed = 5
    explicit = DFLOPTrainer(
        model=model, args=args, train_dataset=dataset, sample_shapes=good, dflop={"train": {"seed": 0}}
    )
    assert explicit.get_train_dataloader().batch_sampler.sampler.seed == 0
    implicit = DFLOPTrainer(model=model, args=args, train_dataset=dataset, sample_shapes=good, dflop={})
    assert implicit.get_train_dataloader().batch_sampler.sampler.seed == 5


def test_time_limited_solver_is_refused_with_more_than_one_rank(tiny_trainer_parts, tmp_path):
    from transformers import TrainingArguments

    from dflop_ds.setup_checks import SetupError

    class TwoRankArguments(TrainingArguments):  # the world size a 2-rank launch gives the Trainer
        @property
        def world_size(self) -> int:
            return 2

    model, args, dataset, good = tiny_trainer_parts
    limited = {"sampler": {"time_limit_s": 0.5}}
    two = TwoRankArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=2)
    trainer = DFLOPTrainer(model=model, args=two, train_dataset=dataset, sample_shapes=good, dflop=limited)
    with pytest.raises(SetupError, match=r"dflop\.sampler\.time_limit_s=0\.5: each of the 2 processes"):
        trainer.get_train_dataloader()
    one = DFLOPTrainer(model=model, args=args, train_dataset=dataset, sample_shapes=good, dflop=limited)
    assert one.get_train_dataloader().batch_sampler.sampler.time_limit_s == 0.5  # one rank: allowed


def test_cost_model_of_another_shape_policy_or_depth_is_refused_by_the_trainer(tiny_trainer_parts, tmp_path):
    from dataclasses import replace

    from test_costmodel import synthetic_profile

    from dflop_ds.cost import FittedCostModel, save_cost_model
    from dflop_ds.shapes import TINY_POLICY

    model, args, dataset, good = tiny_trainer_parts
    path = tmp_path / "cm.json"
    trainer = DFLOPTrainer(
        model=model, args=args, train_dataset=dataset, sample_shapes=good, dflop={"sampler": {"cost_model": str(path)}}
    )
    save_cost_model(FittedCostModel().fit(synthetic_profile(), TINY_POLICY), path)
    with pytest.raises(ValueError, match=rf"{path} was profiled under the shape policy 'tiny', but the data is shaped"):
        trainer.get_train_dataloader()
    save_cost_model(FittedCostModel().fit(synthetic_profile(), good.policy), path)  # the shapes' own policy
    with pytest.raises(ValueError, match=r"profiled for 6 encoder and 5 LLM layers, but the model has 3 encoder and 4"):
        trainer.get_train_dataloader()  # the tiny LLaVA as dflop-ds cuts it (llava_layers)
    fitting = replace(synthetic_profile(), encoder_layers=3, llm_layers=4)
    save_cost_model(FittedCostModel().fit(fitting, good.policy), path)
    assert trainer.get_train_dataloader().batch_sampler.sampler.cost_model is not None


# ---- packing: dflop.model.packing=true -------------------------------------------------------------


def test_padding_free_media_take_none_and_name_what_they_cannot_join():
    items = [{"pixel_values": torch.zeros(1, 3, 4, 4)}, {"pixel_values": None}, {}]
    assert concatenated_media(items)["pixel_values"].shape == (1, 3, 4, 4)
    assert concatenated_media([{"pixel_values": None}]) == {}
    with pytest.raises(ValueError, match="'pixel_values' of a sample is a list, not a tensor"):
        concatenated_media([{"pixel_values": [[0.0]]}])
    with pytest.raises(ValueError, match=r"samples' 'pixel_values' cannot be joined \(shapes \[\(1, 2\), \(1, 3\)\]"):
        concatenated_media([{"pixel_values": torch.zeros(1, 2)}, {"pixel_values": torch.zeros(1, 3)}])
    tiles = concatenated_media(
        [{"pixel_values": torch.ones(1, 2, 3)}, {"pixel_values": torch.ones(1, 1, 3)}], padded=("pixel_values",)
    )["pixel_values"]
    assert tiles.shape == (2, 2, 3) and tiles[1, 1].abs().sum() == 0 and tiles[1, 0].sum() == 3


@pytest.mark.parametrize("family", sorted(FAMILY_BUILDERS))
def test_packing_trains_the_padded_loss_and_balances_the_packed_cost(family, tmp_path):
    """dflop.model.packing=true with no collator, for every registered family: the loader's
    microbatches are one padding-free row with the samples' bounds (the family's collator, text-only
    items with ``pixel_values=None``), the model attends per sample, the loss is the padded batch's,
    the sampler balances the packed cost (the padded proxy without packing), and the model saves
    the config it was given (no ``use_cache: false`` written into it)."""
    from transformers import AutoConfig, AutoModelForImageTextToText, TrainingArguments

    from dflop_ds.cost import PackedCost, ProxyCost

    model_dir = FAMILY_BUILDERS[family](tmp_path / "model")
    load = lambda: AutoModelForImageTextToText.from_pretrained(str(model_dir)).eval()  # noqa: E731
    packed_model, padded_model = load(), load()
    parts = trainer_parts_of(packed_model.config)
    assert parts is not None
    items = image_chats(packed_model.config, 8)
    table = [
        SampleShape(f"s{i}", text_tokens=len(x["input_ids"]), llm_tokens=len(x["input_ids"]))
        for i, x in enumerate(items)
    ]
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=4)
    trainer = DFLOPTrainer(
        model=packed_model,
        args=args,
        train_dataset=items,
        sample_shapes=table,
        dflop={"model": {"packing": True}},
    )
    assert packed_model.config.get_text_config()._attn_implementation == "dflop_segments"
    loader = trainer.get_train_dataloader()
    sampler = loader.batch_sampler.sampler
    assert isinstance(sampler.cost_model, PackedCost) and isinstance(sampler.cost_model.cost_model, ProxyCost)
    indices = next(iter(loader.batch_sampler))
    batch = next(iter(loader))
    sampler.close()
    assert batch["input_ids"].shape == (1, sum(len(items[i]["input_ids"]) for i in indices))
    assert "attention_mask" not in batch and batch["cu_seq_lens_q"].numel() == len(indices) + 1
    assert any(items[i]["pixel_values"] is not None for i in indices)
    padded = RightPadCollator(parts.media_keys, parts.padded_keys)([items[i] for i in indices])
    with torch.no_grad():
        packed_out, padded_loss = packed_model(**batch), padded_model(**padded).loss
    assert abs(float(packed_out.loss) - float(padded_loss)) < 1e-5
    assert packed_out.past_key_values is None  # the forward ran without a cache
    packed_model.save_pretrained(tmp_path / "saved")
    saved, given = (AutoConfig.from_pretrained(d).get_text_config() for d in (tmp_path / "saved", model_dir))
    assert saved.use_cache == given.use_cache
    plain = DFLOPTrainer(
        model=padded_model,
        args=args,
        train_dataset=items,
        sample_shapes=table,
    )
    plain_sampler = plain.get_train_dataloader().batch_sampler.sampler
    assert not isinstance(plain_sampler.cost_model, PackedCost)
    plain_sampler.close()


def test_packing_keeps_a_padding_free_collator_and_refuses_a_padded_one_by_name(tiny_trainer_parts, tmp_path):
    from transformers import DataCollatorWithFlattening, Trainer

    from dflop_ds.cost import PackedCost, ProxyCost, save_cost_model
    from dflop_ds.hf_trainer import DFLOPTrainerMixin

    model, args, dataset, good = tiny_trainer_parts
    packing = {"model": {"packing": True}}
    flat = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    kept = DFLOPTrainer(
        model=model, args=args, train_dataset=dataset, data_collator=flat, sample_shapes=good, dflop=packing
    )
    assert kept.data_collator is flat
    with pytest.raises(
        ValueError, match=r"data_collator is a .*RightPadCollator.*pass no data_collator.*leave packing out"
    ):
        DFLOPTrainer(
            model=model,
            args=args,
            train_dataset=dataset,
            data_collator=RightPadCollator(),
            sample_shapes=good,
            dflop=packing,
        )
    with pytest.raises(ValueError, match=r"no sample bounds .*return_flash_attn_kwargs=True"):
        DFLOPTrainer(
            model=model,
            args=args,
            train_dataset=dataset,
            data_collator=DataCollatorWithFlattening(),
            sample_shapes=good,
            dflop=packing,
        )

    class PaddingTrainer(Trainer):  # a Trainer subclass that picks its own collator, as TRL's does
        def __init__(self, *args, **kwargs):
            super().__init__(*args, data_collator=RightPadCollator(), **kwargs)

    subclass = type("DFLOPPaddingTrainer", (DFLOPTrainerMixin, PaddingTrainer), {})
    with pytest.raises(ValueError, match=r"data_collator is a .*RightPadCollator"):
        subclass(model=model, args=args, train_dataset=dataset, sample_shapes=good, dflop=packing)
    path = tmp_path / "packed.json"
    save_cost_model(PackedCost(ProxyCost()), path)
    twice = DFLOPTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        sample_shapes=good,
        dflop={**packing, "sampler": {"cost_model": str(path)}},
    )
    with pytest.raises(ValueError, match=rf"{path}: this cost model is already packed"):
        twice.get_train_dataloader()


# ---- on two DeepSpeed ranks ----------------------------------------------------------------------


def rank_env() -> dict[str, str]:
    """What the launched ranks need: this checkout's dflop_ds first, one thread each."""
    return {
        "PYTHONPATH": repo_first_pythonpath(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }


@pytest.fixture(scope="module")
def trainer_reports(llava_inputs, tmp_path_factory):
    model, data, images = llava_inputs
    out = tmp_path_factory.mktemp("hf_trainer_run")
    args = ["--out", out, "--model", model, "--data", data, "--images", images, "--epochs", 2, "--stop_at", 2]
    result = run_on_ranks(SCRIPT, [str(a) for a in args], extra_env=rank_env(), timeout=900)
    assert all(f"{CLEAN_SHUTDOWN} {r}\n" in result.stdout for r in (0, 1)), result.stdout[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_trainer_zero2_killed_and_resumed_trains_every_sample_once_in_gas_microbatches(trainer_reports):
    runs = [report["resume"] for report in trainer_reports]
    fetched = [i for run in runs for i in run["fetched_before"] + run["fetched_after"]]
    assert np.bincount(fetched, minlength=RECORDS).tolist() == [2] * RECORDS  # 2 epochs, each sample once in each
    assert sum(len(run["fetched_before"]) for run in runs) == 2 * 8  # killed after 2 steps of 8 samples
    steps = 2 * 4  # per epoch: 3 global batches of 8, then the last 4 samples
    assert all(run["per_step"] == [GAS] * steps for run in runs) and runs[0]["steps"] == steps
    losses = runs[0]["losses"]
    assert len(losses) == steps and losses[-1] < losses[0]
    assert runs[0]["state_file"]
    assert all(run["index_types"] == ["int"] for run in runs)  # the user's Dataset gets plain ints
    assert not any(run["shm_left"] for run in runs)  # no /dev/shm buffer left, with no extra call
    telemetry = runs[0]["telemetry"]
    assert len(telemetry) == steps and all(t["dflop_predicted_imbalance"] >= 1.0 for t in telemetry)
    assert all(t["dflop_predicted_step_over_bound"] >= 1.0 - 1e-9 for t in telemetry)  # the sync model's bound
    assert all(t["dflop_predicted_step_s"] > 0 for t in telemetry)


@pytest.mark.slow
def test_trainer_zero2_survives_microbatches_without_images_on_one_rank(trainer_reports):
    had = [report["resume"]["had_images"] for report in trainer_reports]
    assert len(had[0]) == len(had[1])
    mixed = [k for k, (a, b) in enumerate(zip(*had)) if a != b]
    assert mixed, "the data never put an image-free microbatch beside one with images: the check is void"


@pytest.mark.slow
def test_trainer_sgd_step_over_uneven_microbatches_equals_the_whole_batch(trainer_reports):
    sgd = [report["sgd"] for report in trainer_reports]
    assert sorted(sgd[0]["fetched"] + sgd[1]["fetched"]) == sorted(set(sgd[0]["fetched"] + sgd[1]["fetched"]))
    assert len(sgd[0]["fetched"]) + len(sgd[1]["fetched"]) == 12
    rows = sgd[0]["rows"] + sgd[1]["rows"]
    assert len(rows) == 2 * GAS and len(set(rows)) > 1, rows  # uneven microbatches
    assert sgd[0]["max_update"] > 1e-3  # the step moved the weights
    assert sgd[0]["max_diff"] < 1e-5


@pytest.mark.slow
def test_the_example_trains_and_saves(trainer_reports):
    assert trainer_reports[0]["example"]["saved"]


# ---- ZeRO-3, LoRA, explicit batch keys and bf16 under accelerate launch ------------------------------

ADAPTER_GAS, ADAPTER_SEED = 3, 7


@pytest.fixture(scope="module")
def adapter_reports(llava_inputs, tmp_path_factory):
    """One ``accelerate launch`` with the shipped DeepSpeed plugin config pointed at
    ds_configs/hf_trainer_zero3.json with numeric batch keys (2 x 3 microbatches x 2 ranks) and a
    ``dflop.train.seed``: a LoRA model for one epoch, in bf16 where DeepSpeed's accelerator has it.
    Returns ``(bf16, reports)``."""
    from deepspeed.accelerator import get_accelerator

    model, data, images = llava_inputs
    out = tmp_path_factory.mktemp("hf_trainer_adapters")
    config = json.loads((REPO / "ds_configs" / "hf_trainer_zero3.json").read_text())
    config.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=ADAPTER_GAS, train_batch_size=12)
    config["dflop"]["train"] = {"seed": ADAPTER_SEED}
    (out / "ds.json").write_text(json.dumps(config))
    bf16 = bool(get_accelerator().is_bf16_supported())
    args = ["--out", out, "--model", model, "--data", data, "--images", images, "--deepspeed", "none"]
    args += ["--checks", "adapters", *(["--bf16"] if bf16 else [])]
    result = run_with_accelerate(
        SCRIPT,
        args,
        config_file=REPO / "examples" / "accelerate_deepspeed.yaml",
        deepspeed_config_file=out / "ds.json",
        extra_env=rank_env(),
        timeout=900,
    )
    output = result.stdout + result.stderr
    assert all(f"{CLEAN_SHUTDOWN} {r}\n" in output for r in (0, 1)), output[-3000:]
    return bf16, [json.loads((out / f"rank{r}.json").read_text())["adapters"] for r in (0, 1)]


@pytest.mark.slow
def test_trainer_zero3_lora_under_accelerate_trains_every_sample_once_ending_on_a_shorter_step(adapter_reports):
    _, runs = adapter_reports
    fetched = [i for run in runs for i in run["fetched"]]
    assert np.bincount(fetched, minlength=RECORDS).tolist() == [1] * RECORDS
    # 28 = 2 global batches of 12, then 4 samples: one microbatch of 1 for each of 2 ranks x 2
    assert all(run["per_step"] == [ADAPTER_GAS, ADAPTER_GAS, 2] for run in runs) and runs[0]["steps"] == 3
    assert all(run["zero_stage"] == 3 and run["model"] == "PeftModel" for run in runs)
    assert runs[0]["seed"] == ADAPTER_SEED  # the "dflop" block of the plugin's deepspeed_config_file
    assert runs[0]["lora_moved"] > 0  # LoRA's B matrices start at zero
    assert len(runs[0]["losses"]) == 3 and all(np.isfinite(runs[0]["losses"]))


@pytest.fixture(scope="module")
def zero3_reports(llava_inputs, tmp_path_factory):
    """One epoch of the encoder-heavy tiny LLaVA under ds_configs/zero3_small_buckets.json (buckets
    below a layer's size: the vision tower and the LLM meet apart) on 2 ranks, the DFLOP sampler
    splitting each global batch of 8 into 2 microbatches per rank; each rank's report."""
    from dflop_ds.testing.hf_tiny import build_encoder_heavy_llava

    _, data, images = llava_inputs
    out = tmp_path_factory.mktemp("hf_trainer_zero3")
    model = build_encoder_heavy_llava(out / "model")
    args = ["--out", out, "--model", model, "--data", data, "--images", images, "--checks", "zero3_buckets"]
    args += ["--deepspeed", REPO / "ds_configs" / "zero3_small_buckets.json"]
    result = run_on_ranks(SCRIPT, [str(a) for a in args], extra_env=rank_env(), timeout=900)
    assert all(f"{CLEAN_SHUTDOWN} {r}\n" in result.stdout for r in (0, 1)), result.stdout[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text())["zero3_buckets"] for r in (0, 1)]


@pytest.mark.slow
def test_zero3_with_buckets_below_a_layer_trains_every_sample_once_in_gas_microbatches(zero3_reports):
    runs = zero3_reports
    assert all(run["zero_stage"] == 3 for run in runs)
    assert all(run["buckets"] == {"prefetch": 50_000, "reduce": 50_000, "persistence": 0} for run in runs)
    fetched = [i for run in runs for i in run["fetched"]]
    assert np.bincount(fetched, minlength=RECORDS).tolist() == [1] * RECORDS
    steps = 4  # 3 global batches of 8, then the last 4 samples
    assert all(run["per_step"] == [GAS] * steps for run in runs) and runs[0]["steps"] == steps
    assert len(runs[0]["losses"]) == steps and all(np.isfinite(runs[0]["losses"]))


@pytest.mark.slow
def test_trainer_trains_in_bf16_where_the_accelerator_has_it(adapter_reports):
    bf16, runs = adapter_reports
    if not bf16:
        pytest.skip("DeepSpeed's accelerator reports no bf16 support: the launch ran in fp32")
    assert all(run["bf16"] for run in runs)


def test_a_model_without_loss_kwargs_trains_on_the_steps_token_mean(tiny_trainer_parts):
    """A model class that takes no num_items_in_batch (Qwen3-VL's) would return a per-microbatch mean:
    DFLOPTrainer then divides the summed token loss by the step's label tokens itself."""
    from transformers.modeling_outputs import CausalLMOutput

    model, args, dataset, good = tiny_trainer_parts
    model.accepts_loss_kwargs = False
    trainer = DFLOPTrainer(model=model, args=args, train_dataset=dataset, sample_shapes=good)
    assert trainer.compute_loss_func is not None
    vocab = model.config.get_text_config().vocab_size
    logits = torch.randn(2, 5, vocab)
    labels = torch.tensor([[-100, 3, 4, 5, -100], [-100, -100, 7, 8, 9]])
    summed = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
    )
    loss = trainer.compute_loss_func(CausalLMOutput(logits=logits), labels, num_items_in_batch=torch.tensor(10))
    assert torch.allclose(loss, summed / 10)
    mine = lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum()  # noqa: E731
    kept = DFLOPTrainer(model=model, args=args, train_dataset=dataset, sample_shapes=good, compute_loss_func=mine)
    assert kept.compute_loss_func is mine
