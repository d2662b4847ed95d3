"""Train the bundled tiny MLLM under DeepSpeed's pipeline engine with a dflop-ds sampler.

    deepspeed --num_gpus 2 examples/train.py --deepspeed_config ds_configs/tiny_mllm_pp2.json

The config's "dflop" block chooses the sampler ("dflop" or "stock"), the data and the stage
split (see dflop_ds.config.DFLOPConfig). The lines marked `# dflop-ds` are all an existing
DeepSpeed pipeline script changes to adopt dflop-ds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import deepspeed
import numpy as np
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import RepeatingLoader

from dflop_ds.checks import check_training_setup
from dflop_ds.config import DFLOPConfig, fill_from_plan
from dflop_ds.data import read_dataset
from dflop_ds.launch import release_own_shm_buffer, share_cpu_threads
from dflop_ds.models import TinyMLLMConfig, TinyMLLMDataset, collate_microbatch, supervised_count, tiny_mllm_layers
from dflop_ds.pipe import MLLMPipelineModule, token_normalized_loss
from dflop_ds.schedule.sampler import make_sampler
from dflop_ds.shapes import TINY_POLICY, ShapePolicy
from dflop_ds.telemetry.record import batch_tokens, throughput
from dflop_ds.telemetry.runtime import RuntimeTracker, default_jsonl_path
from dflop_ds.telemetry.setup import inject_fault, make_correction


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON config with a \"dflop\" block")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("--sampler", choices=["dflop", "stock"], help="override \"dflop\".sampler")
    parser.add_argument("--steps", type=int, help="override \"dflop\".steps")
    parser.add_argument("--data", help="override \"dflop\".data")
    parser.add_argument("--cost-model", help="override \"dflop\".cost_model (a CostModel JSON)")
    parser.add_argument("--summary", help="write the run's figures as JSON to this path (rank 0)")
    parser.add_argument("--trace", help="append the samples each step trained, one JSON line per step and "
                                        "data-parallel rank (written by first-stage ranks)")
    parser.add_argument("--telemetry", help="append per-step telemetry JSON lines here (rank 0; default: "
                                            "dflop_telemetry.jsonl in the csv_monitor folder)")
    parser.add_argument("--resume", action="store_true", help="resume from \"dflop\".checkpoint_dir")
    parser.add_argument("--exit-after-step", type=int,
                        help="stop abruptly (no clean-up) after this step: simulates a crash in tests")
    return parser.parse_args()


def load_settings(args: argparse.Namespace) -> tuple[dict, DFLOPConfig]:
    """The DeepSpeed config without its "dflop" block, and the validated "dflop" block."""
    ds_config = json.loads(Path(args.deepspeed_config).read_text())
    block = ds_config.pop("dflop", {})
    for key, value in (("sampler", args.sampler), ("steps", args.steps), ("data", args.data),
                       ("cost_model", args.cost_model), ("resume", args.resume or None)):
        if value is not None:
            block[key] = value
    if block.get("plan"):  # dflop-ds: a plan from `dflop-ds plan` fills batch keys and the stage split
        ds_config, block = fill_from_plan(ds_config, block, load_plan(block["plan"]))
    return ds_config, DFLOPConfig.from_dict(block, source=args.deepspeed_config)


def load_cost_model(path: str | None):
    """A profiled CostModel, or None for the sampler's built-in proxy."""
    if path is None:
        return None
    from dflop_ds.profile import CostModel

    return CostModel.load(path)


def load_plan(path: str | None):
    """The plan the run must match, or None (a missing or malformed file raises naming it)."""
    if path is None:
        return None
    from dflop_ds.plan import Plan

    return Plan.load(path)


