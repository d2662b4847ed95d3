"""The training loop: one for every model source and both DeepSpeed engine kinds.

How it is launched and what the config's ``"dflop"`` block chooses: :mod:`dflop_ds.train.options`
(whose docstring is also the training script's ``--help``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflop_ds.config import DFLOPConfig
from dflop_ds.cost import ProxyCost, memory_blind_model, sampler_cost_model
from dflop_ds.cost.stage import stage_memory_caps
from dflop_ds.deepspeed_keys import deepspeed_keys
from dflop_ds.loader import make_loader
from dflop_ds.models.faults import inject_fault
from dflop_ds.models.hf.source import hf_source
from dflop_ds.models.source import ModelSource, tiny_source
from dflop_ds.paths import check_writable, check_writable_folder
from dflop_ds.plan import Plan
from dflop_ds.plan.stages import cost_balanced_bounds, stage_shares
from dflop_ds.rank_lifecycle import finish_rank, release_shm_buffer_once_mapped, share_cpu_threads
from dflop_ds.schedule.correction import make_correction
from dflop_ds.schedule.sampler import make_sampler
from dflop_ds.setup_checks import check_cost_model_fits, check_training_setup
from dflop_ds.sync import SyncModel, sync_model_of
from dflop_ds.telemetry.record import batch_tokens, throughput
from dflop_ds.telemetry.runtime import RuntimeTracker, default_jsonl_path
from dflop_ds.train.autotp import is_tensor_parallel_layer
from dflop_ds.train.colocated import colocate, colocated_pipeline_bounds
from dflop_ds.train.engine import TrainingEngine, build_engine
from dflop_ds.train.gather import gather_full_state
from dflop_ds.train.launch_inputs import agree_on_inputs, all_ranks_or_none
from dflop_ds.train.memory_cap import MemoryCap, device_memory_cap, resolve_memory_cap
from dflop_ds.train.options import build_parser, load_run_settings, sampler_settings


def run_memory_cap(
    cfg: DFLOPConfig, plan: Plan | None, trainer: TrainingEngine, ds_config: dict, accelerator: Any, sampler_cost: Any
) -> MemoryCap:
    """The run's memory cap (:func:`~dflop_ds.train.memory_cap.resolve_memory_cap`): the config's,
    ``plan``'s (the run's plan, if any), or the default from this device's memory (a collective:
    every rank calls this)."""
    from_plan = plan is not None and plan.memory_cap_bytes == cfg.sampler.memory_cap_bytes
    return resolve_memory_cap(
        cfg.sampler.memory_cap_bytes,
        cfg.sampler.kind,
        from_plan,
        lambda: device_memory_cap(trainer.module, ds_config, trainer.dp_coords[1], accelerator),
        memory_blind_model(sampler_cost),
    )


def sampler_memory_cap(cap: MemoryCap, sampler_cost: Any, num_stages: int, microbatches: int) -> float | None:
    """The cap the sampler compares microbatches with: the device budget itself for a cost model
    that predicts per stage (:class:`StageCost`: each stage's share times its microbatches in
    flight) or for one stage; otherwise whole-model bytes against the smallest per-stage cap
    (:func:`~dflop_ds.cost.stage.stage_memory_caps`), which bounds every stage's share."""
    if cap.bytes is None or num_stages == 1 or sampler_cost.memory_per_device:
        return cap.bytes
    return float(stage_memory_caps(cap.bytes, num_stages, microbatches).min())


def model_source(cfg: DFLOPConfig) -> ModelSource:
    """The tiny model, or the HuggingFace model of ``dflop.model.name_or_path``."""
    if cfg.model.name_or_path is None:
        return tiny_source(
            cfg.model.tiny,
            policy_name=cfg.data.policy,
            seed=cfg.train.seed,
            image_folder=cfg.data.image_folder,
            video_folder=cfg.data.video_folder,
        )
    return hf_source(
        cfg.model.name_or_path,
        image_folder=cfg.data.image_folder,
        lora=cfg.model.lora,
        max_length=cfg.data.max_length,
        truncation=cfg.data.truncation,
        video_folder=cfg.data.video_folder,
        video_fps=cfg.data.video_fps,
        video_max_frames=cfg.data.video_max_frames,
    )


