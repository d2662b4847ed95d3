"""The DeepSpeed loop's half of the composition root (:mod:`dflop_ds.compose`): the launch's settings,
its inputs agreed across the ranks, and the sampler for the engine's :class:`EngineTopology`."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch.utils.data import Dataset

from dflop_ds.compose.sampler import schedule_sampler
from dflop_ds.config import DFLOPConfig
from dflop_ds.cost import CostModel, LayeredCostModel, memory_blind_model, sampler_cost_model
from dflop_ds.cost.stage import stage_memory_caps
from dflop_ds.data import ReadResult
from dflop_ds.data.records import ReadReport
from dflop_ds.models.hf.source import hf_source
from dflop_ds.models.source import ModelSource, tiny_source
from dflop_ds.paths import check_writable, check_writable_folder
from dflop_ds.plan import Plan
from dflop_ds.plan.stages import stage_shares
from dflop_ds.schedule.batch_schedule import CostAdjuster
from dflop_ds.schedule.global_sampler import GlobalBatchSampler
from dflop_ds.setup_checks import check_cost_model_fits, check_training_setup
from dflop_ds.shapes import SampleShape
from dflop_ds.sync import SyncModel, sync_model_of
from dflop_ds.train.launch_inputs import agree_on_inputs, all_ranks_or_none
from dflop_ds.train.memory_cap import RunMemoryCap, resolve_memory_cap
from dflop_ds.train.options import build_parser, load_run_settings

if TYPE_CHECKING:
    from dflop_ds.train.engine import TrainingEngine


@dataclass(frozen=True)
class LaunchSettings:
    """What a DeepSpeed-loop launch is told: its command line, the DeepSpeed config without its
    ``"dflop"`` block, the block typed, and the plan the run follows (None: none)."""

    args: argparse.Namespace
    ds_config: dict[str, Any]
    config: DFLOPConfig
    plan: Plan | None


def launch_settings(argv: Sequence[str] | None) -> LaunchSettings:
    """The command line ``argv`` (:func:`~dflop_ds.train.options.build_parser`), the config it
    names and the plan that names (:func:`~dflop_ds.train.options.load_run_settings`), with the
    output paths checked before training."""
    args = build_parser().parse_args(argv)
    ds_config, config, plan = load_run_settings(args)
    for option in ("summary", "trace", "telemetry"):  # fail now, not after training
        if getattr(args, option):
            check_writable(getattr(args, option), f"--{option}")
    if args.output_dir:
        check_writable_folder(args.output_dir, "--output_dir")
    return LaunchSettings(args, ds_config, config, plan)


def model_source(config: DFLOPConfig) -> ModelSource:
    """The tiny model, or the HuggingFace model of ``dflop.model.name_or_path``."""
    if config.model.name_or_path is None:
        return tiny_source(
            config.model.tiny,
            policy_name=config.data.policy,
            seed=config.train.seed,
            image_folder=config.data.image_folder,
            video_folder=config.data.video_folder,
        )
    return hf_source(
        config.model.name_or_path,
        image_folder=config.data.image_folder,
        lora=config.model.lora,
        max_length=config.data.max_length,
        truncation=config.data.truncation,
        video_folder=config.data.video_folder,
        video_fps=config.data.video_fps,
        video_max_frames=config.data.video_max_frames,
    )


def print_skip_report(report: ReadReport, limit: int = 20) -> None:
    """Print what ``on_bad_sample="skip"`` dropped: the count and the first ``limit`` problems."""
    if not report.n_skipped:
        return
    print(f"[dflop-ds] {report.summary()}", flush=True)
    for problem in report.problems[:limit]:
        print(f"[dflop-ds]   skipped: {problem}", flush=True)
    if len(report.problems) > limit:
        print(f"[dflop-ds]   ... and {len(report.problems) - limit} more problem(s)", flush=True)


@dataclass(frozen=True)
class LaunchRunInputs:
    """What every rank of a DeepSpeed-loop launch trains on, agreed across the launch: the model
    ``source``, one shape per dataset index, the dataset, and the cost model (None: the proxy)."""

    source: ModelSource
    shapes: list[SampleShape]
    dataset: Dataset
    cost_model: CostModel | None


def resolve_launch_inputs(settings: LaunchSettings, rank: int, world: int) -> LaunchRunInputs:
    """The model source, the shape table, the dataset and the cost model of a launch of ``world``
    ranks, agreed on by every rank (read on rank 0, bad records named, or skipped and counted, see
    :func:`~dflop_ds.train.launch_inputs.agree_on_inputs`) and checked against the model. Every
    rank checks the training setup of its own config
    (:func:`~dflop_ds.setup_checks.check_training_setup`: batch keys, stages, plan, a dataset
    smaller than one global batch); rank 0 does so, after printing what was skipped or cut, as soon
    as it has read the shapes, before a cost model is profiled. A collective: every rank calls it
    after ``deepspeed.init_distributed``."""
    config = settings.config
    # every rank is told of one rank's failure to load the model (no rank left waiting in a collective)
    source = all_ranks_or_none("loading the model", lambda: model_source(config))

    def check_setup(shapes: Sequence[SampleShape]) -> None:
        n_samples = len(shapes[: config.data.max_samples])
        check_training_setup(
            settings.ds_config, config, world, plan=settings.plan, n_samples=n_samples, n_layers=source.n_layers
        )

    def report_and_check(shapes: ReadResult) -> None:  # on rank 0, as soon as the shapes are read
        print_skip_report(shapes.report)
        if source.truncated_samples():
            print(f"[dflop-ds] {source.truncated_samples()} sample(s) cut at dflop.data.max_length", flush=True)
        check_setup(shapes)

    agreed = agree_on_inputs(
        config,
        lambda: source.read_shapes(config.data.path, config.data.on_bad_sample),
        settings.plan,
        check_shapes=report_and_check,
    )
    if rank != 0:
        check_setup(agreed.shapes)
    shapes = list(agreed.shapes[: config.data.max_samples])
    dataset = source.make_dataset(shapes, config.data.path, config.data.on_bad_sample)  # bad media stand in under skip
    if agreed.cost_model is not None:  # predictions hold only for the tiles and tokens they were profiled on
        check_cost_model_fits(
            agreed.cost_model,
            source.policy,
            encoder_layers=len(source.encoder_layers),
            llm_layers=len(source.llm_layers),
            source=str(config.sampler.cost_model),
        )
    return LaunchRunInputs(source, shapes, dataset, agreed.cost_model)


@dataclass(frozen=True)
class EngineTopology:
    """Where a DeepSpeed-loop rank sits and how its engine counts batches: data-parallel rank
    ``dp_rank`` of ``dp_size``, ``global_batch`` samples in ``gradient_accumulation_steps``
    microbatches per step, on ``num_stages`` pipeline stages (1: the plain engine) whose layer
    bounds over the flat layer list are ``stage_bounds``."""

    dp_rank: int
    dp_size: int
    global_batch: int
    gradient_accumulation_steps: int
    num_stages: int
    stage_bounds: Sequence[int]

    @classmethod
    def of_engine(cls, trainer: TrainingEngine) -> EngineTopology:
        """The topology of a built :class:`~dflop_ds.train.engine.TrainingEngine`."""
        dp_rank, dp_size = trainer.dp_coords
        return cls(
            dp_rank=dp_rank,
            dp_size=dp_size,
            global_batch=trainer.global_batch_size,
            gradient_accumulation_steps=trainer.engine.gradient_accumulation_steps(),
            num_stages=trainer.num_stages,
            stage_bounds=tuple(trainer.stage_bounds),
        )


def engine_sampler_cost(
    config: DFLOPConfig, cost_model: CostModel | None, topology: EngineTopology, *, packing: bool, corrected: bool
) -> CostModel:
    """The cost model a DeepSpeed-loop sampler balances with (:func:`~dflop_ds.cost.sampler_cost_model`
    over ``cost_model``): per stage on a pipeline whose cost model knows its layers."""
    pipelined = config.plan.pipeline_stages > 1
    layered = cost_model if isinstance(cost_model, LayeredCostModel) else None
    return sampler_cost_model(
        cost_model,
        colocated=config.model.encoder == "colocated",
        packed=packing,
        stage_shares=(lambda: stage_shares(topology.stage_bounds, layered)) if pipelined and layered else None,
        corrected=corrected,
        microbatches=topology.gradient_accumulation_steps,
    )


def sampler_memory_cap(cap: RunMemoryCap, sampler_cost: CostModel, num_stages: int, microbatches: int) -> float | None:
    """The cap the sampler compares microbatches with: the device budget itself for a cost model
    that predicts per stage (:class:`StageCost`: each stage's share times its microbatches in
    flight) or for one stage; otherwise whole-model bytes against the smallest per-stage cap
    (:func:`~dflop_ds.cost.stage.stage_memory_caps`), which bounds every stage's share."""
    if cap.bytes is None or num_stages == 1 or sampler_cost.memory_per_device:
        return cap.bytes
    return float(stage_memory_caps(cap.bytes, num_stages, microbatches).min())