def print_skip_report(report, limit: int = 20) -> None:
    """Print what ``on_bad_sample="skip"`` dropped: the count and the first ``limit`` problems."""
    if not report.n_skipped:
        return
    print(f"[dflop-ds] {report.summary()}", flush=True)
    for problem in report.problems[:limit]:
        print(f"[dflop-ds]   skipped: {problem}", flush=True)
    if len(report.problems) > limit:
        print(f"[dflop-ds]   ... and {len(report.problems) - limit} more problem(s)", flush=True)


def main() -> int:
    args = parse_args()
    ds_config, cfg = load_settings(args)
    torch.manual_seed(cfg.seed)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    share_cpu_threads()  # CPU ranks on one machine: a share of the cores each, not all of them
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()

    model_config = TinyMLLMConfig(**cfg.model)
    policy = TINY_POLICY if cfg.policy == "tiny" else ShapePolicy()
    data = read_dataset(cfg.data, policy, on_bad_sample=cfg.on_bad_sample)  # dflop-ds: bad records named
    if rank == 0:
        print_skip_report(data.report)
    shapes = data[: cfg.max_samples]
    dataset = TinyMLLMDataset(shapes, model_config, seed=cfg.seed)

    encoder, projector, llm = tiny_mllm_layers(model_config, seed=cfg.seed)
    encoder = inject_fault(encoder, cfg.fault, ds_config)  # testing only: an optional slow shape class
    check_training_setup(ds_config, cfg, world, plan=load_plan(cfg.plan), n_samples=len(shapes),  # dflop-ds
                         n_layers=len(encoder) + 1 + len(llm))
    module = MLLMPipelineModule(  # dflop-ds: encoder + projector + LLM with an explicit split
        encoder, projector, llm, num_stages=cfg.pipeline_stages, stage_bounds=cfg.stage_bounds,
        loss_fn=token_normalized_loss, freeze_encoder=cfg.freeze_encoder,
    )
    optimizer = None
    if "optimizer" not in ds_config:
        trainable = [p for p in module.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=cfg.lr)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds_config,
                                           model_parameters=[p for p in module.parameters() if p.requires_grad])

    dp_size = engine.grid.get_data_parallel_world_size()
    correction = make_correction(cfg.correction, engine.num_stages)  # dflop-ds: adaptive correction (opt-in)
    sampler = make_sampler(  # dflop-ds: balanced global batches, GAS microbatches per dp rank
        cfg.sampler, shapes, global_batch_size=engine.train_batch_size(),
        gradient_accumulation_steps=engine.gradient_accumulation_steps(),
        dp_rank=engine.grid.get_data_parallel_rank(), dp_size=dp_size,
        cost_model=load_cost_model(cfg.cost_model), seed=cfg.seed, prefetch=cfg.prefetch,
        time_limit_s=cfg.time_limit_s, ilp_nodes=cfg.ilp_nodes, label_tokens_fn=supervised_count,
        cost_adjuster=correction,
    )
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_microbatch)
    data_iter = iter(RepeatingLoader(loader))

    first_step = resume(engine, sampler, cfg, correction) if cfg.resume else 0
    tracker = RuntimeTracker(engine, sampler, correction,  # dflop-ds: timers, correction feed, telemetry
                             jsonl_path=args.telemetry or default_jsonl_path(ds_config)) if cfg.telemetry else None
    records = []
    for step in range(first_step, cfg.steps):
        if tracker:
            tracker.start_step()
        start = time.perf_counter()
        loss = engine.train_batch(data_iter)
        elapsed = time.perf_counter() - start
        record = step_record(step, float(loss), elapsed, sampler, shapes, engine.is_first_stage())
        if tracker:  # a collective: every rank, every step
            record["telemetry"] = tracker.end_step(step, elapsed, float(loss))
        records.append(record)
        if args.trace and engine.is_first_stage():
            write_trace(args.trace, step, sampler)
        if rank == 0:
            print(f"[dflop-ds] step {step:3d} loss {record['loss']:.4f} time {elapsed:.3f}s "
                  f"samples/s {record.get('samples', 0) / elapsed:.1f} "
                  f"imbalance(enc,llm) {record.get('imbalance')} sampler={cfg.sampler}", flush=True)
        done = step + 1
        if cfg.checkpoint_dir and (done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0)):
            engine.save_checkpoint(cfg.checkpoint_dir, tag=f"step{done}",
                                   client_state={"dflop_sampler": sampler.state_dict(), "dflop_step": done,
                                                 "dflop_correction": correction.state_dict() if correction else None})
        if args.exit_after_step is not None and step == args.exit_after_step:
            os._exit(17)

    if rank == 0:
        summary = summarize(records, cfg, dp_size)
        summary.update(stage_bounds=[int(b) for b in engine.module.parts],
                       gradient_accumulation_steps=engine.gradient_accumulation_steps(),
                       train_batch_size=engine.train_batch_size())
        print("[dflop-ds] summary " + json.dumps(summary), flush=True)
        if args.summary:
            Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
            Path(args.summary).write_text(json.dumps({"summary": summary, "steps": records}, indent=1))
    if tracker:
        tracker.close()
    sampler.close()  # dflop-ds: no scheduling thread left running while the process exits
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # an orderly exit: gloo's threads stop before teardown
    release_own_shm_buffer()  # dflop-ds: DeepSpeed's CPU all-reduce buffer would stay in /dev/shm
    return 0


