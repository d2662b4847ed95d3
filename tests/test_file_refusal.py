"""Missing, corrupt, mixed-up or wrong-version FittedCostModel and plan files are refused, naming the file."""

from __future__ import annotations

import json

import pytest

from dflop_ds.cost import load_cost_model
from dflop_ds.cost.io import FORMAT, FORMAT_VERSION
from dflop_ds.plan import Plan
from dflop_ds.plan.layout import Layout, Segment


def plan() -> Plan:
    layout = Layout(Segment(1, 1, 1), Segment(1, 1, 1), 4, ((3, 1, 0), (0, 0, 4)))
    return Plan.from_layout(
        layout,
        layer_counts={"encoder": 3, "projector": 1, "llm": 4},
        global_batch_size=16,
        gpus=2,
        gpus_per_node=8,
        gpu_memory_bytes=8e9,
        family="deepspeed",
    )


LOADERS = {"cost model": load_cost_model, "plan": Plan.load}
BAD_CONTENT = {
    "empty": "",
    "truncated": '{"format": "dflop-ds-costmodel", "format_',
    "not an object": "[1, 2, 3]",
}


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_missing_file_is_named(tmp_path, kind):
    path = tmp_path / "nowhere" / f"{kind}.json"
    with pytest.raises(OSError) as caught:
        LOADERS[kind](path)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize("kind", sorted(LOADERS))
@pytest.mark.parametrize("content", sorted(BAD_CONTENT))
def test_corrupt_file_is_named(tmp_path, kind, content):
    path = tmp_path / f"{kind} {content}.json"
    path.write_text(BAD_CONTENT[content])
    with pytest.raises(ValueError) as caught:
        LOADERS[kind](path)
    assert str(path) in str(caught.value)


def test_cost_model_of_another_version_is_refused(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION + 1}))
    with pytest.raises(ValueError, match=f"format_version {FORMAT_VERSION + 1}") as caught:
        load_cost_model(path)
    assert str(path) in str(caught.value) and "re-run" in str(caught.value)


def test_plan_of_another_version_is_refused(tmp_path):
    data = plan().to_dict()
    data["format_version"] += 1
    path = tmp_path / "old-plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"format_version {data['format_version']}") as caught:
        Plan.load(path)
    assert str(path) in str(caught.value)


def test_plan_and_cost_model_files_are_not_mixed_up(tmp_path):
    plan_path = tmp_path / "plan.json"
    plan().save(plan_path)
    assert Plan.load(plan_path) == plan()  # the good file loads
    with pytest.raises(ValueError, match="not a dflop-ds cost model") as caught:
        load_cost_model(plan_path)
    assert str(plan_path) in str(caught.value)

    fake_model = tmp_path / "costmodel.json"
    fake_model.write_text(json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "params": {}}))
    with pytest.raises(ValueError) as caught:
        Plan.load(fake_model)
    assert str(fake_model) in str(caught.value)


def test_truncated_cost_model_names_the_missing_part(tmp_path):
    path = tmp_path / "partial.json"
    header = {"format": FORMAT, "format_version": FORMAT_VERSION}
    for content, message in (
        ({**header, "kind": "fitted", "state": {"params": {}}}, "malformed cost model"),
        ({**header, "kind": "fitted"}, 'needs a "state"'),
        ({**header, "kind": "packed"}, 'needs "wraps"'),
        ({**header, "kind": "guessed", "state": {}}, "unknown cost-model kind 'guessed'"),
    ):
        path.write_text(json.dumps(content))
        with pytest.raises(ValueError, match=message) as caught:
            load_cost_model(path)
        assert str(path) in str(caught.value)


def test_a_hand_edited_fitted_cost_model_names_the_file(tmp_path):
    """Values of the right keys but the wrong kind (coefficients as text, a policy as a string)
    are refused naming the file, not as a bare conversion or attribute error."""
    from test_costmodel import synthetic_profile

    from dflop_ds.cost import FittedCostModel, cost_model_to_dict

    good = cost_model_to_dict(FittedCostModel().fit(synthetic_profile()))
    path = tmp_path / "edited.json"
    text_coef = json.loads(json.dumps(good))
    text_coef["state"]["fits"]["encoder_time"]["coef"] = ["a", "b"]
    string_policy = json.loads(json.dumps(good))
    string_policy["state"]["shape_policy"] = "bogus"
    for edited, what in ((text_coef, "could not convert"), (string_policy, "shape_policy must be an object")):
        path.write_text(json.dumps(edited))
        with pytest.raises(ValueError, match=rf"edited\.json: malformed cost model.*{what}"):
            load_cost_model(path)


@pytest.mark.parametrize(
    "old",
    [
        {"format": FORMAT, "format_version": 2, "params": {}},
        {"kind": "dflop_ds.plan.reference.AnalyticMLLM", "format_version": 1},
    ],
)
def test_cost_model_of_an_old_version_is_refused_naming_file_and_version(tmp_path, old):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    with pytest.raises(ValueError, match=r"old\.json.*format_version (2|1)"):
        load_cost_model(path)


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_syntax_errors_and_repeated_keys_name_file_line_column_and_key(tmp_path, kind):
    broken = tmp_path / "broken.json"
    broken.write_text('{\n  "format": "x",\n  "format_version" 2\n}\n')
    with pytest.raises(ValueError, match=f"{broken}: not valid JSON at line 3, column 20: Expecting ':' delimiter"):
        LOADERS[kind](broken)
    repeated = tmp_path / "repeated.json"
    repeated.write_text('{"format": "x", "nested": {"gpus": 2, "gpus": 4}}')
    with pytest.raises(ValueError, match=f"{repeated}: duplicate key 'gpus'"):
        LOADERS[kind](repeated)


def test_training_config_is_read_strictly(tmp_path):
    from dflop_ds.train.options import build_parser, load_settings

    config = tmp_path / "ds.json"
    config.write_text('{"train_batch_size": 8, "dflop": {"train": {"steps": 5, "steps": 50}}}')
    with pytest.raises(ValueError, match=f"{config}: duplicate key 'steps'"):
        load_settings(build_parser().parse_args(["--deepspeed_config", str(config)]))
    config.write_text('{"train_batch_size": 8,}')
    with pytest.raises(ValueError, match=f"{config}: not valid JSON at line 1, column 24"):
        load_settings(build_parser().parse_args(["--deepspeed_config", str(config)]))
