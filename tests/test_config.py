"""The "dflop" block is read strictly: wrong types and out-of-range values are refused by key and value."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dflop_ds.config import DFLOPConfig, get_setting, set_settings, setting_names
from dflop_ds.deepspeed_keys import deepspeed_keys
from dflop_ds.models.faults import FaultSpec, SlowTiles, inject_fault
from dflop_ds.models.hf.lora import LoraSettings
from dflop_ds.schedule.correction import CorrectionSettings, make_correction
from dflop_ds.setup_checks import check_training_setup

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "key, value, message",
    [
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
        ("cost_model", "", "must be a non-empty string"),
        ("cost_model", "  ", "must be a non-empty string"),
        ("data", "", "must be a non-empty string"),
        ("image_folder", "", "must be a non-empty string"),
        ("model_name_or_path", "", "must be a non-empty string"),
        ("plan", "", "must be a non-empty string"),
        ("checkpoint_dir", "", "must be a non-empty string"),
    ],
)
def test_bad_values_are_refused_naming_key_and_value(key, value, message):
    with pytest.raises(ValueError, match=message) as info:
        DFLOPConfig.from_dict(set_settings({}, **{key: value}), source="cfg.json")
    text = str(info.value)
    assert text.startswith("cfg.json: ") and DFLOPConfig.path(key) in text and repr(value) in text


@pytest.mark.parametrize(
    "block, path",
    [
        ({"correction": {"enabled": "false"}}, "dflop.correction.enabled"),
        ({"correction": {"decay": "0.5"}}, "dflop.correction.decay"),
        ({"testing": {"fault": {"min_tiles": 3, "seconds_per_tile": "0.1"}}}, "dflop.testing.fault.seconds_per_tile"),
    ],
)
def test_nested_blocks_are_typed_too(block, path):
    with pytest.raises(ValueError, match=path.replace(".", r"\.")):
        DFLOPConfig.from_dict(block, source="cfg.json")


def test_warmup_steps_message_shows_both_values():
    with pytest.raises(ValueError) as info:
        DFLOPConfig.from_dict({"train": {"steps": 3}})  # the default warmup_steps is 2: fine
        DFLOPConfig.from_dict({"train": {"steps": 2, "warmup_steps": 2}})
    text = str(info.value)
    assert "dflop.train.warmup_steps=2 must be smaller than dflop.train.steps=2" in text and "--steps" in text


def test_good_values_pass_and_keep_their_types():
    config = DFLOPConfig.from_dict(
        {
            "train": {"lr": 1, "seed": 0},
            "data": {"max_samples": 64},
            "sampler": {"time_limit_s": 0, "schedule_timeout_s": None, "drop_last": True},
            "correction": {"enabled": False},
        }
    )
    assert config.sampler.drop_last is True and config.sampler.schedule_timeout_s is None and config.train.lr == 1


@pytest.mark.parametrize(
    "block, named",
    [
        ({"ilp_nodes": 3}, "unknown key dflop.ilp_nodes; it moved to dflop.sampler.ilp_nodes"),
        ({"steps": 3}, "unknown key dflop.steps; it moved to dflop.train.steps"),
        ({"model_name_or_path": "m"}, "it moved to dflop.model.name_or_path"),
        ({"sampler": "stock"}, "a flat dflop.sampler moved to dflop.sampler.kind"),
        ({"plan": "plan.json"}, "a flat dflop.plan moved to dflop.plan.file"),
        ({"telemetry": False}, "a flat dflop.telemetry moved to dflop.telemetry.enabled"),
        ({"sampler": {"ilp_node": 3}}, "unknown key dflop.sampler.ilp_node; known keys of dflop.sampler:"),
        ({"samplers": {}}, "unknown key dflop.samplers; known keys of dflop:"),
    ],
)
def test_old_flat_keys_and_unknown_keys_are_refused_by_their_full_path(block, named):
    with pytest.raises(ValueError) as info:
        DFLOPConfig.from_dict(block, source="cfg.json")
    assert str(info.value).startswith("cfg.json: ") and named in str(info.value)


def test_a_null_section_is_refused_without_the_flat_key_hint():
    with pytest.raises(ValueError, match=r"cfg\.json: dflop\.sampler must be an object.*got None$"):
        DFLOPConfig.from_dict({"sampler": None}, source="cfg.json")


def test_every_setting_has_one_path_and_round_trips_through_the_nested_block():
    names = setting_names()
    paths = [DFLOPConfig.path(name) for name in names]
    assert len(set(paths)) == len(paths) and all(p.startswith("dflop.") for p in paths)
    block = set_settings(
        {},
        sampler="stock",
        steps=7,
        warmup_steps=1,
        model_name_or_path=None,
        telemetry=False,
        pipeline_stages=3,
        correction={"enabled": False},
        fault=None,
    )
    assert block["sampler"] == {"kind": "stock"} and block["plan"] == {"pipeline_stages": 3}
    assert block["correction"] == {"enabled": False} and get_setting(block, "steps") == 7
    config = DFLOPConfig.from_dict(block)
    assert (config.sampler.kind, config.train.steps, config.telemetry.enabled, config.plan.pipeline_stages) == (
        "stock",
        7,
        False,
        3,
    )
    with pytest.raises(ValueError, match="a flat dflop.sampler moved to dflop.sampler.kind"):
        set_settings({"sampler": "stock"}, steps=3)


@pytest.mark.parametrize("path", sorted((ROOT / "ds_configs").glob("*.json")), ids=lambda p: p.name)
def test_bundled_configs_use_the_nested_block(path):
    DFLOPConfig.from_deepspeed_config(path)


@pytest.mark.parametrize(
    "settings, path",
    [
        ({"model": {"hidden": 64}}, "dflop.model.tiny"),
        ({"fault": {"min_tiles": 3, "seconds_per_tile": 0.1}}, "dflop.testing.fault"),
    ],
)
def test_tiny_model_settings_are_refused_with_a_huggingface_model(settings, path):
    block = set_settings({}, model_name_or_path="models/llava", **settings)
    with pytest.raises(ValueError, match=f"cfg.json: {path} .* does not apply to the HuggingFace model"):
        DFLOPConfig.from_dict(block, source="cfg.json")
    DFLOPConfig.from_dict(set_settings({}, **settings), source="cfg.json")  # the tiny model takes them


@pytest.mark.parametrize(
    "settings, path", [({"max_length": 64}, "max_length"), ({"truncation": "truncate"}, "truncation")]
)
def test_tokenization_settings_are_refused_with_the_tiny_model(settings, path):
    with pytest.raises(ValueError, match=f"cfg.json: dflop.data.{path} sets a HuggingFace model's tokenization"):
        DFLOPConfig.from_dict(set_settings({}, **settings), source="cfg.json")
    DFLOPConfig.from_dict(set_settings({}, model_name_or_path="models/llava", **settings), source="cfg.json")


def test_the_configuration_doc_lists_every_key_and_sampler():
    from dflop_ds.config import _sections
    from dflop_ds.schedule.splitters import splitter_names

    rows = {
        line.split("|")[1].strip(" `"): line
        for line in (ROOT / "docs" / "configuration.md").read_text().splitlines()
        if line.startswith("| `")
    }
    for section, keys in _sections().items():
        assert section in rows, section
        for key in keys:
            assert key == "*" or f"`{key}`" in rows[section], f"dflop.{section}.{key} is not in docs/configuration.md"
    assert all(f'`"{kind}"`' in rows["sampler"] for kind in splitter_names())


def test_sections_are_typed_and_frozen():
    config = DFLOPConfig.from_dict(
        {
            "model": {"name_or_path": "models/llava", "lora": {"r": 4, "target_modules": ["q_proj"]}},
            "sampler": {"kind": "stock"},
            "correction": {"enabled": True, "decay": 0.5},
        }
    )
    assert config.model.lora == LoraSettings(r=4, target_modules=("q_proj",))
    assert config.correction == CorrectionSettings(enabled=True, decay=0.5)
    assert config.sampler.kind == "stock" and config.testing.fault is None
    tiny = DFLOPConfig.from_dict({"testing": {"fault": {"min_tiles": 3, "seconds_per_tile": 0.1}}})
    assert tiny.testing.fault == FaultSpec(min_tiles=3, seconds_per_tile=0.1) and tiny.model.lora is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.sampler.kind = "dflop"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.correction.enabled = False  # type: ignore[misc]


def test_sub_sections_are_parsed_once_and_readers_take_them_typed(monkeypatch):
    """Correction, fault and LoRA settings are parsed by DFLOPConfig.from_dict alone: the setup
    checks and the correction and fault builders take the typed sections, never a dict again."""
    calls = {"correction": 0, "fault": 0, "lora": 0}

    def counted(name, parse):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return parse(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(CorrectionSettings, "from_dict", counted("correction", CorrectionSettings.from_dict))
    monkeypatch.setattr(FaultSpec, "from_dict", counted("fault", FaultSpec.from_dict))
    monkeypatch.setattr(LoraSettings, "from_dict", counted("lora", LoraSettings.from_dict))
    ds_config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4}
    config = DFLOPConfig.from_settings(
        correction={"enabled": True}, fault={"min_tiles": 2, "seconds_per_tile": 0.0, "start_step": 1}
    )
    hf = DFLOPConfig.from_settings(model_name_or_path="models/llava", lora={"r": 4}, pipeline_stages=1)
    parsed = dict(calls)
    assert parsed == {"correction": 2, "fault": 2, "lora": 1}  # once per block (the tiny model's has no LoRA)
    check_training_setup(ds_config, config, world_size=4)
    check_training_setup(ds_config, hf, world_size=2)
    correction = make_correction(config.correction, n_stages=2)
    layers = inject_fault([torch.nn.Identity()], config.testing.fault, deepspeed_keys(ds_config))
    assert calls == parsed  # the readers parse nothing again
    assert correction is not None and correction.settings is config.correction
    assert isinstance(layers[0], SlowTiles) and layers[0].spec is config.testing.fault
    assert layers[0].start_call == 1 * 4  # start_step counts steps of gradient_accumulation_steps microbatches


@pytest.mark.parametrize("in_config", [True, False])
def test_an_empty_cost_model_is_refused_by_both_kinds_of_entry_point(tmp_path, in_config):
    """``"cost_model": ""`` names no file: the DeepSpeed loop's settings (the config's key or
    ``--cost-model ""``) and a Trainer's block refuse it naming the key and where it came from,
    instead of running on the proxy as if the key were left out."""
    import json

    from dflop_ds.compose import dflop_settings, launch_settings

    config = tmp_path / "ds.json"
    block = {"sampler": {"cost_model": ""}} if in_config else {}
    config.write_text(json.dumps({"train_batch_size": 4, "dflop": block}))
    argv = ["--deepspeed_config", str(config)] + ([] if in_config else ["--cost-model", ""])
    with pytest.raises(ValueError, match="dflop.sampler.cost_model must be a non-empty string") as info:
        launch_settings(argv)
    assert str(info.value).startswith(str(config))
    with pytest.raises(ValueError, match=r"DFLOPTrainer\(dflop=...\): dflop.sampler.cost_model must be a non-empty"):
        dflop_settings({"sampler": {"cost_model": ""}}, None)