@dataclass(frozen=True)
class EngineSampler:
    """A DeepSpeed-loop rank's sampler, the memory cap it splits under and how the ranks meet."""

    sampler: GlobalBatchSampler
    memory_cap: RunMemoryCap
    sync: SyncModel


def build_engine_sampler(
    settings: LaunchSettings,
    inputs: LaunchRunInputs,
    topology: EngineTopology,
    sampler_cost: CostModel,
    device_cap: Callable[[], RunMemoryCap],
    *,
    cost_adjuster: CostAdjuster | None = None,
    rank: int = 0,
) -> EngineSampler:
    """This rank's sampler for ``topology``: under the run's memory cap (the config's, the plan's,
    or ``device_cap()``, a collective every rank reaches) and the sync model of the DeepSpeed
    config; a global batch the cap cannot split is refused before step 0."""
    config, plan, stages = settings.config, settings.plan, topology.num_stages
    gas = topology.gradient_accumulation_steps
    sync = sync_model_of(settings.ds_config, stages)
    from_plan = plan is not None and plan.memory_cap_bytes == config.sampler.memory_cap_bytes
    cap = resolve_memory_cap(
        config.sampler.memory_cap_bytes, config.sampler.kind, from_plan, device_cap, memory_blind_model(sampler_cost)
    )
    microbatch_cap = sampler_memory_cap(cap, sampler_cost, stages, gas)
    if rank == 0:
        print(f"[dflop-ds] {cap.describe()}", flush=True)
        if microbatch_cap != cap.bytes:
            print(
                f"[dflop-ds] no per-stage memory predictions: a microbatch's whole-model bytes are held under"
                f" {microbatch_cap:.4g} bytes, the cap over the microbatches stage 0 keeps in flight",
                flush=True,
            )
    sampler = schedule_sampler(
        config,
        inputs.shapes,
        global_batch_size=topology.global_batch,
        gradient_accumulation_steps=gas,
        dp_rank=topology.dp_rank,
        dp_size=topology.dp_size,
        cost_model=sampler_cost,
        sync=sync,
        memory_cap=microbatch_cap,
        label_tokens_fn=inputs.source.label_tokens_fn,
        cost_adjuster=cost_adjuster,
    )
    sampler.check_steps(config.train.steps)  # a global batch the memory cap cannot split is refused before step 0
    return EngineSampler(sampler, cap, sync)