def print_skip_report(report, limit: int = 20) -> None:
    """Print what ``on_bad_sample="skip"`` dropped: the count and the first ``limit`` problems."""
    if not report.n_skipped:
        return
    print(f"[dflop-ds] {report.summary()}", flush=True)
    for problem in report.problems[:limit]:
        print(f"[dflop-ds]   skipped: {problem}", flush=True)
    if len(report.problems) > limit:
        print(f"[dflop-ds]   ... and {len(report.problems) - limit} more problem(s)", flush=True)


@dataclass
class Run:
    """What the builders of :func:`main` hand on: the settings, the inputs, the engine and the data
    pipeline of one training run (filled in that order)."""

    args: argparse.Namespace
    ds_config: dict
    cfg: DFLOPConfig
    rank: int = 0
    world: int = 1
    source: Any = None
    plan: Any = None  # the Plan the run follows, if any
    shapes: list[Any] = field(default_factory=list)
    dataset: Any = None
    cost_model: Any = None
    trainer: Any = None
    correction: Any = None
    packing: bool = False
    tile_pixels: Any = None
    memory_cap: MemoryCap | None = None
    sync: SyncModel = SyncModel.PIPELINE  # how the engine's ranks meet, from ds_config (build_sampler)
    sampler: Any = None
    loader: Any = None

    @property
    def pipelined(self) -> bool:
        """Whether DeepSpeed's pipeline engine trains (more than one stage)."""
        return self.cfg.plan.pipeline_stages > 1

    @property
    def colocated(self) -> bool:
        """Whether the encoder runs beside the LLM, dispatched by cost over the ranks."""
        return self.cfg.model.encoder == "colocated"


def main(argv: Sequence[str] | None = None) -> int:
    """Train as the config says; 0 on success."""
    run = run_settings(argv)
    run.world, run.rank = start_distributed(run.cfg.train.seed)
    load_inputs(run)
    build_trainer(run)
    build_sampler(run, build_sampler_cost(run))
    build_loader(run)
    train(run)
    return 0


def run_settings(argv: Sequence[str] | None) -> Run:
    """The command line, the config it names and the plan that names, with the output paths
    checked before training."""
    args = build_parser().parse_args(argv)
    ds_config, cfg, plan = load_run_settings(args)
    for option in ("summary", "trace", "telemetry"):  # fail now, not after training
        if getattr(args, option):
            check_writable(getattr(args, option), f"--{option}")
    if args.output_dir:
        check_writable_folder(args.output_dir, "--output_dir")
    return Run(args, ds_config, cfg, plan=plan)


