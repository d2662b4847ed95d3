"""The training loop: one for every model source and both DeepSpeed engine kinds.

    deepspeed --num_gpus 2 examples/train.py --deepspeed_config ds_configs/tiny_mllm_pp2.json
    deepspeed --num_gpus 2 examples/train.py --deepspeed_config ds_configs/hf_zero2.json \\
        --model_name_or_path MODEL_DIR --data_path data.json --image_folder images/

The config's ``"dflop"`` block (:class:`dflop_ds.config.DFLOPConfig`) chooses the sampler, the
data, the pipeline stages (``> 1``: DeepSpeed's pipeline engine; ``1``: the plain engine with
the config's ZeRO stage) and the stage split. Without ``--model_name_or_path`` the bundled tiny
MLLM trains on synthetic tensors of the dataset's real shapes.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflop_ds.config import DFLOPConfig
from dflop_ds.cost import PackedCost, ProxyCost, StageCost
from dflop_ds.cost.stage import stage_memory_caps
from dflop_ds.launch import finish_rank, release_shm_buffer_once_mapped, share_cpu_threads
from dflop_ds.loader import make_loader
from dflop_ds.models.hf.source import hf_source
from dflop_ds.models.source import ModelSource, tiny_source
from dflop_ds.paths import check_writable, check_writable_folder
from dflop_ds.plan import Plan
from dflop_ds.plan.stages import cost_balanced_bounds, stage_shares
from dflop_ds.schedule.memory import memory_blind_model
from dflop_ds.schedule.sampler import GlobalBatchSampler, make_sampler
from dflop_ds.setup_checks import check_cost_model_fits, check_training_setup
from dflop_ds.telemetry.record import batch_tokens, throughput
from dflop_ds.telemetry.runtime import RuntimeTracker, default_jsonl_path
from dflop_ds.telemetry.setup import inject_fault, make_correction
from dflop_ds.train.autotp import is_tensor_parallel_layer
from dflop_ds.train.colocated import (
    DispatchingSampler,
    LLMOnlyCost,
    colocate,
    colocated_pipeline_bounds,
)
from dflop_ds.train.engine import TrainingEngine, build_engine
from dflop_ds.train.gather import gather_full_state
from dflop_ds.train.launch_inputs import agree_on_inputs, all_ranks_or_none
from dflop_ds.train.memory_cap import MemoryCap, device_memory_cap, resolve_memory_cap
from dflop_ds.train.options import build_parser, load_plan, load_settings


def run_memory_cap(
    cfg: DFLOPConfig, plan: Plan | None, trainer: TrainingEngine, ds_config: dict, accelerator: Any, sampler_cost: Any
) -> MemoryCap:
    """The run's memory cap (:func:`~dflop_ds.train.memory_cap.resolve_memory_cap`): the config's,
    ``plan``'s (the run's plan, if any), or the default from this device's memory (a collective:
    every rank calls this)."""
    from_plan = plan is not None and plan.memory_cap_bytes == cfg.memory_cap_bytes
    return resolve_memory_cap(
        cfg.memory_cap_bytes,
        cfg.sampler,
        from_plan,
        lambda: device_memory_cap(trainer.module, ds_config, trainer.dp_coords[1], accelerator),
        memory_blind_model(sampler_cost),
    )


def sampler_memory_cap(cap: MemoryCap, sampler_cost: Any, num_stages: int, microbatches: int) -> float | None:
    """The cap the sampler compares microbatches with: the device budget itself for a cost model
    that predicts per stage (:class:`StageCost`: each stage's share times its microbatches in
    flight) or for one stage; otherwise whole-model bytes against the smallest per-stage cap
    (:func:`~dflop_ds.cost.stage.stage_memory_caps`), which bounds every stage's share."""
    if cap.bytes is None or num_stages == 1 or getattr(sampler_cost, "memory_per_device", False):
        return cap.bytes
    return float(stage_memory_caps(cap.bytes, num_stages, microbatches).min())


