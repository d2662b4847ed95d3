"""Plan files: JSON round trip, the DeepSpeed config and stage bounds they produce."""

from __future__ import annotations

import json

import pytest

from dflop_ds.config import DFLOPConfig, plan_deepspeed_config
from dflop_ds.cost import reference_model
from dflop_ds.plan import PLAN_FORMAT_VERSION, Cluster, Plan, PlanFileError, Segment, make_plans
from dflop_ds.plan.layout import Layout, flat_bounds, separate_stages, stages_from_bounds
from dflop_ds.shapes import ShapePolicy


def _shapes(n: int = 120) -> list:
    policy = ShapePolicy()
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append(policy.shape(f"v{i}", video_frames=10 + 7 * i, text_tokens=50 + i))
        elif i % 3 == 1:
            out.append(policy.shape(f"i{i}", image_sizes=[(300 + 9 * i, 500)], text_tokens=30 + 11 * i))
        else:
            out.append(policy.shape(f"t{i}", text_tokens=40 + 13 * i))
    return out


@pytest.fixture(scope="module")
def plans():
    return make_plans(
        reference_model("llava-ov-7b-h100"),
        Cluster(gpus=16, gpu_memory_bytes=40e9),
        _shapes(),
        48,
        n_batches=1,
        top_k=2,
    )


def _manual_plan(**kw) -> Plan:
    stages = ((20, 0, 0), (7, 1, 10), (0, 0, 14))
    base = dict(
        encoder=Segment(2, 2, 4),
        llm=Segment(2, 2, 4),
        n_mb=6,
        stages=stages,
        layer_counts={"encoder": 27, "projector": 1, "llm": 24},
        global_batch_size=96,
        gpus=24,
        gpus_per_node=8,
        gpu_memory_bytes=80e9,
    )
    base.update(kw)
    return Plan(**base)


def test_plan_round_trips_through_json(tmp_path, plans) -> None:
    for plan in (plans.best, plans.best_deepspeed, plans.monolithic):
        path = tmp_path / "plan.json"
        plan.save(path)
        loaded = Plan.load(path)
        assert loaded == plan
        assert loaded.to_dict() == plan.to_dict()
        assert json.loads(path.read_text())["format_version"] == PLAN_FORMAT_VERSION == 2
        assert loaded.cost_model["is_analytic"] is True
        assert loaded.baseline_layout == plans.monolithic.layout


def test_deepspeed_config_and_stage_bounds_agree(plans) -> None:
    plan = plans.best_deepspeed
    base = {"gradient_clipping": 1.0, "train_batch_size": 1}
    cfg = plan_deepspeed_config(plan, base)
    assert base == {"gradient_clipping": 1.0, "train_batch_size": 1}  # not modified
    assert cfg["gradient_clipping"] == 1.0
    assert cfg["gradient_accumulation_steps"] == plan.n_mb
    # DeepSpeed's identity counts every rank: tp ranks (AutoTP) train the same samples
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * plan.n_mb * plan.dp * plan.llm.tp
    assert (
        cfg["train_batch_size"] // plan.llm.tp == plan.global_batch_size == plan.sampler_settings()["global_batch_size"]
    )
    assert cfg.get("tensor_parallel", {}).get("autotp_size", 1) == plan.llm.tp
    settings = DFLOPConfig.from_dict(cfg["dflop"])
    bounds = settings.plan.stage_bounds
    assert settings.plan.pipeline_stages == len(bounds) - 1 == plan.pipeline_stages
    assert bounds[0] == 0 and bounds[-1] == 27 + 1 + 28
    assert stages_from_bounds(bounds, 27, 1, 28) == plan.stages
    assert plan.world_size() == plan.pipeline_stages * plan.llm.tp * plan.dp == 16
    assert plan.sampler_settings() == {"global_batch_size": 48, "dp": plan.dp, "n_mb": plan.n_mb}


