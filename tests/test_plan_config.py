"""Plans that configure all they assume: ZeRO 0-3 memory, precision, activation checkpointing,
tensor parallelism only for models that have it, and the DeepSpeed config `dflop-ds plan` writes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from capabilities import deny_precisions
from deepspeed.accelerator import get_accelerator
from ds_runs import run_on_ranks
from test_costmodel import synthetic_profile
from test_planner import POOL
from tiny_plans import one_stage_plan, tiny_plan, two_stage_plan

from dflop_ds.commands.main import main as cli_main
from dflop_ds.config import DFLOPConfig, fill_from_plan, get_setting, plan_deepspeed_config, set_settings
from dflop_ds.cost import FittedCostModel, reference_model, save_cost_model
from dflop_ds.plan import Cluster, Plan, PlanError, PlanFileError, make_plans, search
from dflop_ds.plan.families.core import pipeline_grid
from dflop_ds.plan.layout import Layout, Segment
from dflop_ds.precision import UnsupportedPrecisionError, check_precisions, precision_supported
from dflop_ds.shapes import TINY_POLICY
from dflop_ds.train import options
from dflop_ds.train.options import build_parser, load_run_settings, load_settings

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "data" / "mixture.jsonl"

# bytes per parameter of Adam training: (weights, gradients, optimizer state)
BYTES_PER_PARAM = {"bf16": (2, 2, 4 + 4 + 4), "fp16": (2, 2, 4 + 4 + 4), "fp32": (4, 4, 4 + 4)}
WEIGHT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_state_factor_counts_the_bytes_each_zero_stage_keeps_per_gpu(zero: int, precision: str) -> None:
    cluster = Cluster(gpus=8, zero_stage=zero, precision=precision)
    dps = np.array([1, 2, 4, 8])
    sharded = [zero >= 3, zero >= 2, zero >= 1]  # weights, gradients, optimizer
    for dp in dps:
        kept = sum(b / dp if s else b for b, s in zip(BYTES_PER_PARAM[precision], sharded))
        assert cluster.state_factor(int(dp)) == pytest.approx(kept / WEIGHT_BYTES[precision])
    # numpy arrays give the same figures element by element
    np.testing.assert_allclose(cluster.state_factor(dps), [cluster.state_factor(int(d)) for d in dps])


def test_higher_zero_stages_keep_less_and_stage_three_moves_more_bytes() -> None:
    factors = [Cluster(gpus=8, zero_stage=z).state_factor(4) for z in range(4)]
    assert factors == sorted(factors, reverse=True) and len(set(factors)) == 4
    one, three = Cluster(gpus=8, zero_stage=1), Cluster(gpus=8, zero_stage=3)
    assert three.allreduce_seconds(1e9, 4, 1) == pytest.approx(1.5 * one.allreduce_seconds(1e9, 4, 1))


@pytest.mark.parametrize(
    "fields, match", [({"zero_stage": 4}, "zero_stage"), ({"precision": "fp8"}, "precision"), ({"max_tp": 0}, "max_tp")]
)
def test_cluster_refuses_settings_outside_the_memory_model(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Cluster(gpus=8, **fields)


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_two_and_three_are_planned_without_pipeline_stages(zero: int) -> None:
    model = reference_model("llava-ov-7b-h100")
    result = search(model, Cluster(gpus=8, zero_stage=zero), POOL, 32, n_batches=1, top_k=2)
    assert result.candidates and all(s.layout.n_stages == 1 and s.family != "separate" for s in result.candidates)
    # the layouts searched: pipelines under ZeRO-1 on the same cluster, none under ZeRO 2/3
    for stage, pipelines in ((1, True), (zero, False)):
        grid = pipeline_grid(Cluster(gpus=8, zero_stage=stage), 20, 32, (1, 2, 4, 8))
        assert bool((grid[:, 1] > 1).any()) is pipelines


def test_autotp_clusters_never_combine_tensor_parallelism_with_pipeline_stages() -> None:
    result = search(
        reference_model("llava-ov-7b-h100"),
        Cluster(gpus=8, autotp=True),
        POOL,
        32,
        n_batches=1,
        top_k=6,
        families=("deepspeed", "monolithic"),
    )
    assert all(s.layout.llm.tp == 1 or s.layout.n_stages == 1 for s in result.candidates)
    assert Cluster(gpus=8).runs_shared(2, 2) and not Cluster(gpus=8, autotp=True).runs_shared(2, 2)


def tiny_cost_model() -> FittedCostModel:
    """A measured-kind cost model of a model without tensor-parallel layers, with the tiny model's
    policy and depths (5 encoder layers, 5 LLM layers)."""
    return FittedCostModel().fit(dataclasses.replace(synthetic_profile(), encoder_layers=5), TINY_POLICY)


def test_max_tp_defaults_to_one_without_tensor_parallel_layers_and_more_is_refused() -> None:
    model = tiny_cost_model()
    plans = make_plans(model, Cluster(gpus=4), POOL, 16, n_batches=1, top_k=2)
    assert all(s.layout.llm.tp == 1 and s.layout.encoder.tp == 1 for s in plans.result.candidates)
    with pytest.raises(PlanError, match="no tensor-parallel layers"):
        make_plans(model, Cluster(gpus=4, max_tp=2), POOL, 16, n_batches=1, top_k=2)
    # a model with tensor-parallel layers keeps max_tp = gpus_per_node
    analytic = make_plans(reference_model("llava-ov-7b-h100"), Cluster(gpus=8), POOL, 32, n_batches=1, top_k=2)
    assert any(s.layout.llm.tp > 1 for s in analytic.result.candidates)


@pytest.mark.parametrize(
    "precision, bf16, fp16", [("bf16", True, False), ("fp16", False, True), ("fp32", False, False)]
)
def test_the_deepspeed_config_carries_zero_stage_precision_and_checkpointing(precision, bf16, fp16) -> None:
    plan = one_stage_plan(zero_stage=3, precision=precision, activation_checkpointing=True)
    config = plan_deepspeed_config(plan, {"zero_optimization": {"overlap_comm": False}})
    assert config["zero_optimization"] == {"overlap_comm": False, "stage": 3}
    assert config["bf16"] == {"enabled": bf16} and config["fp16"] == {"enabled": fp16}
    assert config["dflop"]["model"]["activation_checkpointing"] is True
    settings = DFLOPConfig.from_dict(config["dflop"])
    assert (
        settings.model.activation_checkpointing
        and settings.plan.pipeline_stages == 1
        and settings.plan.stage_bounds == [0, 11]
    )


def test_a_plan_with_zero_two_and_a_pipeline_is_refused_naming_the_reason(tmp_path: Path) -> None:
    with pytest.raises(PlanFileError, match="pipeline engine runs ZeRO stages 0 and 1 only"):
        two_stage_plan(zero_stage=2).save(tmp_path / "plan.json")
    assert not (tmp_path / "plan.json").exists()
    plan = two_stage_plan(zero_stage=1, precision="fp32", activation_checkpointing=True)
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan


def test_a_config_that_contradicts_what_its_plan_assumed_is_refused() -> None:
    plan = one_stage_plan(zero_stage=1, precision="bf16")
    with pytest.raises(ValueError, match="zero_optimization.stage is 2, but the plan's memory model assumed ZeRO"):
        fill_from_plan({"zero_optimization": {"stage": 2}}, {}, plan)
    with pytest.raises(ValueError, match="fp16.enabled is true, but the plan's memory model assumed bf16"):
        fill_from_plan({"fp16": {"enabled": True}}, {}, plan)
    with pytest.raises(ValueError, match="dflop.model.activation_checkpointing is True, but the plan is for False"):
        fill_from_plan({}, set_settings({}, activation_checkpointing=True), plan)
    config, block = fill_from_plan({"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}, {}, plan)
    assert config["bf16"]["enabled"] and not config["fp16"]["enabled"] and config["zero_optimization"]["stage"] == 1
    assert get_setting(block, "activation_checkpointing") is False


def test_a_precision_the_device_lacks_is_refused_before_deepspeed_naming_it_and_the_device(
    tmp_path: Path, monkeypatch
) -> None:
    from dflop_ds.models import tiny_mllm_layers
    from dflop_ds.train import build_engine
    from dflop_ds.train.options import build_parser, load_settings

    deny_precisions(["fp16"], monkeypatch.setattr)
    device = f"the {get_accelerator().device_name()} device"
    config = {"train_batch_size": 2, "fp16": {"enabled": True}}
    with pytest.raises(UnsupportedPrecisionError, match=f"the DeepSpeed config trains in fp16, which {device}"):
        build_engine(*tiny_mllm_layers(seed=0), config, pipeline_stages=1)  # before DeepSpeed's own ValueError
    one_stage_plan(zero_stage=1, precision="fp16").save(tmp_path / "plan.json")
    written = tmp_path / "ds.json"
    written.write_text(json.dumps({"dflop": set_settings({}, plan=str(tmp_path / "plan.json"))}))
    with pytest.raises(
        UnsupportedPrecisionError, match=f"plan {tmp_path / 'plan.json'} trains in fp16, which {device}"
    ):
        load_settings(build_parser().parse_args(["--deepspeed_config", str(written)]))
    check_precisions(["fp32"], "a config")  # every device trains in fp32


def plan_argv(tmp_path: Path, *extra: str) -> list[str]:
    cost_model = tmp_path / "tiny_cm.json"
    save_cost_model(tiny_cost_model(), cost_model)
    return [
        "plan",
        "--gpus",
        "2",
        "--gpus-per-node",
        "2",
        "--global-batch",
        "8",
        "--cost-model",
        str(cost_model),
        "--data",
        str(DATA),
        "--policy",
        "tiny",
        "--batches",
        "1",
        "--top-k",
        "2",
        "-o",
        str(tmp_path / "plan.json"),
        *extra,
    ]


def test_cli_plan_writes_the_deepspeed_config_its_memory_model_assumed(tmp_path: Path, capsys) -> None:
    ds = tmp_path / "configs" / "ds.json"
    assert cli_main(plan_argv(tmp_path, "--deepspeed-config", str(ds))) == 0
    plan = Plan.load(tmp_path / "plan.json")
    config = json.loads(ds.read_text())
    assert plan.tensor_parallel == 1 and plan.precision == "fp32" and plan.zero_stage == 1
    assert config["zero_optimization"] == {"stage": 1}
    assert not config["bf16"]["enabled"] and not config["fp16"]["enabled"]
    settings = DFLOPConfig.from_dict(config["dflop"])
    assert (
        settings.plan.file == "../plan.json" and settings.model.activation_checkpointing is False
    )  # the config's folder
    assert settings.plan.pipeline_stages == plan.pipeline_stages and settings.plan.stage_bounds == plan.stage_bounds()
    assert config["gradient_accumulation_steps"] == plan.n_mb
    # the activation bytes per GPU its memory model left: the sampler's cap unless the config sets one
    assert plan.splitter == "dflop" and 0 < plan.memory_cap_bytes < plan.gpu_memory_bytes
    assert settings.sampler.memory_cap_bytes == plan.memory_cap_bytes
    out = capsys.readouterr().out
    assert "ZeRO 1, fp32" in out and f"activations <= {plan.memory_cap_bytes / 1e9:.1f} GB/GPU" in out


@pytest.mark.parametrize(
    "extra, reason",
    [
        (("--max-tp", "2"), "no tensor-parallel layers"),
        (("--precision", "bf16"), "tiny model trains in fp32 only"),
    ],
)
def test_cli_plan_refuses_what_the_tiny_model_cannot_run_with_the_reason(tmp_path: Path, capsys, extra, reason) -> None:
    assert cli_main(plan_argv(tmp_path, *extra)) != 0
    assert reason in capsys.readouterr().err
    assert not (tmp_path / "plan.json").exists()


def test_checkpointed_layers_give_the_same_loss_and_gradients() -> None:
    from dflop_ds.data import read_dataset
    from dflop_ds.models import TinyMLLMDataset, collate_microbatch, tiny_mllm_layers
    from dflop_ds.pipe import token_normalized_loss
    from dflop_ds.train.engine import SequentialMLLM

    shapes = read_dataset(DATA, TINY_POLICY)[:4]
    dataset = TinyMLLMDataset(shapes, seed=0)
    inputs, labels = collate_microbatch([dataset[i] for i in range(4)])
    results = []
    for checkpoint_layers in (False, True):
        model = SequentialMLLM(*tiny_mllm_layers(seed=0), checkpoint_layers=checkpoint_layers)
        loss = token_normalized_loss(model(inputs), labels)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (plain, plain_grads), (ckpt, ckpt_grads) = results
    assert torch.equal(plain, ckpt) and len(plain_grads) == len(ckpt_grads) > 0
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain_grads, ckpt_grads))


ENGINE_SCRIPT = f"""
import json, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from capabilities import deny_from_env
from dflop_ds.config import DFLOPConfig
from dflop_ds.models import tiny_mllm_layers
from dflop_ds.precision import UnsupportedPrecisionError
from dflop_ds.train import build_engine
deny_from_env()  # the precisions a test run pretends the device lacks
for path in [arg for arg in sys.argv[1:] if not arg.startswith("--local_rank")]:  # one engine per config
    config = json.loads(open(path).read())
    settings = DFLOPConfig.from_dict(config.pop("dflop"))
    try:
        trainer = build_engine(*tiny_mllm_layers(seed=0), config, pipeline_stages=settings.plan.pipeline_stages,
                               activation_checkpoint_interval=int(settings.model.activation_checkpointing))
    except UnsupportedPrecisionError as error:
        print("REFUSED", path, json.dumps(str(error)))
        continue
    engine = trainer.engine
    print("ENGINE", path, json.dumps({{"zero": engine.zero_optimization_stage(), "bf16": engine.bfloat16_enabled(),
                      "fp16": engine.fp16_enabled(), "checkpointing": trainer.module.checkpoint_layers}}))