def start_distributed(seed: int) -> tuple[int, int]:
    """Seed torch, start DeepSpeed's process group (its /dev/shm buffer released once mapped) and
    share the CPU cores among this machine's ranks; ``(world size, rank)``."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    torch.manual_seed(seed)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
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


def load_inputs(run: Run) -> None:
    """The model source, the shape table, the dataset and the cost model, agreed on by
    every rank (read on rank 0, bad records named, or skipped and counted) and checked."""
    cfg = run.cfg
    # every rank is told of one rank's failure to load the model (no rank left waiting in a collective)
    run.source = source = all_ranks_or_none("loading the model", lambda: model_source(cfg))
    inputs = agree_on_inputs(cfg, lambda: source.read_shapes(cfg.data.path, cfg.data.on_bad_sample), run.plan)
    if run.rank == 0:
        print_skip_report(inputs.shapes.report)
        if source.truncated_samples():
            print(f"[dflop-ds] {source.truncated_samples()} sample(s) cut at dflop.data.max_length", flush=True)
    run.shapes = inputs.shapes[: cfg.data.max_samples]
    run.dataset = source.make_dataset(
        run.shapes, cfg.data.path, cfg.data.on_bad_sample
    )  # bad media stand in under skip
    run.cost_model = inputs.cost_model
    if run.cost_model is not None:  # predictions hold only for the tiles and tokens they were profiled on
        check_cost_model_fits(
            run.cost_model,
            source.policy,
            encoder_layers=len(source.encoder_layers),
            llm_layers=len(source.llm_layers),
            source=str(cfg.sampler.cost_model),
        )


def stage_bounds(
    num_stages: int,
    shapes: Sequence[Any],
    cost_model: Any = None,
    *,
    given: Sequence[int] | None = None,
    colocated: bool = False,
    encoder_layers: int = 0,
) -> Sequence[int] | None:
    """The pipeline's stage bounds: ``given`` (the config's) or, without them, where the
    predicted time balances; a colocated encoder leaves the pipeline, whose stages then split the
    LLM side. None: one stage, or no cost model and no bounds (the engine's own split)."""
    if num_stages > 1 and colocated:
        return colocated_pipeline_bounds(given, encoder_layers, cost_model, shapes, num_stages)
    if num_stages > 1 and given is None and cost_model is not None:
        return cost_balanced_bounds(cost_model, shapes, num_stages)
    return given


def build_trainer(run: Run) -> None:
    """The training engine on the source's layers (the encoder's optional testing fault
    injected), after the setup checks, with the run's correction and packing switch."""
    cfg, source = run.cfg, run.source
    encoder, projector, llm = source.layers()
    encoder = inject_fault(
        encoder, cfg.testing.fault, deepspeed_keys(run.ds_config)
    )  # testing only: an optional slow shape class
    check_training_setup(
        run.ds_config, cfg, run.world, plan=run.plan, n_samples=len(run.shapes), n_layers=source.n_layers
    )
    if run.colocated:  # refused now, not after building
        run.tile_pixels = source.colocated_tile_pixels()
    bounds = stage_bounds(
        cfg.plan.pipeline_stages,
        run.shapes,
        run.cost_model,
        given=cfg.plan.stage_bounds,
        colocated=run.colocated,
        encoder_layers=len(encoder),
    )
    run.trainer = build_engine(
        encoder,
        projector,
        llm,
        run.ds_config,
        pipeline_stages=cfg.plan.pipeline_stages,
        stage_bounds=bounds,
        freeze_encoder=cfg.model.freeze_encoder,
        lr=cfg.train.lr,
        colocated=run.colocated,
        hf_model=source.hf_model,
        activation_checkpoint_interval=int(cfg.model.activation_checkpointing),
    )
    run.correction = make_correction(cfg.correction, run.trainer.num_stages) if run.pipelined else None
    run.packing = source.uses_packing(cfg.model.packing)


def build_sampler_cost(run: Run) -> Any:
    """The cost model the sampler balances with (:func:`~dflop_ds.cost.sampler_cost_model`)."""
    trainer, cost_model = run.trainer, run.cost_model
    return sampler_cost_model(
        cost_model,
        colocated=run.colocated,
        packed=run.packing,
        stage_shares=(lambda: stage_shares(trainer.stage_bounds, cost_model)) if run.pipelined else None,
        corrected=run.correction is not None,
        microbatches=trainer.engine.gradient_accumulation_steps(),
    )


def build_sampler(run: Run, sampler_cost: Any) -> None:
    """The run's memory cap and the sampler of this rank's microbatches."""
    from deepspeed.accelerator import get_accelerator

    trainer, gas = run.trainer, run.trainer.engine.gradient_accumulation_steps()
    run.sync = sync_model_of(run.ds_config, trainer.num_stages)
    run.memory_cap = run_memory_cap(run.cfg, run.plan, trainer, run.ds_config, get_accelerator(), sampler_cost)
    microbatch_cap = sampler_memory_cap(run.memory_cap, sampler_cost, trainer.num_stages, gas)
    if run.rank == 0:
        print(f"[dflop-ds] {run.memory_cap.describe()}", flush=True)
        if microbatch_cap != run.memory_cap.bytes:
            print(
                f"[dflop-ds] no per-stage memory predictions: a microbatch's whole-model bytes are held under"
                f" {microbatch_cap:.4g} bytes, the cap over the microbatches stage 0 keeps in flight",
                flush=True,
            )
    dp_rank, dp_size = trainer.dp_coords
    run.sampler = make_sampler(
        sampler_settings(run.cfg),
        run.shapes,
        global_batch_size=trainer.global_batch_size,
        gradient_accumulation_steps=gas,
        dp_rank=dp_rank,
        dp_size=dp_size,
        cost_model=sampler_cost,
        label_tokens_fn=run.source.label_tokens_fn,
        cost_adjuster=run.correction,
        sync=run.sync,
        memory_cap=microbatch_cap,
    )
    run.sampler.check_steps(run.cfg.train.steps)  # a global batch the memory cap cannot split is refused before step 0


def build_loader(run: Run) -> None:
    """The data loader over the sampler: the source's (packed) collate, and under a colocated
    encoder the dispatching sampler, dataset and collate."""
    source = run.source
    collate = source.collate
    if run.packing and source.packed_collate is not None:  # source.uses_packing found one
        collate = source.packed_collate
    dataset = run.dataset
    if run.colocated:  # under a pipeline or AutoTP every rank encodes (see TrainingEngine.dispatch_ranks)
        costs = run.cost_model if run.cost_model is not None else ProxyCost()  # the encoder's dispatch costs
        run.sampler, dataset, collate = colocate(
            run.sampler, dataset, collate, run.shapes, costs, pixels_of=run.tile_pixels, **run.trainer.dispatch_ranks()
        )
    # the loader's state is what training consumed, not what its workers prefetched
    run.loader = make_loader(dataset, run.sampler, collate_fn=collate, num_workers=run.cfg.data.num_workers)


def train(run: Run) -> None:
    """The training steps (from the checkpoint when resuming), the trained model and the summary."""
    from deepspeed.utils import RepeatingLoader

    cfg, args, trainer = run.cfg, run.args, run.trainer
    first_step = resume(trainer, run.loader, cfg, run.correction) if cfg.train.resume else 0
    data_iter = iter(RepeatingLoader(run.loader))
    tracker = None
    if cfg.telemetry.enabled and run.pipelined:  # per-instruction timers exist only in the pipeline engine
        jsonl_path = args.telemetry or default_jsonl_path(run.ds_config)
        tracker = RuntimeTracker(trainer.engine, run.sampler, run.correction, jsonl_path=jsonl_path)
    records = [train_one_step(run, step, data_iter, tracker) for step in range(first_step, cfg.train.steps)]
    if args.output_dir:
        save_model(trainer, run.source, args.output_dir)
    if run.rank == 0 and records:
        write_summary(run, records)
    print_stand_ins(run.dataset, run.rank)
    # scheduling thread, loader workers (the live epoch iterator) and process group stopped before exit
    finish_rank(tracker, run.sampler, data_iter.data_iter)


def train_one_step(run: Run, step: int, data_iter: Any, tracker: RuntimeTracker | None) -> dict:
    """Train step ``step``: its record, its trace line, its log line and its checkpoint."""
    cfg, args, trainer, sampler = run.cfg, run.args, run.trainer, run.sampler
    if tracker:
        tracker.start_step()
    start = time.perf_counter()
    loss = trainer.train_step(data_iter)
    elapsed = time.perf_counter() - start
    record = step_record(step, loss, elapsed, sampler, run.shapes, trainer.reads_data, packed=run.packing)
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
            "dflop_correction": run.correction.state_dict() if run.correction else None,
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
        "packing": run.packing,
        "memory_cap": asdict(run.memory_cap) if run.memory_cap is not None else None,
    }
    summary.update(
        stage_bounds=trainer.stage_bounds,
        engine="pipeline" if run.pipelined else "plain",
        zero_stage=deepspeed_keys(run.ds_config).stage,
        sync=str(run.sync),
        gradient_accumulation_steps=engine.gradient_accumulation_steps(),
        train_batch_size=engine.train_batch_size(),
        model=run.source.name,
        tensor_parallel=trainer.tp_coords[1],
        tensor_parallel_layers=sharded_layers(trainer.module),
        truncated_samples=run.source.truncated_samples(),
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


def resume(trainer: TrainingEngine, loader: Any, cfg: DFLOPConfig, correction: Any = None) -> int:
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