def resume(engine, sampler, cfg: DFLOPConfig, correction=None) -> int:
    """Load the latest checkpoint, restore the sampler's position (and the correction's state);
    the step to continue from."""
    load_path, client_state = engine.load_checkpoint(cfg.checkpoint_dir)
    if load_path is None:
        print(f"[dflop-ds] no checkpoint in {cfg.checkpoint_dir}: starting from step 0", flush=True)
        return 0
    if "dflop_sampler" not in client_state:
        raise ValueError(f"checkpoint {load_path} has no dflop sampler state: it was not written by this script")
    sampler.load_state_dict(client_state["dflop_sampler"])
    if correction is not None and client_state.get("dflop_correction"):
        correction.load_state_dict(client_state["dflop_correction"])
    print(f"[dflop-ds] resumed from {load_path} at step {client_state['dflop_step']}", flush=True)
    return int(client_state["dflop_step"])


def step_record(step: int, loss: float, elapsed: float, sampler, shapes, first_stage: bool) -> dict:
    """Loss, time and, on first-stage ranks, the size and balance of the step's global batch."""
    record = {"step": step, "loss": loss, "step_s": elapsed}
    sched = sampler.last_schedule
    if sched is None or not first_stage:
        return record
    record.update(
        **batch_tokens([mb for r in sched.split.ranks for mb in r], shapes),
        microbatch_sizes=[len(mb) for mb in sched.split.ranks[sampler.dp_rank]],
        imbalance=[round(float(x), 4) for x in sched.imbalance()],
        schedule_ms=1e3 * sched.schedule_s,
        solver=sched.split.solver,
    )
    return record


def write_trace(path: str, step: int, sampler) -> None:
    """Append the samples this data-parallel rank trained in ``step``."""
    sched = sampler.last_schedule
    line = {"step": step, "epoch": sched.epoch, "batch_id": sched.batch_id, "dp_rank": sampler.dp_rank,
            "microbatches": sched.split.ranks[sampler.dp_rank]}
    with open(path, "a") as handle:
        handle.write(json.dumps(line) + "\n")


def summarize(records: list[dict], cfg: DFLOPConfig, dp_size: int) -> dict:
    """Throughput and balance over the steps after warm-up."""
    timed = records[cfg.warmup_steps:]
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
    return {"imbalance_observed": float(np.nanmean([t["imbalance_observed"] for t in telemetry])),
            "telemetry_overhead_frac": float(np.median([t["telemetry_overhead_frac"] for t in telemetry]))}


if __name__ == "__main__":
    sys.exit(main())
