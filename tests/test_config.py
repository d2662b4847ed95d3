"""The "dflop" block is read strictly: wrong types and out-of-range values are refused by key and value."""

from __future__ import annotations

import pytest

from dflop_ds.config import DFLOPConfig


@pytest.mark.parametrize("key, value, message", [
    ("freeze_encoder", "false", "must be a boolean"),
    ("telemetry", "false", "must be a boolean"),
    ("resume", 1, "must be a boolean"),
    ("drop_last", "yes", "must be a boolean"),
    ("lr", "0.001", "must be a number"),
    ("time_limit_s", "5", "must be a number"),
    ("time_limit_s", True, "must be a number"),
    ("schedule_timeout_s", 0, "must be > 0"),
    ("schedule_timeout_s", "60", "must be a number"),
    ("seed", -1, "must be >= 0"),
    ("seed", 1.5, "must be an integer"),
    ("max_samples", 10.5, "must be an integer"),
    ("max_samples", 0, "must be >= 1"),
    ("steps", "20", "must be an integer"),
    ("pipeline_stages", True, "must be an integer"),
    ("prefetch", -1, "must be >= 0"),
    ("sampler", "random", "must be one of"),
    ("lr", float("nan"), "must be a number"),
    ("model", [], "must be an object"),
])
def test_bad_values_are_refused_naming_key_and_value(key, value, message):
    with pytest.raises(ValueError, match=message) as info:
        DFLOPConfig.from_dict({key: value}, source="cfg.json")
    text = str(info.value)
    assert text.startswith("cfg.json: ") and f'"dflop".{key}' in text and repr(value) in text


@pytest.mark.parametrize("block, path", [
    ({"correction": {"enabled": "false"}}, "correction.enabled"),
    ({"correction": {"decay": "0.5"}}, "correction.decay"),
    ({"fault": {"min_tiles": 3, "seconds_per_tile": "0.1"}}, "fault.seconds_per_tile"),
])
def test_nested_blocks_are_typed_too(block, path):
    with pytest.raises(ValueError, match=path.replace(".", r"\.")):
        DFLOPConfig.from_dict(block, source="cfg.json")


def test_warmup_steps_message_shows_both_values():
    with pytest.raises(ValueError) as info:
        DFLOPConfig.from_dict({"steps": 3})  # the default warmup_steps is 2: fine
        DFLOPConfig.from_dict({"steps": 2, "warmup_steps": 2})
    text = str(info.value)
    assert '"dflop".warmup_steps=2 must be smaller than "dflop".steps=2' in text and "--steps" in text


def test_good_values_pass_and_keep_their_types():
    config = DFLOPConfig.from_dict({"lr": 1, "time_limit_s": 0, "schedule_timeout_s": None, "drop_last": True,
                                    "max_samples": 64, "seed": 0, "correction": {"enabled": False}})
    assert config.drop_last is True and config.schedule_timeout_s is None and config.lr == 1
