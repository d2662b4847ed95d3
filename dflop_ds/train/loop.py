"""The training loop: one for every model source and both DeepSpeed engine kinds.

How it is launched and what the config's ``"dflop"`` block chooses: :mod:`dflop_ds.train.options`
(whose docstring is also the training script's ``--help``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflop_ds.compose import (
    EngineSampler,
    EngineTopology,
    LaunchRunInputs,
    LaunchSettings,
    build_engine_sampler,
    engine_sampler_cost,
    launch_settings,
    resolve_launch_inputs,
)
from dflop_ds.config import DFLOPConfig
from dflop_ds.cost import CostModel, LayeredCostModel, ProxyCost
from dflop_ds.deepspeed_keys import deepspeed_keys
from dflop_ds.loader import ResumableLoader, make_loader
from dflop_ds.models.faults import inject_fault
from dflop_ds.models.source import ModelSource
from dflop_ds.plan.stages import cost_balanced_bounds
from dflop_ds.rank_lifecycle import close_running, finish_rank, release_shm_buffer_once_mapped, share_cpu_threads
from dflop_ds.schedule.correction import CostCorrection, make_correction
from dflop_ds.schedule.global_sampler import GlobalBatchSampler
from dflop_ds.shapes import SampleShape
from dflop_ds.telemetry.record import batch_tokens, throughput
from dflop_ds.telemetry.runtime import RuntimeTracker, default_jsonl_path
from dflop_ds.train.autotp import is_tensor_parallel_layer
from dflop_ds.train.colocated import DispatchingSampler, colocate, colocated_pipeline_bounds
from dflop_ds.train.engine import TrainingEngine, build_engine
from dflop_ds.train.gather import gather_full_state
from dflop_ds.train.memory_cap import device_memory_cap
from dflop_ds.zero_gather import wait_every_gather


@dataclass(frozen=True)
class EngineParts:
    """The engine a run trains and what was decided with it: the runtime ``correction`` of a
    pipeline (None: none), whether microbatches are ``packing`` and, under a colocated encoder,
    how a dataset item's tiles are read (``tile_pixels``)."""

    trainer: TrainingEngine
    correction: CostCorrection | None
    packing: bool
    tile_pixels: Callable[[Any], torch.Tensor] | None


@dataclass(frozen=True)
class Run:
    """What :func:`train` runs: the launch's settings and agreed inputs (:mod:`dflop_ds.compose`),
    this rank, the engine, the sampler with the memory cap and sync model it splits under, and
    the loader over it."""

    settings: LaunchSettings
    inputs: LaunchRunInputs
    rank: int
    parts: EngineParts
    scheduled: EngineSampler
    sampler: GlobalBatchSampler | DispatchingSampler  # scheduled.sampler, dispatched under a colocated encoder
    loader: ResumableLoader

    @property
    def cfg(self) -> DFLOPConfig:
        """The typed ``"dflop"`` block."""
        return self.settings.config

    @property
    def args(self) -> argparse.Namespace:
        """The command line."""
        return self.settings.args

    @property
    def trainer(self) -> TrainingEngine:
        """The training engine."""
        return self.parts.trainer

    @property
    def pipelined(self) -> bool:
        """Whether DeepSpeed's pipeline engine trains (more than one stage)."""
        return self.cfg.plan.pipeline_stages > 1


def main(argv: Sequence[str] | None = None) -> int:
    """Train as the config says, then end this rank (:func:`finish_rank`); 0 on success."""
    run_training(argv)
    finish_rank()
    return 0


def run_training(argv: Sequence[str] | None = None) -> None:
    """One training run of the command line ``argv``, leaving this rank's process group up (the
    process group is started on the first run). The launch's settings, inputs and sampler come
    from the composition root (:mod:`dflop_ds.compose`); the engine, loader and steps are this
    loop's. Several runs in one process must share one engine kind: DeepSpeed keeps a pipeline's
    topology in module state (``deepspeed.utils.groups.mpu``) that a later plain engine would take
    for its own data-parallel group."""
    settings = launch_settings(argv)
    world, rank = start_distributed(settings.config.train.seed)
    inputs = resolve_launch_inputs(settings, rank, world)
    parts = build_trainer(settings, inputs)
    scheduled = build_sampler(settings, inputs, parts, rank)
    sampler, loader = build_loader(settings.config, inputs, parts, scheduled.sampler)
    train(Run(settings, inputs, rank, parts, scheduled, sampler, loader))


