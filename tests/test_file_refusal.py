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
