"""The DeepSpeed config's own keys are read by one accessor, in every form a config writes them."""

from __future__ import annotations

import pytest

from dflop_ds.deepspeed_keys import BATCH_KEYS, DeepSpeedKeys, deepspeed_keys
from dflop_ds.setup_checks import SetupError, resolve_batch_keys


def test_an_empty_config_reads_as_deepspeeds_defaults():
    keys = deepspeed_keys({})
    assert keys == DeepSpeedKeys()
    assert (keys.zero_stage, keys.stage, keys.precision, keys.autotp_size) == (None, 0, "fp32", 1)
    assert all(keys.batch_key(key) is None for key in BATCH_KEYS)


@pytest.mark.parametrize(
    "config, zero_stage, stage",
    [
        ({"zero_optimization": {"stage": 3, "overlap_comm": True}}, 3, 3),
        ({"zero_optimization": {"stage": 0}}, 0, 0),
        ({"zero_optimization": {"overlap_comm": True}}, None, 0),  # a block without a stage
        ({"zero_optimization": None}, None, 0),
    ],
)
def test_zero_stage_as_written_and_as_trained(config, zero_stage, stage):
    keys = deepspeed_keys(config)
    assert keys.zero_stage == zero_stage and keys.stage == stage


@pytest.mark.parametrize(
    "config, precisions, precision",
    [
        ({"bf16": {"enabled": True}}, ("bf16",), "bf16"),
        ({"fp16": {"enabled": True, "loss_scale": 0}}, ("fp16",), "fp16"),
        ({"bf16": {"enabled": False}, "fp16": {"enabled": True}}, ("fp16",), "fp16"),
        ({"bf16": {"enabled": False}, "fp16": {}}, (), "fp32"),
    ],
)
def test_precision_is_the_enabled_section(config, precisions, precision):
    keys = deepspeed_keys(config)
    assert keys.precisions == precisions and keys.precision == precision


@pytest.mark.parametrize(
    "tensor_parallel, size", [(None, 1), ({}, 1), ({"autotp_size": 0}, 1), ({"autotp_size": 4}, 4)]
)
def test_autotp_size(tensor_parallel, size):
    assert deepspeed_keys({"tensor_parallel": tensor_parallel}).autotp_size == size


def test_batch_keys_keep_auto_and_refuse_it_where_a_number_is_needed():
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"}
    keys = deepspeed_keys(config)
    assert (keys.train_batch_size, keys.train_micro_batch_size_per_gpu, keys.gradient_accumulation_steps) == (
        "auto",
        4,
        "auto",
    )
    assert keys.batch_key("train_micro_batch_size_per_gpu") == 4
    with pytest.raises(ValueError, match="train_batch_size must be a positive integer, got 'auto'"):
        keys.batch_key("train_batch_size")
    with pytest.raises(SetupError, match="gradient_accumulation_steps must be a positive integer, got 'auto'"):
        resolve_batch_keys({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"}, dp=2)
    assert resolve_batch_keys({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, dp=2) == (
        16,
        4,
        2,
    )


def test_an_auto_zero_stage_is_kept_as_written_and_refused_where_a_stage_is_needed():
    """HF-style ``"stage": "auto"`` reads (the Trainer's accelerate fills it in), but what needs
    the stage itself is told the key instead of a bare ``int("auto")`` error."""
    keys = deepspeed_keys({"zero_optimization": {"stage": "auto"}})
    assert keys.zero_stage == "auto"
    with pytest.raises(ValueError, match=r'zero_optimization\.stage is "auto", which only the HF Trainer'):
        int(keys.stage)
    assert deepspeed_keys({"zero_optimization": {"stage": "2"}}).stage == 2


@pytest.mark.parametrize("stage", ["two", 4, -1, True, 2.5, [2]])
def test_a_malformed_zero_stage_is_refused_naming_the_key_and_value(stage):
    with pytest.raises(ValueError, match=r"zero_optimization\.stage must be one of \[0, 1, 2, 3\] or \"auto\"") as info:
        deepspeed_keys({"zero_optimization": {"stage": stage}})
    assert repr(stage) in str(info.value)


def test_the_deepspeed_loop_refuses_an_auto_zero_stage_before_deepspeed_naming_the_key_and_config(tmp_path):
    """``examples/train.py`` hands the config to DeepSpeed as written: nothing fills an ``"auto"``
    stage, so its settings refuse it, naming the key and the config."""
    import json

    from dflop_ds.compose import launch_settings

    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 4, "zero_optimization": {"stage": "auto"}}))
    with pytest.raises(ValueError, match=r'zero_optimization\.stage is "auto"') as info:
        launch_settings(["--deepspeed_config", str(config)])
    assert str(config) in str(info.value)