def test_stage_bounds_rescale_to_other_depths() -> None:
    plan = _manual_plan()
    assert plan.stage_bounds() == [0, 20, 38, 52]
    tiny = plan.stage_bounds(encoder_layers=4, llm_layers=6, projector_layers=1)
    assert tiny[0] == 0 and tiny[-1] == 11 and len(tiny) == 4
    assert all(b > a for a, b in zip(tiny, tiny[1:]))
    stages = stages_from_bounds(tiny, 4, 1, 6)
    # the first stage stays encoder-only, the last LLM-only, the projector stays in the middle
    assert stages[0][1:] == (0, 0) and stages[-1][:2] == (0, 0) and stages[1][1] == 1
    with pytest.raises(PlanFileError, match="cannot fill"):
        plan.stage_bounds(encoder_layers=1, llm_layers=0, projector_layers=1)


def test_separate_plan_is_refused_by_deepspeed_config() -> None:
    layout = Layout(Segment(1, 1, 8), Segment(2, 3, 4), 4, separate_stages(27, 24, 1, 3))
    plan = Plan.from_layout(
        layout,
        layer_counts={"encoder": 27, "projector": 1, "llm": 24},
        global_batch_size=64,
        gpus=32,
        gpus_per_node=8,
        gpu_memory_bytes=80e9,
        family="separate",
    )
    assert not plan.deepspeed_compatible
    assert flat_bounds(plan.stages)[-1] == 52
    with pytest.raises(PlanFileError, match="separate GPU sets"):
        plan.deepspeed_config({})
    assert Plan.from_dict(plan.to_dict()) == plan


def test_bad_plan_files_name_the_problem(tmp_path) -> None:
    good = _manual_plan().to_dict()
    path = tmp_path / "p.json"
    for mutate, message in [
        (lambda d: d.update(format_version=99), "format_version 99"),
        (lambda d: d.pop("n_mb"), "missing key 'n_mb'"),
        (lambda d: d.update(stages=[[20, 0, 0], [7, 1, 20]]), "stages hold"),
        (lambda d: d.update(stages=[[20, 0, 0], [0, 0, 0], [7, 1, 24]]), "holds no layers"),
        (lambda d: d.update(global_batch_size=3), "cannot fill"),
        (lambda d: d.update(gpus=8), "gpus is 8, but the plan's layout uses 24 GPUs"),
        (lambda d: d.update(gpus=32), "gpus is 32, but the plan's layout uses 24 GPUs"),  # hand-edited
        (lambda d: d.update(global_batch_size=100), "100 is not a multiple of dp=4 x n_mb=6 = 24"),
        (lambda d: d.update(n_mb=6.5), "n_mb must be an integer, got 6.5"),
        (lambda d: d.update(global_batch_size="96"), "global_batch_size must be an integer"),
    ]:
        data = json.loads(json.dumps(good))
        mutate(data)
        path.write_text(json.dumps(data))
        with pytest.raises(PlanFileError, match=message):
            Plan.load(path)
    path.write_text("{not json")
    with pytest.raises(PlanFileError, match="not valid JSON"):
        Plan.load(path)


def test_cli_plan_then_simulate(tmp_path, capsys) -> None:
    import argparse

    from dflop_ds.commands.plan import register

    manifest = tmp_path / "data.jsonl"
    lines = []
    for s in _shapes(60):
        record = {"id": s.sample_id, "text_tokens": s.text_tokens}
        if s.image_sizes:
            record["images"] = [list(x) for x in s.image_sizes]
        if s.video_frames:
            record["video_frames"] = s.video_frames
        lines.append(json.dumps(record))
    manifest.write_text("\n".join(lines) + "\n")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    out = tmp_path / "plan.json"
    args = parser.parse_args(
        [
            "plan",
            "--gpus",
            "8",
            "--global-batch",
            "32",
            "--cost-model",
            "llava-ov-0.5b-a100",
            "--data",
            str(manifest),
            "--batches",
            "1",
            "--top-k",
            "2",
            "-o",
            str(out),
        ]
    )
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "ANALYTIC" in text and "gap of the best shared-pipeline plan" in text
    plan = Plan.load(out)
    assert plan.deepspeed_compatible and plan.gpus == 8 and plan.global_batch_size == 32
    png = tmp_path / "gantt.png"
    args = parser.parse_args(
        [
            "simulate",
            "--plan",
            str(out),
            "--cost-model",
            "llava-ov-0.5b-a100",
            "--data",
            str(manifest),
            "--png",
            str(png),
        ]
    )
    assert args.func(args) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "monolithic baseline" in capsys.readouterr().out
