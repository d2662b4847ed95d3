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