"""
#: (ZeRO stage, precision) of the configs DeepSpeed builds engines from; ZeRO-3 last, as its
#: parameter hooks outlive its engine in the process
ENGINE_CASES = [(0, "fp32"), (2, "fp16"), (3, "bf16")]


@pytest.fixture(scope="module")
def built_engines(tmp_path_factory) -> dict[tuple[int, str], dict]:
    """What DeepSpeed built from the config each :data:`ENGINE_CASES` plan writes (``{"refused":
    message}`` where the device lacks its precision): one process on one rank builds them one
    after the other."""
    folder = tmp_path_factory.mktemp("engines")
    paths = {}
    for zero, precision in ENGINE_CASES:
        plan = tiny_plan(
            Layout(Segment(1, 1, 1), Segment(1, 1, 1), 2, ((5, 1, 5),)),
            8,
            gpus=1,
            gpus_per_node=1,
            zero_stage=zero,
            precision=precision,
            activation_checkpointing=True,
        )
        paths[zero, precision] = folder / f"ds_zero{zero}_{precision}.json"
        paths[zero, precision].write_text(json.dumps(plan_deepspeed_config(plan, {"steps_per_print": 10**6})))
    script = folder / "build.py"
    script.write_text(ENGINE_SCRIPT)
    result = run_on_ranks(script, list(paths.values()), ranks=1, timeout=400)
    lines = [line.split(" ", 2) for line in result.stdout.splitlines() if line.startswith(("ENGINE ", "REFUSED "))]
    built = {
        path: json.loads(text) if kind == "ENGINE" else {"refused": json.loads(text)} for kind, path, text in lines
    }
    return {case: built[str(path)] for case, path in paths.items()}


@pytest.mark.slow
@pytest.mark.parametrize("zero, precision", ENGINE_CASES)
def test_deepspeed_builds_an_engine_from_a_written_config(built_engines, zero: int, precision: str) -> None:
    built = built_engines[zero, precision]
    if not precision_supported(precision):  # refused by name before DeepSpeed's "not supported on your device"
        assert f"trains in {precision}, which the {get_accelerator().device_name()} device" in built["refused"]
        return
    assert built == {"zero": zero, "bf16": precision == "bf16", "fp16": precision == "fp16", "checkpointing": True}


@pytest.mark.slow
def test_a_config_written_by_cli_plan_trains_on_two_ranks(tmp_path: Path, run_train) -> None:
    """Through the ``deepspeed`` launcher: the commands a user types, ``dflop-ds plan
    --deepspeed-config`` then ``deepspeed examples/train.py --deepspeed_config``, end to end."""
    ds = tmp_path / "ds.json"
    assert cli_main(plan_argv(tmp_path, "--deepspeed-config", str(ds), "--zero-stage", "0")) == 0
    config = json.loads(ds.read_text())
    set_settings(config["dflop"], max_samples=64, steps=3, warmup_steps=1)
    ds.write_text(json.dumps(config))
    summary = tmp_path / "summary.json"
    run_train(ds, "--summary", str(summary), timeout=600, launcher="deepspeed")
    run = json.loads(summary.read_text())["summary"]
    plan = Plan.load(tmp_path / "plan.json")
    assert run["zero_stage"] == 0 and run["pipeline_stages"] == plan.pipeline_stages
    assert run["gradient_accumulation_steps"] == plan.n_mb and run["tensor_parallel"] == 1


def test_a_written_config_finds_its_plan_from_any_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = tmp_path / "configs" / "ds.json"
    assert cli_main(plan_argv(tmp_path, "--deepspeed-config", str(ds))) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    ds_config, settings = load_settings(build_parser().parse_args(["--deepspeed_config", str(ds)]))
    plan = Plan.load(tmp_path / "plan.json")
    assert Path(settings.plan.file).resolve() == (tmp_path / "plan.json").resolve()
    assert ds_config["gradient_accumulation_steps"] == plan.n_mb and settings.plan.stage_bounds == plan.stage_bounds()
    reads: list[str] = []
    monkeypatch.setattr(options, "load_plan", lambda path: reads.append(str(path)) or Plan.load(path))
    *_, followed = load_run_settings(build_parser().parse_args(["--deepspeed_config", str(ds)]))
    assert (
        followed is not None and followed.to_dict() == plan.to_dict() and len(reads) == 1
    )  # the loop's plan, read once
    (tmp_path / "plan.json").unlink()
    with pytest.raises(ValueError, match="relative to the config's folder") as info:
        load_settings(build_parser().parse_args(["--deepspeed_config", str(ds)]))
    assert str(ds) in str(info.value)
