"""The planner's choices on the ``bench-plan`` grid stay what they were before its speed-ups.

``tests/plan_choices_before.json`` holds the plans chosen at every grid point (written by
``benchmarks/plan_choices.py --out`` after the stage-split unification, before the search was made
faster; its search times removed). The 16384-GPU points of ``llava-ov-0.5b-a100`` and
``llava-ov-7b-a100`` were added from main at ed205f0, before the one-item-per-microbatch shortcut of
``partition_batch`` (minutes per search on a shared machine: the other profiles were not recorded).
The points up to 64 GPUs were written again by ``benchmarks/plan_choices.py --gpus 8 64 --out`` when
single-stage plans came to be scored under the cluster's sync model (issue 35: DFLOP's ``pp = 1``
split balances the summed columns at ZeRO-1's accumulation boundary; predicted steps 3-8% lower,
5 of 80 chosen plans changed layout).
The grid points up to 64 GPUs are searched again here (the larger ones: ``benchmarks/plan_choices.py
--gpus 256 1024 16384 --compare tests/plan_choices_before.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.plan_choices import differences, grid_point, summary
from dflop_ds.cost import reference_model
from dflop_ds.data import read_manifest
from dflop_ds.shapes import ShapePolicy

ROOT = Path(__file__).resolve().parents[1]
BEFORE = json.loads((Path(__file__).parent / "plan_choices_before.json").read_text())
SMALL = sorted(key for key in BEFORE if int(key.split("@")[1].split("/")[0]) <= 64)


@pytest.fixture(scope="module")
def shapes() -> list:
    return list(read_manifest(ROOT / "examples/data/mixture.jsonl", ShapePolicy()))


def test_the_fixture_covers_the_bench_grid() -> None:
    gpus = {int(key.split("@")[1].split("/")[0]) for key in BEFORE}
    assert gpus == {8, 64, 256, 1024, 16384}
    assert len(SMALL) == 24  # 6 profiles x 2 GPU counts x 2 searches


@pytest.mark.parametrize("key", SMALL)
def test_the_chosen_plans_are_the_same_as_before(key: str, shapes: list) -> None:
    name, rest = key.split("@")
    gpus, search = rest.split("/")
    now = grid_point(reference_model(name), int(gpus), shapes, 1 if search == "tp1" else None)
    assert differences({key: BEFORE[key]}, {key: now}) == []
    assert ("error" in now) == ("error" in BEFORE[key])


def test_a_changed_choice_is_reported() -> None:
    key = SMALL[0]
    if BEFORE[key].get("best") is None:
        pytest.skip("no plan at this grid point")
    changed = json.loads(json.dumps(BEFORE[key]))
    changed["best"]["stage_bounds"] = [0, 1] + changed["best"]["stage_bounds"][1:]
    changed["best_deepspeed"]["step_time_s"] *= 1.01
    lines = differences({key: BEFORE[key]}, {key: changed})
    assert [line.split(":")[0] for line in lines] == [f"{key} best", f"{key} best_deepspeed"]
    assert summary({key: BEFORE[key]}, {key: changed}).startswith("plans: 1 changed layout, ")
    assert summary({key: BEFORE[key]}, {key: changed}).endswith("+0.00% to +1.00%)")