def start_distributed(seed: int) -> tuple[int, int]:
    """Seed torch, start DeepSpeed's process group (its /dev/shm buffer released once mapped) and
    share the CPU cores among this machine's ranks; ``(world size, rank)``."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    torch.manual_seed(seed)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    wait_every_gather()  # DeepSpeed before 0.19.8 on CPU ranks: ZeRO-3's gathers read before they land
    release_shm_buffer_once_mapped()  # nothing left in /dev/shm however the run ends
    share_cpu_threads()  # CPU ranks on one machine: a share of the cores each, not all of them
    return torch.distributed.get_world_size(), torch.distributed.get_rank()


def print_stand_ins(dataset: Any, rank: int) -> None:
    """Print, on each rank that made any, how many samples its loader made as stand-ins
    (``on_bad_sample="skip"``: media that failed to load; each was logged by name when made)."""
    count = getattr(dataset, "stand_in_count", 0)
    if count:
        print(
            f"[dflop-ds] rank {rank}: {count} sample(s) whose media failed to load trained as stand-ins without"
            " targets (prefetched ones included; each named in a warning above)",
            flush=True,
        )


def stage_bounds(
    num_stages: int,
    shapes: Sequence[SampleShape],
    cost_model: CostModel | None = None,
    *,
    given: Sequence[int] | None = None,
    colocated: bool = False,
    encoder_layers: int = 0,
) -> Sequence[int] | None:
    """The pipeline's stage bounds: ``given`` (the config's) or, without them, where the
    predicted time balances; a colocated encoder leaves the pipeline, whose stages then split the
    LLM side. None: one stage, or no cost model that knows its layers and no bounds (the engine's own split)."""
    layered = cost_model if isinstance(cost_model, LayeredCostModel) else None
    if num_stages > 1 and colocated:
        return colocated_pipeline_bounds(given, encoder_layers, layered, shapes, num_stages)
    if num_stages > 1 and given is None and layered is not None:
        return cost_balanced_bounds(layered, shapes, num_stages)
    return given


def build_trainer(settings: LaunchSettings, inputs: LaunchRunInputs) -> EngineParts:
    """The training engine on the source's layers (the encoder's optional testing fault
    injected; the setup was checked with the inputs), with the run's correction and packing switch."""
    cfg, source, ds_config = settings.config, inputs.source, settings.ds_config
    colocated = cfg.model.encoder == "colocated"
    encoder, projector, llm = source.layers()
    encoder = inject_fault(encoder, cfg.testing.fault, deepspeed_keys(ds_config))  # testing only: a slow shape class
    tile_pixels = source.colocated_tile_pixels() if colocated else None  # refused now, not after building
    bounds = stage_bounds(
        cfg.plan.pipeline_stages,
        inputs.shapes,
        inputs.cost_model,
        given=cfg.plan.stage_bounds,
        colocated=colocated,
        encoder_layers=len(encoder),
    )
    trainer = build_engine(
        encoder,
        projector,
        llm,
        ds_config,
        pipeline_stages=cfg.plan.pipeline_stages,
        stage_bounds=bounds,
        freeze_encoder=cfg.model.freeze_encoder,
        lr=cfg.train.lr,
        colocated=colocated,
        hf_model=source.hf_model,
        activation_checkpoint_interval=int(cfg.model.activation_checkpointing),
    )
    correction = make_correction(cfg.correction, trainer.num_stages) if cfg.plan.pipeline_stages > 1 else None
    return EngineParts(trainer, correction, source.uses_packing(cfg.model.packing), tile_pixels)


def build_sampler(settings: LaunchSettings, inputs: LaunchRunInputs, parts: EngineParts, rank: int) -> EngineSampler:
    """This rank's sampler (:func:`~dflop_ds.compose.build_engine_sampler`) for the engine's
    topology, balancing with :func:`~dflop_ds.compose.engine_sampler_cost`, under the memory cap
    of the config, the plan or this device (a collective: every rank calls this)."""
    from deepspeed.accelerator import get_accelerator

    trainer = parts.trainer
    topology = EngineTopology.of_engine(trainer)
    sampler_cost = engine_sampler_cost(
        settings.config, inputs.cost_model, topology, packing=parts.packing, corrected=parts.correction is not None
    )
    return build_engine_sampler(
        settings,
        inputs,
        topology,
        sampler_cost,
        lambda: device_memory_cap(trainer.module, settings.ds_config, topology.dp_size, get_accelerator()),
        cost_adjuster=parts.correction,
        rank=rank,
    )


def build_loader(
    cfg: DFLOPConfig, inputs: LaunchRunInputs, parts: EngineParts, sampler: GlobalBatchSampler
) -> tuple[GlobalBatchSampler | DispatchingSampler, ResumableLoader]:
    """The sampler the loader draws from and the data loader over it: the source's (packed)
    collate, and under a colocated encoder the dispatching sampler, dataset and collate."""
    source = inputs.source
    collate = source.collate
    if parts.packing and source.packed_collate is not None:  # source.uses_packing found one
        collate = source.packed_collate
    dataset: Any = inputs.dataset
    drawn: GlobalBatchSampler | DispatchingSampler = sampler
    if (
        cfg.model.encoder == "colocated"
    ):  # under a pipeline or AutoTP every rank encodes (TrainingEngine.dispatch_ranks)
        costs = inputs.cost_model if inputs.cost_model is not None else ProxyCost()  # the encoder's dispatch costs
        drawn, dataset, collate = colocate(
            sampler,
            dataset,
            collate,
            inputs.shapes,
            costs,
            pixels_of=parts.tile_pixels,
            **parts.trainer.dispatch_ranks(),
        )
    # the loader's state is what training consumed, not what its workers prefetched
    return drawn, make_loader(dataset, drawn, collate_fn=collate, num_workers=cfg.data.num_workers)


def train(run: Run) -> None:
    """The training steps (from the checkpoint when resuming), the trained model and the summary."""
    from deepspeed.utils import RepeatingLoader

    cfg, args, trainer = run.cfg, run.args, run.trainer
    first_step = resume(trainer, run.loader, cfg, run.parts.correction) if cfg.train.resume else 0
    data_iter = iter(RepeatingLoader(run.loader))
    tracker = None
    if cfg.telemetry.enabled and run.pipelined:  # per-instruction timers exist only in the pipeline engine
        jsonl_path = args.telemetry or default_jsonl_path(run.settings.ds_config)
        tracker = RuntimeTracker(trainer.engine, run.sampler, run.parts.correction, jsonl_path=jsonl_path)
    records = [train_one_step(run, step, data_iter, tracker) for step in range(first_step, cfg.train.steps)]
    if args.output_dir:
        save_model(trainer, run.inputs.source, args.output_dir)
    if run.rank == 0 and records:
        write_summary(run, records)
    print_stand_ins(run.inputs.dataset, run.rank)
    # the scheduling thread and the loader workers (the live epoch iterator) stop with the run
    close_running(tracker, run.sampler, data_iter.data_iter)


def train_one_step(run: Run, step: int, data_iter: Any, tracker: RuntimeTracker | None) -> dict:
    """Train step ``step``: its record, its trace line, its log line and its checkpoint."""
    cfg, args, trainer, sampler = run.cfg, run.args, run.trainer, run.sampler
    if tracker:
        tracker.start_step()
    start = time.perf_counter()
    loss = trainer.train_step(data_iter)
    elapsed = time.perf_counter() - start
    record = step_record(step, loss, elapsed, sampler, run.inputs.shapes, trainer.reads_data, packed=run.parts.packing)
    if tracker:  # a collective: every rank, every step
        record["telemetry"] = tracker.end_step(step, elapsed, loss)
    first_stage = not run.pipelined or trainer.engine.is_first_stage()
    if args.trace and trainer.reads_data and first_stage and trainer.tp_coords[0] == 0:
        write_trace(args.trace, step, sampler)  # one line per data-parallel rank, not per tensor-parallel peer
    if run.rank == 0:
        print(
            f"[dflop-ds] step {step:3d} loss {record['loss']:.4f} time {elapsed:.3f}s "
            f"samples/s {record.get('samples', 0) / elapsed:.1f} "
            f"imbalance {record.get('imbalance')} sampler={cfg.sampler.kind}",
            flush=True,
        )
    done = step + 1
    if cfg.train.checkpoint_dir and (
        done == cfg.train.steps or (cfg.train.checkpoint_every and done % cfg.train.checkpoint_every == 0)
    ):
        client_state = {
            "dflop_sampler": run.loader.state_dict(),
            "dflop_step": done,
            "dflop_correction": run.parts.correction.state_dict() if run.parts.correction else None,
        }
        trainer.save_checkpoint(cfg.train.checkpoint_dir, f"step{done}", client_state)
    if args.exit_after_step is not None and step == args.exit_after_step:
        os._exit(17)
    return record


def write_summary(run: Run, records: list[dict]) -> None:
    """Print the run's summary line and write ``--summary`` (rank 0)."""
    cfg, trainer, engine = run.cfg, run.trainer, run.trainer.engine
    summary = {
        **summarize(records, cfg, trainer.dp_coords[1]),
        "packing": run.parts.packing,
        "memory_cap": asdict(run.scheduled.memory_cap),
    }
    summary.update(
        stage_bounds=trainer.stage_bounds,
        engine="pipeline" if run.pipelined else "plain",
        zero_stage=deepspeed_keys(run.settings.ds_config).stage,
        sync=str(run.scheduled.sync),
        gradient_accumulation_steps=engine.gradient_accumulation_steps(),
        train_batch_size=engine.train_batch_size(),
        model=run.inputs.source.name,
        tensor_parallel=trainer.tp_coords[1],
        tensor_parallel_layers=sharded_layers(trainer.module),
        truncated_samples=run.inputs.source.truncated_samples(),
    )
    print("[dflop-ds] summary " + json.dumps(summary), flush=True)
    if run.args.summary:
        Path(run.args.summary).parent.mkdir(parents=True, exist_ok=True)
        Path(run.args.summary).write_text(json.dumps({"summary": summary, "steps": records}, indent=1))


def save_model(trainer: TrainingEngine, source: ModelSource, directory: str) -> None:
    """Write the trained model to ``directory``: gathered on rank 0, then the source's own format
    (``save_pretrained`` for HuggingFace models, a state dict for the tiny model)."""
    state = gather_full_state(trainer)
    if torch.distributed.get_rank() != 0:
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    if source.save_pretrained is not None:
        source.save_pretrained(directory, state)
    else:
        torch.save(state, Path(directory) / "model_state.pt")
    print(f"[dflop-ds] trained model written to {directory}", flush=True)


def sharded_layers(module: torch.nn.Module) -> list[str]:
    """Names of the modules DeepSpeed AutoTP replaced by tensor-parallel ones (empty without AutoTP)."""
    return [name for name, child in module.named_modules() if is_tensor_parallel_layer(child)]


def resume(
    trainer: TrainingEngine, loader: ResumableLoader, cfg: DFLOPConfig, correction: CostCorrection | None = None
) -> int:
    """Load the latest checkpoint, restore the loader's (sampler's) position and the correction's
    state; the step to continue from."""
    if cfg.train.checkpoint_dir is None:
        raise ValueError("resuming needs dflop.train.checkpoint_dir")
    load_path, client_state = trainer.load_checkpoint(cfg.train.checkpoint_dir)
    if load_path is None:
        print(f"[dflop-ds] no checkpoint in {cfg.train.checkpoint_dir}: starting from step 0", flush=True)
        return 0
    if "dflop_sampler" not in client_state:
        raise ValueError(f"checkpoint {load_path} has no dflop sampler state: it was not written by dflop-ds")
    loader.load_state_dict(client_state["dflop_sampler"])
    if correction is not None and client_state.get("dflop_correction"):
        correction.load_state_dict(client_state["dflop_correction"])
    print(f"[dflop-ds] resumed from {load_path} at step {client_state['dflop_step']}", flush=True)
    return int(client_state["dflop_step"])


def step_record(
    step: int, loss: float, elapsed: float, sampler: Any, shapes: Sequence[Any], reads_data: bool, packed: bool = False
) -> dict:
    """Loss, time and, on ranks that draw data, the size and balance of the step's global batch."""
    record: dict[str, Any] = {"step": step, "loss": loss, "step_s": elapsed}
    sched = sampler.last_schedule
    if sched is None or not reads_data:
        return record
    record.update(
        **batch_tokens([mb for r in sched.split.ranks for mb in r], shapes, packed),
        microbatch_sizes=[len(mb) for mb in sched.split.ranks[sampler.dp_rank]],
        imbalance=[round(float(x), 4) for x in sched.imbalance()],
        step_over_bound=sched.step_over_bound(),
        schedule_ms=1e3 * sched.schedule_s,
        solver=sched.split.solver,
    )
    return record


def write_trace(path: str, step: int, sampler: Any) -> None:
    """Append the samples this data-parallel rank trained in ``step``."""
    sched = sampler.last_schedule
    line = {
        "step": step,
        "epoch": sched.epoch,
        "batch_id": sched.batch_id,
        "dp_rank": sampler.dp_rank,
        "microbatches": sched.split.ranks[sampler.dp_rank],
    }
    with open(path, "a") as handle:
        handle.write(json.dumps(line) + "\n")


def summarize(records: list[dict], cfg: DFLOPConfig, dp_size: int) -> dict:
    """Throughput and balance over the steps after warm-up."""
    timed = records[cfg.train.warmup_steps :] or records
    return {
        "sampler": cfg.sampler.kind,
        "steps": len(timed),
        "dp": dp_size,
        "pipeline_stages": cfg.plan.pipeline_stages,
        **throughput(timed),
        "imbalance_llm": float(np.mean([r["imbalance"][-1] for r in timed])),
        "imbalance_encoder": float(np.mean([r["imbalance"][0] for r in timed])),
        "first_loss": records[0]["loss"],
        "last_loss": records[-1]["loss"],
        **telemetry_summary([r["telemetry"] for r in timed if "telemetry" in r]),
    }


def telemetry_summary(telemetry: list[dict]) -> dict:
    """Observed balance and the measurement's own cost over the timed steps (empty without telemetry)."""
    if not telemetry:
        return {}
    return {
        "imbalance_observed": float(np.nanmean([t["imbalance_observed"] for t in telemetry])),
        "telemetry_overhead_frac": float(np.median([t["telemetry_overhead_frac"] for t in telemetry])),
    }