def model_source(cfg: DFLOPConfig) -> ModelSource:
    """The tiny model, or the HuggingFace model of ``dflop.model.name_or_path``."""
    if cfg.model_name_or_path is None:
        return tiny_source(
            cfg.model,
            policy_name=cfg.policy,
            seed=cfg.seed,
            image_folder=cfg.image_folder,
            video_folder=cfg.video_folder,
        )
    return hf_source(
        cfg.model_name_or_path,
        image_folder=cfg.image_folder,
        lora=cfg.lora,
        max_length=cfg.max_length,
        truncation=cfg.truncation,
        video_folder=cfg.video_folder,
        video_fps=cfg.video_fps,
        video_max_frames=cfg.video_max_frames,
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


def main(argv: Sequence[str] | None = None) -> int:
    """Train as the config says; 0 on success."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import RepeatingLoader

    args = build_parser().parse_args(argv)
    ds_config, cfg = load_settings(args)
    for option in ("summary", "trace", "telemetry"):  # fail now, not after training
        if getattr(args, option):
            check_writable(getattr(args, option), f"--{option}")
    if args.output_dir:
        check_writable_folder(args.output_dir, "--output_dir")
    torch.manual_seed(cfg.seed)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    release_shm_buffer_once_mapped()  # nothing left in /dev/shm however the run ends
    share_cpu_threads()  # CPU ranks on one machine: a share of the cores each, not all of them
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()

    source = all_ranks_or_none("loading the model", lambda: model_source(cfg))  # every rank told of one's failure
    plan = load_plan(cfg.plan)
    # shape table and cost model from rank 0 (bad records named, or skipped and counted), checked on every rank
    inputs = agree_on_inputs(cfg, lambda: source.read_shapes(cfg.data, cfg.on_bad_sample), plan)
    if rank == 0:
        print_skip_report(inputs.shapes.report)
        if source.truncated_samples():
            print(f"[dflop-ds] {source.truncated_samples()} sample(s) cut at dflop.data.max_length", flush=True)
    shapes = inputs.shapes[: cfg.max_samples]
    dataset = source.make_dataset(shapes, cfg.data, cfg.on_bad_sample)  # skip: media that fail to load stand in
    loaded = dataset  # counts its stand-ins (colocation wraps `dataset` below)
    cost_model = inputs.cost_model
    if cost_model is not None:  # predictions hold only for the tiles and tokens they were profiled on
        check_cost_model_fits(
            cost_model,
            source.policy,
            encoder_layers=len(source.encoder_layers),
            llm_layers=len(source.llm_layers),
            source=str(cfg.cost_model),
        )

    encoder, projector, llm = source.layers()
    encoder = inject_fault(encoder, cfg.fault, ds_config)  # testing only: an optional slow shape class
    check_training_setup(ds_config, cfg, world, plan=plan, n_samples=len(shapes), n_layers=source.n_layers)
    pipelined, colocated = cfg.pipeline_stages > 1, cfg.encoder == "colocated"
    tile_pixels = source.colocated_tile_pixels() if colocated else None  # refused now, not after building
    bounds: Sequence[int] | None = cfg.stage_bounds
    if pipelined and colocated:  # the encoder leaves the pipeline: its stages split the LLM side
        bounds = colocated_pipeline_bounds(bounds, len(encoder), cost_model, shapes, cfg.pipeline_stages)
    elif pipelined and bounds is None and cost_model is not None:  # split where the predicted time balances
        bounds = cost_balanced_bounds(cost_model, shapes, cfg.pipeline_stages)
    trainer = build_engine(
        encoder,
        projector,
        llm,
        ds_config,
        pipeline_stages=cfg.pipeline_stages,
        stage_bounds=bounds,
        freeze_encoder=cfg.freeze_encoder,
        lr=cfg.lr,
        colocated=colocated,
        hf_model=source.hf_model,
        activation_checkpoint_interval=int(cfg.activation_checkpointing),
    )
    engine = trainer.engine
    dp_rank, dp_size = trainer.dp_coords
    correction = make_correction(cfg.correction, trainer.num_stages) if pipelined else None
    costs = cost_model if cost_model is not None else ProxyCost()  # what the sampler predicts with
    sampler_cost: Any = costs  # wrapped below for colocation and packing
    if colocated:  # the encoder is balanced by dispatch: the sampler balances the LLM alone
        sampler_cost = LLMOnlyCost(costs)
    packing = source.uses_packing(cfg.packing)
    if packing:  # a packed microbatch costs the sum of its samples (plus one constant)
        sampler_cost = PackedCost(sampler_cost)
    gas = engine.gradient_accumulation_steps()
    if (
        pipelined and cost_model is not None and correction is None and not colocated
    ):  # balance what each stage computes; its memory per stage, times the microbatches it holds
        sampler_cost = StageCost(sampler_cost, stage_shares(trainer.stage_bounds, cost_model), microbatches=gas)
    memory_cap = run_memory_cap(cfg, plan, trainer, ds_config, get_accelerator(), sampler_cost)
    microbatch_cap = sampler_memory_cap(memory_cap, sampler_cost, trainer.num_stages, gas)
    if rank == 0:
        print(f"[dflop-ds] {memory_cap.describe()}", flush=True)
        if microbatch_cap != memory_cap.bytes:
            print(
                f"[dflop-ds] no per-stage memory predictions: a microbatch's whole-model bytes are held under"
                f" {microbatch_cap:.4g} bytes, the cap over the microbatches stage 0 keeps in flight",
                flush=True,
            )
    sampler: GlobalBatchSampler | DispatchingSampler = make_sampler(
        cfg.sampler,
        shapes,
        global_batch_size=trainer.global_batch_size,
        gradient_accumulation_steps=gas,
        dp_rank=dp_rank,
        dp_size=dp_size,
        cost_model=sampler_cost,
        seed=cfg.seed,
        prefetch=cfg.prefetch,
        time_limit_s=cfg.time_limit_s,
        ilp_nodes=cfg.ilp_nodes,
        label_tokens_fn=source.label_tokens_fn,
        cost_adjuster=correction,
        lockstep=not pipelined,
        drop_last=cfg.drop_last,
        schedule_timeout_s=cfg.schedule_timeout_s,
        memory_cap=microbatch_cap,
        allow_oversize=cfg.allow_oversize,
    )
    sampler.check_steps(cfg.steps)  # a global batch the memory cap cannot split is refused before step 0
    collate = source.collate
    if packing and source.packed_collate is not None:  # source.uses_packing found one
        collate = source.packed_collate
    if colocated:  # under a pipeline or AutoTP every rank encodes (see TrainingEngine.dispatch_ranks)
        sampler, dataset, collate = colocate(
            sampler, dataset, collate, shapes, costs, pixels_of=tile_pixels, **trainer.dispatch_ranks()
        )
    # the loader's state is what training consumed, not what its workers prefetched
    loader = make_loader(dataset, sampler, collate_fn=collate, num_workers=cfg.num_workers)
    first_step = resume(trainer, loader, cfg, correction) if cfg.resume else 0
    data_iter = iter(RepeatingLoader(loader))

    tracker = None
    if cfg.telemetry and pipelined:  # per-instruction timers exist only in the pipeline engine
        tracker = RuntimeTracker(
            engine, sampler, correction, jsonl_path=args.telemetry or default_jsonl_path(ds_config)
        )
    records = []
    for step in range(first_step, cfg.steps):
        if tracker:
            tracker.start_step()
        start = time.perf_counter()
        loss = trainer.train_step(data_iter)
        elapsed = time.perf_counter() - start
        record = step_record(step, loss, elapsed, sampler, shapes, trainer.reads_data, packed=packing)
        if tracker:  # a collective: every rank, every step
            record["telemetry"] = tracker.end_step(step, elapsed, loss)
        records.append(record)
        if (
            args.trace
            and trainer.reads_data
            and (not pipelined or engine.is_first_stage())
            and trainer.tp_coords[0] == 0
        ):  # one line per data-parallel rank, not per tensor-parallel peer
            write_trace(args.trace, step, sampler)
        if rank == 0:
            print(
                f"[dflop-ds] step {step:3d} loss {record['loss']:.4f} time {elapsed:.3f}s "
                f"samples/s {record.get('samples', 0) / elapsed:.1f} "
                f"imbalance {record.get('imbalance')} sampler={cfg.sampler}",
                flush=True,
            )
        done = step + 1
        if cfg.checkpoint_dir and (done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0)):
            trainer.save_checkpoint(
                cfg.checkpoint_dir,
                f"step{done}",
                {
                    "dflop_sampler": loader.state_dict(),
                    "dflop_step": done,
                    "dflop_correction": correction.state_dict() if correction else None,
                },
            )
        if args.exit_after_step is not None and step == args.exit_after_step:
            os._exit(17)

    if args.output_dir:
        save_model(trainer, source, args.output_dir)
    if rank == 0 and records:
        summary = {**summarize(records, cfg, dp_size), "packing": packing, "memory_cap": asdict(memory_cap)}
        summary.update(
            stage_bounds=trainer.stage_bounds,
            engine="pipeline" if pipelined else "plain",
            zero_stage=int(ds_config.get("zero_optimization", {}).get("stage", 0)),
            gradient_accumulation_steps=engine.gradient_accumulation_steps(),
            train_batch_size=engine.train_batch_size(),
            model=source.name,
            tensor_parallel=trainer.tp_coords[1],
            tensor_parallel_layers=sharded_layers(trainer.module),
            truncated_samples=source.truncated_samples(),
        )
        print("[dflop-ds] summary " + json.dumps(summary), flush=True)
        if args.summary:
            Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
            Path(args.summary).write_text(json.dumps({"summary": summary, "steps": records}, indent=1))
    print_stand_ins(loaded, rank)
    # scheduling thread, loader workers (the live epoch iterator) and process group stopped before exit
    finish_rank(tracker, sampler, data_iter.data_iter)
    return 0


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
    if cfg.checkpoint_dir is None:
        raise ValueError("resuming needs dflop.train.checkpoint_dir")
    load_path, client_state = trainer.load_checkpoint(cfg.checkpoint_dir)
    if load_path is None:
        print(f"[dflop-ds] no checkpoint in {cfg.checkpoint_dir}: starting from step 0", flush=True)
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
    timed = records[cfg.warmup_steps :] or records
    return {
        "sampler": cfg.sampler,
        "steps": len(timed),
        "dp": dp_size,
        "pipeline_stages": cfg.pipeline_stages,
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
